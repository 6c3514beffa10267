"""What every section of the configuration is: a frozen model that refuses unknown keys (a
mistyped key is an error that names it) and documents each field with the docstring under it,
from which ``scripts/gen_docs.py`` writes docs/configuration.md.

A key that configures a component takes its default and meaning from that component's own frozen
config (:func:`owned`) instead of restating them; only the range the key accepts is stated here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


@cache
def _attribute_docs(owner: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def owned(owner: type, name: str, **constraints: Any) -> Any:
    """A key whose default and meaning the component config ``owner`` declares (its field
    ``name``); only the accepted range is stated here."""
    field = {f.name: f for f in dataclasses.fields(owner)}[name]
    return Field(field.default, description=_attribute_docs(owner)[name], **constraints)
