"""The one rule of every typed lifecycle (a request on each node, a sequence in the engine, a KV transfer, a
reservation): an `enum` of states, a table of the states each may move to, and `check_move` refusing any
other move. A refused move is a bug in the caller, never a runtime condition to handle."""

from __future__ import annotations

import enum
from typing import Mapping, TypeVar

S = TypeVar("S", bound=enum.Enum)


class TransitionError(RuntimeError):
    """A move the lifecycle's table does not allow."""


def check_move(table: Mapping[S, set[S]], current: S, new: S, what: str) -> S:
    """`new` when the table allows `current` -> `new`; raises TransitionError naming `what` otherwise."""
    if new not in table[current]:
        raise TransitionError(f"{what}: {current.value} -> {new.value} is not a transition")
    return new
