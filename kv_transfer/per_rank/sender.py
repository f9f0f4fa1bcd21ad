"""Rank 0's sender for a KV pool sliced per tensor-parallel rank: each rank sends its slice, one transfer results.

`RankedSender` answers like a `KVSender` (connect, start, and the transfer's send_layers / send_all / finish /
abort): rank 0's slice goes from here (a `KVSender` on it), every other rank's from its own endpoint
(endpoint.py) into the same rank's destination (`Destination.ranks`, from the receiving engine's
`RankedReceiver`); both engines must have the same number of ranks, both sliced (otherwise: LayoutMismatchError).

Rank 0 drives the push. Started on the engine thread (`connect=False`, a prefill node's prompt), the other ranks
hear of the transfer in order with the engine's steps (`ordered`: LLMEngine.tell_rank_agent), before the step
whose layers it sends: each rank then sends each layer as its own step computes it, as rank 0 does with
`send_layers`; `send_all` (after the step that computed the KV) has every rank send every layer at once. Started
from any other thread (`connect=True`: blocks computed long ago), each rank sends them at once, told over its link.
Each rank finishes its part itself and reports its ack (or failure); `finish` returns the ranks' acknowledged
checksums combined (checksum.combine_ranks, as the receiver combines what landed), or stops every part once one
failed and raises the failure behind the others (errors.root_cause: a checksum, a lost rank, not the parts
aborted or cancelled because of it). A rank whose endpoint is gone fails its parts at once (code "lost").
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Iterable

from pdcluster.kv_transfer.checksum import combine_ranks
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import LayoutMismatchError, TransferError, from_code, root_cause
from pdcluster.kv_transfer.per_rank.link import REQUEST_TIMEOUT_S, RankLinks
from pdcluster.kv_transfer.sender import KVSender, Transfer, TransferState

Ordered = Callable[[int, dict[str, Any]], None]   # (rank, message): in order with the engine's steps
STOPPED_REPORT_WAIT_S = 1.0   # after a part failed, how long finish waits for the others' reports (which may say why)


class RankedTransfer:
    """One request's KV going from every rank of this engine to the same rank of the receiving one."""

    def __init__(self, sender: "RankedSender", tid: int, local: Transfer, by_step: bool) -> None:
        self.request_id, self.dst, self.tid = local.request_id, local.dst, tid
        self._sender, self._local, self._by_step = sender, local, by_step
        self._cond = threading.Condition()
        self._reported: set[int] = set()   # the other ranks that reported their part
        self._acked: dict[int, int] = {}   # rank -> checksum its receiver acknowledged
        self._failures: list[TransferError] = []   # as they came
        self._checksum: int | None = None

    @property
    def backend(self) -> str:
        """Rank 0's channel (the other ranks' may differ: shm reaches only a pool in shared memory)."""
        return self._local.backend

    @property
    def failed(self) -> bool:
        return bool(self._failures) or self._local.failed

    @property
    def error(self) -> TransferError | None:
        """Why it failed: the part that failed of its own accord, not those stopped because of it."""
        with self._cond:
            failures = list(self._failures)
        if self._local.error is not None and self._local.error not in failures:
            failures.append(self._local.error)
        return root_cause(failures) if failures else None

    @property
    def state(self) -> TransferState:
        if self.failed:
            return TransferState.FAILED
        if self._checksum is None and self._local.state is TransferState.COMPLETE:
            return TransferState.AWAITING_ACK   # rank 0's part is done, not every other rank's yet
        return self._local.state

    @property
    def checksum(self) -> int | None:
        return self._checksum

    def send_layers(self, l0: int, l1: int) -> None:
        """Rank 0's layers [l0, l1); the other ranks send theirs as their own step computes them."""
        self._local.send_layers(l0, l1)

    def send_all(self) -> None:
        self._local.send_all()
        if self._by_step:
            for rank in range(1, self._sender.size):
                self._sender.ordered(rank, {"op": "send_all", "tid": self.tid})

    def finish(self, timeout: float = 10.0) -> int:
        """Until every rank's receiver acknowledged its part; the combined checksum. Raises `error`."""
        deadline = time.monotonic() + timeout
        first = 0
        try:
            first = self._local.finish(timeout)
        except TransferError as exc:
            self._fail(exc)
        if self._failures:   # stop the others; their reports (which may name the cause) come at once
            self._stop_parts(str(self._failures[0]))
            deadline = min(deadline, time.monotonic() + STOPPED_REPORT_WAIT_S)
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._reported) == self._sender.size - 1,
                                       max(0.0, deadline - time.monotonic())) and not self._failures:
                self._failures.append(TransferError(
                    f"kv transfer {self.request_id!r}: not every tensor-parallel rank's part was acknowledged within "
                    f"{timeout} s", "timeout"))
        error = self.error
        if error is not None:
            self.abort(str(error))
            raise error
        self._checksum = combine_ranks([first, *(self._acked[r] for r in range(1, self._sender.size))])
        self._sender.forget(self)
        return self._checksum

    def abort(self, reason: str = "") -> None:
        """Every rank drops its part (their receivers give the blocks back); no-op once acknowledged."""
        self._local.abort(reason)
        self._fail(TransferError(f"kv transfer {self.request_id!r} aborted: {reason}", "aborted"))
        self._stop_parts(reason)
        self._sender.forget(self)

    def part_done(self, rank: int, frame: dict[str, Any]) -> None:
        """Rank `rank`'s report (a link thread): its ack, or its failure, which fails the whole transfer."""
        with self._cond:
            if rank in self._reported:   # e.g. its link broke after its ack: that part is done
                return
            self._reported.add(rank)
            if frame.get("ok"):
                self._acked[rank] = int(frame.get("checksum") or 0)
            self._cond.notify_all()
        if frame.get("ok"):
            self._sender.remote_bytes(int(frame.get("nbytes") or 0))
            return
        why = f"kv transfer {self.request_id!r}, tensor-parallel rank {rank}: {frame.get('error')}"
        self._fail(from_code(frame.get("code"), why))
        self._local.abort(why)

    def _stop_parts(self, reason: str) -> None:
        if self._checksum is None:
            for link in self._sender.links.links:
                if link.rank not in self._reported:
                    link.post("abort", tid=self.tid, reason=reason)

    def _fail(self, exc: TransferError) -> None:
        with self._cond:
            if self._checksum is None:
                self._failures.append(exc)
            self._cond.notify_all()


