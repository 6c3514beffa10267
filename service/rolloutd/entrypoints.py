"""Entry points: user code named as ``"package.module:attribute"`` (a finishing stage, a sibling
runner), imported from the service's Python path (an installed package or ``PYTHONPATH``)."""

from __future__ import annotations

import importlib
import re
from typing import Any

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
"""What an entry point looks like: a dotted module, a colon, a dotted attribute."""


class EntryPointError(ValueError):
    """An entry point is malformed, or its module or attribute cannot be found."""


def load(spec: str) -> Any:
    """The object ``spec`` names; raises :class:`EntryPointError` saying what is wrong."""
    if not SPEC.match(spec):
        raise EntryPointError(f"{spec!r} is not of the form 'package.module:attribute'")
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryPointError(
            f"cannot import {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EntryPointError(f"{module_name!r} has no attribute {attribute!r}") from None
    return target
