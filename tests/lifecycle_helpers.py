"""One check for every typed lifecycle's table (pdcluster/control/lifecycle.py)."""

from __future__ import annotations

import enum
from typing import Any, Callable

import pytest

from pdcluster.control.lifecycle import TransitionError


def assert_move(record: Any, move: Callable[[Any], None], src: enum.Enum, dst: enum.Enum, allowed: bool,
                attr: str = "state") -> None:
    """`record` in `src` (its `attr`) asked to `move(dst)`: in `dst` when `allowed`; otherwise refused with
    a TransitionError naming both states, and still in `src`."""
    setattr(record, attr, src)
    if allowed:
        move(dst)
        assert getattr(record, attr) is dst
    else:
        with pytest.raises(TransitionError, match=f"{src.value} -> {dst.value} is not a transition"):
            move(dst)
        assert getattr(record, attr) is src   # a refused move changes nothing