class RankedSender:
    def __init__(self, local: KVSender, links: RankLinks, ordered: Ordered) -> None:
        """`local`: rank 0's sender on its slice; `links`: to ranks 1..; `ordered(rank, message)` hands a message
        to that rank's endpoint in order with the engine's steps (the engine thread only)."""
        self.local, self.links, self.ordered = local, links, ordered
        self.size = links.size
        self.layout = local.layout
        self._lock = threading.Lock()
        self._transfers: dict[int, RankedTransfer] = {}
        self._tids = itertools.count(1)
        self._rank_addresses: dict[str, list[str]] = {}   # a receiving engine's rank 0 KV address -> its other ranks'
        self._remote_bytes = 0
        links.on("sent", self._sent)
        links.on_lost(self._rank_lost)

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self.local.bytes_sent + self._remote_bytes

    def connect(self, dst: Destination | dict) -> None:
        """Every rank opens (or finds open) its connection to the same rank of dst's engine; blocks up to about
        `connect_timeout` (off the engine thread). TransferError naming the rank that could not."""
        dst = _parse(dst)
        parts = self._rank_parts(dst)
        replies = [(link.rank, link.ask("connect", dst=d.to_dict()))
                   for link, d in zip(self.links.links, parts, strict=True)]
        self.local.connect(dst)
        deadline = time.monotonic() + self.local.connect_timeout + REQUEST_TIMEOUT_S
        for rank, fut in replies:
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except TransferError:
                raise
            except Exception as exc:   # no reply in time
                raise TransferError(f"kv receiver {dst.address}: tensor-parallel rank {rank} did not connect: "
                                    f"{exc or type(exc).__name__}", "unreachable") from None

    def start(self, dst: Destination | dict, src_block_ids: list[int], connect: bool = True) -> RankedTransfer:
        """As KVSender.start, for every rank (see the module docstring for who sends when)."""
        dst = _parse(dst)
        parts = self._rank_parts(dst)
        local = self.local.start(dst, src_block_ids, connect)
        t = RankedTransfer(self, next(self._tids), local, by_step=not connect)
        with self._lock:
            self._transfers[t.tid] = t
        try:
            for link, part in zip(self.links.links, parts, strict=True):
                body = {"tid": t.tid, "dst": part.to_dict(), "src": list(src_block_ids)}
                if link.lost is not None:
                    t.part_done(link.rank, {"ok": False, "code": "lost",
                                            "error": f"its KV endpoint is gone: {link.lost}"})
                elif connect:
                    link.post("send", **body)
                else:
                    self.ordered(link.rank, {"op": "start", **body})
        except Exception as exc:   # a rank's pipe broke (the engine fails next): none of it may linger
            t.abort(f"tensor-parallel ranks not told: {exc}")
            raise
        return t

    def send(self, dst: Destination | dict, src_block_ids: list[int], timeout: float = 10.0) -> int:
        t = self.start(dst, src_block_ids)
        t.send_all()
        return t.finish(timeout)

    def forget_peer(self, address: str) -> None:
        """As KVSender.forget_peer, for every rank's connection to that engine."""
        self.local.forget_peer(address)
        with self._lock:
            others = self._rank_addresses.pop(address, [])
        for link, other in zip(self.links.links, others, strict=False):   # none: never sent there
            link.post("forget_peer", address=other)

    def keep_peers(self, addresses: Iterable[str]) -> None:
        """As KVSender.keep_peers (rank 0's addresses of the receiving engines to keep), for every rank."""
        keep = set(addresses)
        self.local.keep_peers(keep)
        with self._lock:
            self._rank_addresses = {a: ranks for a, ranks in self._rank_addresses.items() if a in keep}
            kept = list(self._rank_addresses.values())
        for i, link in enumerate(self.links.links):
            link.post("keep_peers", addresses=[ranks[i] for ranks in kept])

    def close(self) -> None:
        """Rank 0's connections close (the other ranks' close with their endpoints)."""
        self.local.close()

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def forget(self, t: RankedTransfer) -> None:
        with self._lock:
            self._transfers.pop(t.tid, None)

    def remote_bytes(self, n: int) -> None:
        with self._lock:
            self._remote_bytes += n

    def _rank_parts(self, dst: Destination) -> list[Destination]:
        """dst's destinations of ranks 1.. (each for dst's blocks: a lender may send fewer than were reserved)."""
        if len(dst.ranks) != self.size - 1:
            raise LayoutMismatchError(
                f"kv destination {dst.address}: its engine's KV is in {len(dst.ranks) + 1} rank slice(s), this one's "
                f"in {self.size}: KV sliced per rank moves only between engines of the same tensor_parallel_size "
                "whose pools are both sliced per rank")
        with self._lock:
            self._rank_addresses[dst.address] = [d.address for d in dst.ranks]
        return [replace(d, block_ids=list(dst.block_ids)) for d in dst.ranks]

    def _sent(self, rank: int, frame: dict[str, Any]) -> None:
        with self._lock:
            t = self._transfers.get(frame.get("tid", 0))
        if t is not None:
            t.part_done(rank, frame)

    def _rank_lost(self, rank: int, why: str) -> None:
        with self._lock:
            pending = list(self._transfers.values())
        for t in pending:
            t.part_done(rank, {"ok": False, "code": "lost", "error": f"its KV endpoint is gone: {why}"})


def _parse(dst: Destination | dict) -> Destination:
    return Destination.from_dict(dst) if isinstance(dst, dict) else dst
