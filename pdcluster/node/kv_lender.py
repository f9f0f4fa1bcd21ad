"""Lending prefix KV: a node (either role) answers FetchKV by copying the pool blocks published under the asked
hashes into the asking node's reserved blocks over the kv_transfer channels (shm on one host, tcp or a collective
across hosts), then KVFetched with how many leading blocks it wrote and the receiver's checksum. A lender and an
asking node of different tensor_parallel_size work too: the channel regroups the heads (kv_transfer/regroup.py).
A pool sliced per tensor-parallel rank (a device, or `kv_pool_per_rank`) lends through the node's `RankedSender`:
every rank writes its own slice over its own channel into the asking node's reservation (kv_transfer/per_rank/;
rank r into rank r between nodes sliced alike), and one pool lends into a sliced one the same way (a one-rank
`RankedSender` around the node's `KVSender` writes every slice).

The blocks are pinned on the engine thread (`LLMEngine.pin_cached`: the allocator cannot hand them out, so nothing
overwrites them mid-copy) and unpinned once the receiver acknowledged or the copy failed. Rank 0's pin holds every
rank's slice: block ids are the same in every slice, and only rank 0's scheduler has any rank write a block. Only
the pool serves a fetch: blocks this node keeps in its host or disk tier are not lent (the router asks for pool
blocks). At most MAX_LENDING copies run at once; more are answered with 0 blocks at once (the asking node
computes instead).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from pdcluster.control.protocol import FetchKV, KVFetched
from pdcluster.control.threads import started_pool
from pdcluster.kv_transfer import Destination, KVSender
from pdcluster.kv_transfer.per_rank import RankedSender, RankLinks

if TYPE_CHECKING:
    from pdcluster.engine.engine_thread import EngineThread

log = logging.getLogger(__name__)

MAX_LENDING = 8   # copies to other nodes at once (a draining node moves 4 requests at a time: pre-copies + tails)
MAX_LEND_S = 30.0  # the longest a copy may hold its pins, whatever the asking node's timeout_s


class KVLender:
    def __init__(self, engine_thread: EngineThread, sender: Callable[[], KVSender | RankedSender],
                 reply: Callable[[bytes, KVFetched], object]) -> None:
        self.engine_thread = engine_thread
        self.sender = sender            # the node's KVSender (made on first use on a decode node)
        self.reply = reply
        self.lending: set[str] = set()  # FetchKV ids being served
        self.num_refused = 0            # asked while MAX_LENDING copies ran
        self._pool = started_pool(MAX_LENDING, "kv-lend")
        self._tasks: set[asyncio.Task] = set()
        self._one_rank: RankedSender | None = None   # around a one-pool node's KVSender (`_ranked`)
        self._lent = False   # whether a copy asked for the node's sender (made on first use)

    def handle(self, identity: bytes, msg: FetchKV) -> None:
        """On the event loop: start serving `msg` (or answer it at once)."""
        if msg.rid in self.lending:
            return   # a duplicate: the first one answers
        if len(self.lending) >= MAX_LENDING:
            self.num_refused += 1
            self.reply(identity, KVFetched(rid=msg.rid, error=f"{MAX_LENDING} copies to other nodes under way"))
            return
        try:
            dst = Destination.from_dict(msg.dst)
        except (ValueError, TypeError, KeyError) as exc:
            self.reply(identity, KVFetched(rid=msg.rid, error=f"bad FetchKV destination: {exc}"))
            return
        hashes = list(msg.block_hashes[:len(dst.block_ids)])
        self.lending.add(msg.rid)
        timeout = min(max(msg.timeout_s, 0.1), MAX_LEND_S)
        task = asyncio.create_task(self._lend(identity, msg.rid, dst, hashes, timeout), name=f"kv-lend:{msg.rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lend(self, identity: bytes, rid: str, dst: Destination, hashes: list[int], timeout: float) -> None:
        blocks: list[int] = []
        answer = KVFetched(rid=rid)
        try:
            # not under a timeout: the engine thread answers within a step, and a pin it made must be undone
            blocks = await self.engine_thread.call(lambda e: e.pin_cached(hashes))
            if blocks:
                part = replace(dst, block_ids=dst.block_ids[:len(blocks)])
                self._lent = True
                loop = asyncio.get_running_loop()
                checksum, backend = await loop.run_in_executor(self._pool, self._send, self._ranked(), part,
                                                               blocks, timeout)
                answer = KVFetched(rid=rid, num_blocks=len(blocks), checksum=checksum, kv_backend=backend)
        except Exception as exc:   # TimeoutError, TransferError (the asking node cancelled, died, refused)
            answer = KVFetched(rid=rid, error=f"{type(exc).__name__}: {exc}")
            log.info("lending KV for %s failed: %s", rid, answer.error)
        finally:
            if blocks:
                self.engine_thread.post(lambda e: e.unpin(blocks))
            self.lending.discard(rid)
        self.reply(identity, answer)

    def keep_peers(self, addresses: list[str]) -> None:
        """Forget the connections to asking nodes whose receiver (its rank 0 KV address) is not in `addresses`: a
        node that left, or restarted on a new address (on every rank; off the loop, since closing a collective's
        group may block). Nothing when this node has not lent yet."""
        if self._lent:
            self._pool.submit(self._ranked().keep_peers, addresses)

    def _ranked(self) -> RankedSender:
        """The node's sender; a one-pool node's KVSender as a one-rank RankedSender, which also writes into a pool
        sliced per rank (a destination with `ranks`) and is that KVSender's own transfer otherwise."""
        sender = self.sender()
        if isinstance(sender, RankedSender):
            return sender
        if self._one_rank is None or self._one_rank.local is not sender:
            self._one_rank = RankedSender(sender, RankLinks([]), _no_ranks)
        return self._one_rank

    @staticmethod
    def _send(sender: RankedSender, dst: Destination, blocks: list[int], timeout: float) -> tuple[int, str]:
        # connects (off the loop, in this pool's thread); every other rank is told over its link and sends at once
        transfer = sender.start(dst, blocks, connect=True)
        transfer.send_all()
        return transfer.finish(timeout), transfer.backend

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _no_ranks(rank: int, message: dict) -> None:
    raise AssertionError("a one-rank sender has no other rank to tell")   # only starts on the engine thread do
