"""The lender's front door (pdcluster/node/kv_lender.py) against hostile or broken FetchKV: a destination that is
not one, more asks than it serves at once, a duplicate id: each answered (or dropped) at once, nothing pinned. And
what it keeps per asking node goes with the node."""

from __future__ import annotations

import asyncio
import time

import torch

from pdcluster.control.protocol import FetchKV, KVFetched
from pdcluster.kv_transfer import KVReceiver, KVSender
from pdcluster.node.kv_lender import MAX_LENDING, KVLender


class NoEngine:
    """An engine thread that must never be asked to pin anything."""

    def call(self, fn):
        raise AssertionError("the engine was asked to pin blocks for a refused FetchKV")


async def test_bad_destinations_and_too_many_asks_are_answered_without_pinning():
    replies: list[tuple[bytes, KVFetched]] = []
    lender = KVLender(NoEngine(), lambda: None, lambda who, msg: replies.append((who, msg)))  # type: ignore[arg-type]
    try:
        for i, dst in enumerate([{}, {"address": 7}, {"block_ids": "x"}]):
            lender.handle(b"peer", FetchKV(rid=f"bad{i}", block_hashes=[1, 2], dst=dst, timeout_s=1.0))
        assert [m.rid for _, m in replies] == ["bad0", "bad1", "bad2"]
        assert all(m.num_blocks == 0 and m.error and "destination" in m.error for _, m in replies)
        assert not lender.lending
        replies.clear()
        lender.lending.update(f"busy{i}" for i in range(MAX_LENDING))   # as many copies as it runs at once
        lender.handle(b"peer", FetchKV(rid="one-more", block_hashes=[1], dst={}, timeout_s=1.0))
        lender.handle(b"peer", FetchKV(rid="busy0", block_hashes=[1], dst={}, timeout_s=1.0))   # a duplicate: dropped
        assert [(m.rid, m.num_blocks) for _, m in replies] == [("one-more", 0)] and lender.num_refused == 1
    finally:
        lender.lending.clear()
        await asyncio.wait_for(lender.close(), 5)


async def test_the_lender_forgets_the_connections_of_askers_that_left_the_view():
    """A node runs for weeks while decode nodes come and go (restarts bring new addresses): the connections its
    lending sender opened to an asking node that left are closed once the view drops it."""
    shape = (2, 2, 8, 4, 1, 8)
    sender = KVSender(torch.randn(shape), backend="tcp")
    askers = [KVReceiver(torch.zeros(shape)) for _ in range(2)]
    replies: list[KVFetched] = []
    lender = KVLender(PinAll(), lambda: sender, lambda who, msg: replies.append(msg))  # type: ignore[arg-type]
    try:
        lender.keep_peers([])   # nothing lent yet: the sender is not even asked for
        for i, rx in enumerate(askers):
            dst = rx.reserve(f"r{i}", [1, 2])
            lender.handle(b"asker", FetchKV(rid=f"r{i}", block_hashes=[11, 12], dst=dst.to_dict(), timeout_s=5.0))
        while len(replies) < 2:
            await asyncio.sleep(0.01)
        assert all(m.num_blocks == 2 and not m.error for m in replies), replies
        assert {a for a, _ in sender._peers} == {rx.address for rx in askers}
        lender.keep_peers([askers[1].address])   # askers[0]'s node left the view
        end = time.monotonic() + 5
        while {a for a, _ in sender._peers} != {askers[1].address}:
            assert time.monotonic() < end, sender._peers
            await asyncio.sleep(0.01)
    finally:
        await asyncio.wait_for(lender.close(), 5)
        sender.close()
        for rx in askers:
            rx.close()


class PinAll:
    """An engine thread whose pool holds every asked hash in blocks 3, 4, ..."""

    def call(self, fn):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn(self))
        return fut

    def post(self, fn) -> None:
        fn(self)

    def pin_cached(self, hashes: list[int]) -> list[int]:
        return [3 + i for i in range(len(hashes))]

    def unpin(self, blocks: list[int]) -> None:
        pass
