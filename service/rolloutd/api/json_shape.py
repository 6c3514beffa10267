"""The one JSON shape of the admin app and the CLI (``/v1/status``, ``/v1/checkpoints``,
``rolloutd checkpoints list --json``), for a proto message.

Protobuf's canonical JSON (what grpcurl prints) writes enum names with their prefix
(``SERVING_STATE_SERVING``), 64-bit integers as strings, and drops fields at their zero value.
Here instead: enum values lower-case without the prefix (``serving``), every number a JSON
number, every field present (a proto3 ``optional`` field that is unset is ``null``), and
``google.protobuf.Struct`` as the plain object it holds.
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.message import Message

_STRUCT = "google.protobuf.Struct"


def to_json(message: Message) -> dict[str, Any]:
    """``message`` as plain JSON data, field names as in the ``.proto``."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        elif field.has_presence and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: Any, value: Any) -> Any:
    """``field``: a ``FieldDescriptor`` (the upb or the pure-Python one)."""
    if field.message_type is not None:
        if field.message_type.full_name == _STRUCT:
            return json_format.MessageToDict(value)
        return to_json(value)
    if field.enum_type is not None:
        return enum_value(field.enum_type, value)
    return value


def enum_value(enum: EnumDescriptor, number: int) -> str:
    """``SERVING_STATE_SERVING`` of enum ``ServingState`` -> ``serving``."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    return enum.values_by_number[number].name.removeprefix(prefix).lower()
