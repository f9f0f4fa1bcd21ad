"""Rank 0's receiver for a KV pool sliced per tensor-parallel rank: one reservation per rank, one result.

`RankedReceiver` answers like a `KVReceiver` (reserve, wait, settle, cancel): `reserve` reserves the blocks in
rank 0's slice here and in every other rank's slice through its endpoint (endpoint.py, asked over the link), each
for as many writers as the sending engine has ranks holding that slice's heads (one, or several when it is sliced
over more ranks: KVReceiver.reserve's `sender_slices`), and
the `Destination` it returns carries the other ranks' destinations (`ranks`), so that each rank of the sending
engine writes its slice into the same rank's. The reservation's result (`wait`) is complete only when every rank's
part landed with its checksum good (the checksum then combines the ranks', checksum.combine_ranks, as the sender's
does); the first part that fails cancels the others, and once every part resolved (no write can land any more) the
result fails with the code of the part that failed of its own accord (a checksum, a lost rank), not of those
aborted or cancelled because of it. A rank whose endpoint is gone fails its parts at once (code "lost").
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from pdcluster.kv_transfer.checksum import combine_ranks
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import TransferError, root_cause
from pdcluster.kv_transfer.per_rank.link import RankLinks
from pdcluster.kv_transfer.receiver import RESULT_TTL_S, KVReceiver, result_future
from pdcluster.kv_transfer.reservations import TransferResult


@dataclass
class _Parts:
    """One request's reservation in every rank's slice, and what became of each part."""

    request_id: str
    results: list[TransferResult | None]
    waiters: list[Callable[[TransferResult], None]] = field(default_factory=list)
    failures: list[TransferResult] = field(default_factory=list)   # as they came, each naming its rank
    orphan: bool = False   # its reserve failed: nobody waits; it leaves once every part resolved
    resolved_at: float = 0.0   # monotonic time every part had resolved

    @property
    def resolved(self) -> bool:
        return all(r is not None for r in self.results)

    def result(self) -> TransferResult:
        """Every part's combined, or the failure behind the others: the first part that failed for a reason of its
        own, not because another part's failure had it aborted or cancelled."""
        if self.failures:
            return root_cause(self.failures)
        done = [r for r in self.results if r is not None]
        return TransferResult(self.request_id, True, checksum=combine_ranks([r.checksum for r in done]),
                              nbytes=sum(r.nbytes for r in done))


