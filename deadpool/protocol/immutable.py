"""The decorator every wire message class (and a few records made as often) is built with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

_M = TypeVar("_M")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def immutable(cls: type[_M]) -> type[_M]:
    """A message class (or another made as often): a slotted dataclass that the type checker holds immutable.

    Not frozen at run time: a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, six times the cost of a plain assignment (1.4 against 0.2 us for
    eight fields), and a coordinator builds one per message it decodes, about a million in
    the 131,072-member simulation. Nothing hashes a message or changes one once built.
    """
    made: type[_M] = dataclass(slots=True)(cls)
    return made
