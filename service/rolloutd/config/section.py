"""What every section of the configuration is: a frozen model that refuses unknown keys (a
mistyped key is an error that names it) and documents each field with the docstring under it,
from which ``scripts/gen_docs.py`` writes docs/configuration.md."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