class RankedReceiver:
    def __init__(self, local: KVReceiver, links: RankLinks, rank_addresses: list[str]) -> None:
        """`local`: rank 0's receiver on its slice; `links`: to ranks 1.. (whose receivers listen at
        `rank_addresses`)."""
        self.local, self.links = local, links
        self.size = links.size
        self.address, self.backends, self.layout = local.address, local.backends, local.layout
        self.dropped = local.dropped
        self.rank_addresses = rank_addresses
        self._lock = threading.Lock()
        self._parts: dict[str, _Parts] = {}
        self._remote_bytes = 0
        links.on("landed", self._landed)
        links.on_lost(self._rank_lost)

    # ---- owner API (as KVReceiver's) ---------------------------------------------------------------

    def reserve(self, request_id: str, block_ids: list[int], timeout_s: float = 30.0,
                sender_slices: int = 1) -> Destination:
        """The blocks in every rank's slice, each for the sending ranks that fill its heads (`sender_slices`: as
        KVReceiver.reserve); TransferError (and nothing held) when a rank cannot reserve them."""
        dst = self.local.reserve(request_id, block_ids, timeout_s, sender_slices)
        parts = _Parts(request_id, [None] * self.size)
        with self._lock:
            self._drop_stale_locked(time.monotonic())
            self._parts[request_id] = parts
        self.local.on_result(request_id, lambda r: self._resolve(parts, 0, r))
        for link in self.links.links:
            try:
                reply = link.request("reserve", rid=request_id, blocks=list(block_ids), timeout_s=timeout_s,
                                     sender_slices=sender_slices)
                dst.ranks.append(Destination.from_dict(reply))
            except (TransferError, ValueError) as exc:
                parts.orphan = True
                for rank in range(link.rank, self.size):   # never reserved there: nothing to wait for
                    self._resolve(parts, rank, TransferResult(request_id, False, str(exc), code="refused"))
                self.cancel(request_id)
                raise TransferError(f"kv reservation {request_id!r}: tensor-parallel rank {link.rank}: {exc}",
                                    getattr(exc, "code", "refused")) from None
        return dst

    def extend(self, request_id: str, timeout_s: float) -> bool:
        """As KVReceiver.extend, in every rank's slice (rank 0's answer)."""
        for link in self.links.links:
            link.post("extend", rid=request_id, timeout_s=timeout_s)
        return self.local.extend(request_id, timeout_s)

    def cancel(self, request_id: str) -> None:
        """Stop accepting writes in every rank's slice; `wait` answers once no write can land any more."""
        self.local.cancel(request_id)
        for link in self.links.links:
            link.post("cancel", rid=request_id)

    async def wait(self, request_id: str, timeout: float) -> TransferResult:
        """As KVReceiver.wait: the combined result once every rank's part resolved; raises the failed part's
        TransferError (code "missing": no such reservation, or its result was taken) or TimeoutError."""
        fut, deliver = result_future()
        with self._lock:
            parts = self._parts.get(request_id)
            if parts is None:
                ready: TransferResult | None = TransferResult(request_id, False, "no such reservation", code="missing")
            elif parts.resolved:
                del self._parts[request_id]
                ready = parts.result()
            else:
                parts.waiters.append(deliver)
                ready = None
        if ready is not None:
            return ready.raise_if_failed()
        try:
            result = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            with self._lock:
                if parts is not None and deliver in parts.waiters:
                    parts.waiters.remove(deliver)
            raise TimeoutError(f"kv transfer {request_id!r}: no result within {timeout} s") from None
        return result.raise_if_failed()

    async def settle(self, request_id: str, timeout: float) -> bool:
        """As KVReceiver.settle: cancel, and wait until no write into any rank's blocks can land."""
        self.cancel(request_id)
        try:
            await self.wait(request_id, timeout=timeout)
        except TimeoutError:
            return False
        except Exception:
            pass
        return True

    @property
    def num_active_reservations(self) -> int:
        """Reservations still held, over every rank (the other ranks asked: for checks, not the hot path)."""
        total = self.local.num_active_reservations
        for link in self.links.links:
            try:
                total += int(link.request("active"))
            except TransferError:   # a rank that is gone holds nothing
                pass
        return total

    @property
    def bytes_received(self) -> int:
        with self._lock:
            return self.local.bytes_received + self._remote_bytes

    def close(self) -> None:
        """Rank 0's receiver closes (the other ranks' close with their endpoints)."""
        self.local.close()

    # ---- the parts' results (receiver and link threads) ---------------------------------------------

    def _landed(self, rank: int, frame: dict[str, Any]) -> None:
        rid = frame.get("request_id")
        if not isinstance(rid, str):
            return
        with self._lock:
            parts = self._parts.get(rid)
        if parts is not None:
            self._resolve(parts, rank, TransferResult(rid, bool(frame.get("ok")), frame.get("error"),
                                                      int(frame.get("checksum") or 0), int(frame.get("nbytes") or 0),
                                                      frame.get("code")))

    def _rank_lost(self, rank: int, why: str) -> None:
        with self._lock:
            pending = [p for p in self._parts.values() if p.results[rank] is None]
        for parts in pending:
            self._resolve(parts, rank, TransferResult(parts.request_id, False, f"its KV endpoint is gone: {why}",
                                                      code="lost"))

    def _resolve(self, parts: _Parts, rank: int, result: TransferResult) -> None:
        with self._lock:
            if parts.results[rank] is not None:
                return
            parts.results[rank] = result
            first_failure = not result.ok and not parts.failures
            if not result.ok:
                parts.failures.append(replace(result, error=f"tensor-parallel rank {rank}: {result.error}"))
            if rank and result.ok:
                self._remote_bytes += result.nbytes
            waiters: list[Callable[[TransferResult], None]] = []
            if parts.resolved:
                parts.resolved_at = time.monotonic()
                if (parts.waiters or parts.orphan) and self._parts.get(parts.request_id) is parts:
                    del self._parts[parts.request_id]
                waiters, parts.waiters = parts.waiters, []
        if first_failure and not parts.orphan:
            self.cancel(parts.request_id)   # the other parts resolve (as cancelled) once no write can land
        for fn in waiters:
            fn(parts.result())

    def _drop_stale_locked(self, now: float) -> None:
        """Results nobody came for (their owner stopped waiting) leave after RESULT_TTL_S, as KVReceiver's."""
        for rid in [rid for rid, p in self._parts.items() if p.resolved and now - p.resolved_at > RESULT_TTL_S]:
            del self._parts[rid]
