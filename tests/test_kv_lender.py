"""The lender's front door (pdcluster/node/kv_lender.py) against hostile or broken FetchKV: a destination that is
not one, more asks than it serves at once, a duplicate id: each answered (or dropped) at once, nothing pinned."""

from __future__ import annotations

import asyncio

from pdcluster.control.protocol import FetchKV, KVFetched
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
