"""Fetching a prompt's prefix KV from the node that holds it (the router named it: `Generate.kv_source`).

The engine picks the blocks to fill when the request is admitted (`KVConnector.on_fetch`, engine thread); here, on
the event loop: a reservation of those blocks in this node's KV receiver (under `<rid>#fetch`, its own deadline),
FetchKV to the holder, which writes the blocks it has into the first reserved ones (pinned there meanwhile:
pdcluster/node/kv_lender.py; a pool sliced per tensor-parallel rank on either side moves rank by rank, the
reservation expecting as many writers per slice as the holder's `Capacity.kv_rank_slices` call for) and answers
KVFetched with their count and the checksum its writes were acknowledged with. The engine then hears
`kv_fetch_done(rid, blocks, n)`: the n blocks join the prefix cache and the rest of the prompt is computed
(here, or on a prefill node after the reservation that follows).

Whatever goes wrong (no answer within `timeout`, the holder errs, lacks the blocks, leaves the cluster, or the
landed checksum differs, or the request is aborted) ends the fetch with 0 blocks, and only once no write can land
any more (the reservation cancelled and settled): the prompt is recomputed, never read from half-written blocks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from pdcluster.control.cluster_view import ClusterView
from pdcluster.control.metrics import get_or_create
from pdcluster.control.protocol import FetchKV, KVFetched
from pdcluster.control.transport import PeerDealers
from pdcluster.engine.engine_thread import EngineThread
from pdcluster.kv_transfer import KVReceiver
from pdcluster.kv_transfer.per_rank import RankedReceiver

log = logging.getLogger(__name__)

SUFFIX = "#fetch"   # a fetch's reservation id: the request's own may follow it for a remote prefill


@dataclass
class Fetch:
    rid: str
    source: str
    blocks: list[int]
    timer: asyncio.TimerHandle | None = None
    settling: bool = False   # failed or answered: its end is under way

    @property
    def key(self) -> str:
        return self.rid + SUFFIX


class PrefixFetches:
    def __init__(self, node_id: str, receiver: KVReceiver | RankedReceiver, peers: PeerDealers, view: ClusterView,
                 engine_thread: EngineThread, timeout: float, release_timeout: float,
                 registry: CollectorRegistry, spawn: Callable[..., None]) -> None:
        self.node_id = node_id
        self.receiver = receiver
        self.peers = peers
        self.view = view
        self.engine_thread = engine_thread
        self.timeout = timeout
        self.release_timeout = release_timeout
        self.spawn = spawn
        self.fetches: dict[str, Fetch] = {}   # by request id
        self.on_end: Callable[[str, int, str], None] | None = None   # (rid, blocks landed, why not all) at each end
        self.outcomes = get_or_create(registry, Counter, "pdcluster_node_kv_fetches_total",
                                      "prefix fetches from other nodes by outcome (ok: every block asked for, "
                                      "partial, failed: none)", ("outcome",))

    def start(self, rid: str, blocks: list[int], hashes: list[int], source: str) -> None:
        if rid in self.fetches:   # one fetch per request (the engine asks once): a second one ends empty at once
            self.engine_thread.post(lambda e: e.kv_fetch_done(rid, blocks, 0))
            return
        f = self.fetches[rid] = Fetch(rid, source, blocks)
        peer = self.view.nodes.get(source)
        if peer is None or source == self.node_id:
            self._end(f, 0, f"holder {source!r} is not in the cluster")
            return
        try:
            dst = self.receiver.reserve(f.key, blocks, timeout_s=self.timeout,
                                        sender_slices=peer.capacity.kv_rank_slices)
        except Exception as exc:
            self._end(f, 0, f"the receiver refused the reservation: {exc}")
            return
        msg = FetchKV(rid=f.key, block_hashes=hashes, dst=dst.to_dict(), timeout_s=self.timeout)
        if not self.peers.send(source, peer.control_addr, msg):
            self.fail(rid, f"could not queue FetchKV to {source}")
            return
        f.timer = asyncio.get_running_loop().call_later(self.timeout, self.fail, rid,
                                                         f"no answer from {source} in {self.timeout} s")
        log.info("request %s: fetching %d prefix blocks from %s", rid, len(blocks), source,
                 extra={"request_id": rid})

    def answered(self, node_id: str, msg: KVFetched) -> None:
        rid = msg.rid.removesuffix(SUFFIX)
        f = self.fetches.get(rid)
        if f is None or f.settling or f.source != node_id or msg.rid != f.key:
            return   # late, or not ours
        if msg.error or not 0 < msg.num_blocks <= len(f.blocks):
            self.fail(rid, msg.error or f"{node_id} holds none of the blocks")
            return
        f.settling = True
        self.spawn(self._land(f, msg), f"kv-fetch:{rid}")

    async def _land(self, f: Fetch, msg: KVFetched) -> None:
        try:
            result = await self.receiver.wait(f.key, timeout=self.timeout)
            if result.checksum != msg.checksum:
                raise ValueError(f"checksum: sender {msg.checksum:#x} != landed {result.checksum:#x}")
        except Exception as exc:   # TimeoutError, TransferError, the checksum
            f.settling = False
            self.fail(f.rid, str(exc))
            return
        self._end(f, msg.num_blocks)

    def fail(self, rid: str, reason: str) -> None:
        """End the fetch of `rid` with nothing, once no write can land (also: the request was aborted)."""
        f = self.fetches.get(rid)
        if f is None or f.settling:
            return
        f.settling = True
        self.spawn(self._settle(f, reason), f"kv-fetch-release:{rid}")

    async def _settle(self, f: Fetch, reason: str) -> None:
        if not await self.receiver.settle(f.key, self.release_timeout):
            log.error("request %s: receiver kept the fetch's reservation past %s s; its blocks are recomputed "
                      "anyway", f.rid, self.release_timeout)
        self._end(f, 0, reason)

    def holder_left(self, node_id: str) -> None:
        for f in [f for f in self.fetches.values() if f.source == node_id]:
            self.fail(f.rid, f"holder {node_id} left the cluster")

    def _end(self, f: Fetch, done: int, reason: str = "") -> None:
        if self.fetches.get(f.rid) is not f:
            return
        del self.fetches[f.rid]
        if f.timer is not None:
            f.timer.cancel()
        outcome = "ok" if done == len(f.blocks) else "partial" if done else "failed"
        self.outcomes.labels(outcome).inc()
        if done:
            log.info("request %s: %d of %d prefix blocks fetched from %s", f.rid, done, len(f.blocks), f.source,
                     extra={"request_id": f.rid})
        else:
            log.warning("request %s: prefix fetch from %s failed (%s); computing it", f.rid, f.source, reason,
                        extra={"request_id": f.rid})
        rid, blocks = f.rid, f.blocks
        self.engine_thread.post(lambda e: e.kv_fetch_done(rid, blocks, done))
        if self.on_end is not None:
            self.on_end(rid, done, reason)
