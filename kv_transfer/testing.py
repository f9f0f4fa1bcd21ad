"""Fault injection for tests: channels that damage bytes after the sender took their checksum.

    with corrupt_writes("tcp"):          # senders connecting meanwhile get corrupting channels
        sender = KVSender(pool, backend="tcp")
        ...

Production code knows nothing of this: `corrupt_writes` swaps registry entries (backends.CHANNELS) for
subclasses whose `connect` wraps the real channel in a `CorruptingChannel`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from pdcluster.kv_transfer.backends import CHANNELS
from pdcluster.kv_transfer.channel import Channel, DstRuns, Runs, Staged
from pdcluster.kv_transfer.regroup import Regroup


class CorruptingChannel(Channel):
    """Wraps a sender's channel; one bit of every write changes on the way: in the first payload view
    (tcp, int8), in a clone of the first tensor (collectives), or in the landed sum the copy read back
    (shm, where the bytes never travel past the sender)."""

    def __init__(self, inner: Channel):
        super().__init__(inner.wire, inner.pool)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # the wrapper speaks as the channel it wraps

    @property  # the wrapped channel's, set through the wrapper by the sender
    def regroup(self) -> Regroup | None:
        return self.inner.regroup

    @regroup.setter
    def regroup(self, value: Regroup | None) -> None:
        self.inner.regroup = value

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        staged = self.inner.stage(token, part, l0, l1)
        if staged.views:
            data = bytearray(staged.views[0])
            data[0] ^= 1
            staged.views[0] = memoryview(data)
        elif staged.tensors:
            x = staged.tensors[0].clone()
            x.view(-1).view(torch.uint8)[0] ^= 1
            staged.tensors[0] = x
        else:
            assert staged.landed is not None, "a channel stages views, tensors or a landed checksum"
            staged.landed ^= 1
        return staged

    def ship(self, body: dict[str, Any], staged: Staged) -> None:
        self.inner.ship(body, staged)

    def wire_bytes(self, nblocks: int, l0: int, l1: int) -> int:
        return self.inner.wire_bytes(nblocks, l0, l1)

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        return self.inner.receive_runs(runs, l0, l1, frame)

    def discard(self, nbytes: int) -> None:
        self.inner.discard(nbytes)

    def close(self) -> None:
        self.inner.close()


@contextmanager
def corrupt_writes(*names: str) -> Iterator[None]:
    """Senders that connect over channels `names` inside the block corrupt every write."""
    saved = {name: CHANNELS[name] for name in names}
    try:
        for name, cls in saved.items():
            CHANNELS[name] = _corrupting(cls)
        yield
    finally:
        CHANNELS.update(saved)


def _corrupting(cls: type[Channel]) -> type[Channel]:
    def connect(_: type, *args: Any, **kwargs: Any) -> Channel:
        return CorruptingChannel(cls.connect(*args, **kwargs))

    return type(f"Corrupting{cls.__name__}", (cls,), {"connect": classmethod(connect)})
