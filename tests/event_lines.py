"""Events-file lines for the reader tests: a test names the fields it is about, the rest of the schema is filled in.

Each required field of the event kind's record (``deadpool.events.schema``) that a test leaves out gets a
neutral value of its type, so a line stays valid under the schema while the test reads as the facts it checks.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

import msgspec

from deadpool.events import schema

_KINDS: dict[str, type[schema.Record]] = {
    str(c.__struct_config__.tag): c for c in typing.get_args(schema.EventRecord)
}


def _neutral(kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return None if type(None) in typing.get_args(kind) else _neutral(typing.get_args(kind)[0])
    if origin is list or kind is list:
        return []
    if origin is dict or kind is dict:
        return {}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(iter(kind)).value
    return {str: "", int: 0, float: 0.0, bool: False}.get(kind)


def line(event: str, **fields: Any) -> dict[str, Any]:
    """One line of `event`: `fields`, and a neutral value for each other required field of its kind."""
    kind = _KINDS.get(event)
    if kind is None:
        return {"event": event, **fields}
    hints = typing.get_type_hints(kind)
    filled = {f.name: _neutral(hints[f.name]) for f in msgspec.structs.fields(kind)
              if f.required and f.name not in fields}
    return {"event": event, **filled, **fields}


def typed(record: dict[str, Any]) -> schema.Line:
    """A line given as a dict (its ``event`` and the fields a test is about), validated as a reader reads it."""
    fields = dict(record)
    return schema.validate(line(fields.pop("event"), **fields))
