"""Rank 0's sender for a KV pool sliced per tensor-parallel rank: each rank sends its slice, one transfer results.

`RankedSender` answers like a `KVSender` (connect, start, and the transfer's send_layers / send_all / finish /
abort): rank 0's slice goes from here (a `KVSender` on it), every other rank's from its own endpoint
(endpoint.py), into the receiving engine's pools (`Destination.ranks`, from its `RankedReceiver`, or its one pool).
The transfer is made of parts, one per (sending rank, receiving pool) with KV heads in common (regroup.writers):
rank r to rank r between engines sliced alike, each sending rank into the receiving slices of its heads when the
receiving engine has more slices (2 -> 4), several sending ranks into one receiving pool when it has fewer (2 -> 1,
4 -> 2: the receiver's reservation expects that many writers, each filling its own heads), and a one-rank engine
(`local` on its whole pool, no links) into every slice. Where the model has fewer KV heads than slices, a sending
rank holding a copy of a head another rank sends into a pool has no part there (regroup.py). A one-rank engine into
one whole pool is its `KVSender`'s plain transfer. A destination whose pools are not its slices in order is refused
(LayoutMismatchError).

Rank 0 drives the push. Started on the engine thread (`connect=False`, a prefill node's prompt), the other ranks
hear of the transfer in order with the engine's steps (`ordered`: LLMEngine.tell_rank_agent), before the step
whose layers it sends: each rank then sends each layer as its own step computes it, as rank 0 does with
`send_layers`; `send_all` (after the step that computed the KV) has every rank send every layer at once. Started
from any other thread (`connect=True`: blocks computed long ago), each rank sends them at once, told over its link.
Each rank finishes its part itself and reports its ack (or failure); `finish` returns the acknowledged checksums
combined by receiving rank (checksum.combine_ranks, as the receiver combines what landed), or stops every part once
one failed and raises the failure behind the others (errors.root_cause: a checksum, a lost rank, not the parts
aborted or cancelled because of it). A rank whose endpoint is gone fails its parts at once (code "lost").
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from pdcluster.kv_transfer.checksum import MASK64, combine_ranks
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import LayoutMismatchError, TransferError, from_code, root_cause
from pdcluster.kv_transfer.layout import KVLayout
from pdcluster.kv_transfer.per_rank.link import REQUEST_TIMEOUT_S, RankLinks
from pdcluster.kv_transfer.regroup import writers
from pdcluster.kv_transfer.sender import KVSender, Transfer, TransferState

Ordered = Callable[[int, dict[str, Any]], None]   # (rank, message): in order with the engine's steps
STOPPED_REPORT_WAIT_S = 1.0   # after a part failed, how long finish waits for the others' reports (which may say why)


@dataclass
class _Part:
    """One sending rank's share of a transfer into one receiving pool (rank `dst_rank` of the receiving engine)."""
    src_rank: int
    dst_rank: int
    dst: Destination
    tid: int = 0   # a remote part's transfer id at its rank's endpoint (0: rank 0's part)


class RankedTransfer:
    """One request's KV going from every rank of this engine to the receiving engine's pools (each part: a
    sending rank into a receiving pool whose heads it holds; the same rank of an engine sliced the same way)."""

    def __init__(self, sender: "RankedSender", dst: Destination, local: list[tuple[_Part, Transfer]],
                 remote: list[_Part], by_step: bool) -> None:
        self.request_id, self.dst = dst.request_id, dst
        self.tid = remote[0].tid if remote else 0
        self._sender, self._locals, self._remote, self._by_step = sender, local, remote, by_step
        self._receivers = len(dst.ranks) + 1
        self._cond = threading.Condition()
        self._reported: set[int] = set()   # the remote parts (by tid) that reported
        self._acked: dict[int, int] = {}   # receiving rank -> checksum its receiver acknowledged
        self._remote_bytes = 0   # wire bytes of the remote parts acknowledged
        self._failures: list[TransferError] = []   # as they came
        self._checksum: int | None = None

    @property
    def tids(self) -> list[int]:
        return [part.tid for part in self._remote]

    @property
    def backend(self) -> str:
        """Rank 0's (first part's) channel (the other parts' may differ: shm reaches only a pool in shared memory)."""
        return self._locals[0][1].backend

    @property
    def failed(self) -> bool:
        return bool(self._failures) or any(t.failed for _, t in self._locals)

    @property
    def error(self) -> TransferError | None:
        """Why it failed: the part that failed of its own accord, not those stopped because of it."""
        with self._cond:
            failures = list(self._failures)
        for _, t in self._locals:
            if t.error is not None and t.error not in failures:
                failures.append(t.error)
        return root_cause(failures) if failures else None

    @property
    def state(self) -> TransferState:
        if self.failed:
            return TransferState.FAILED
        for _, t in self._locals:
            if t.state is not TransferState.COMPLETE:
                return t.state
        if self._checksum is None:
            return TransferState.AWAITING_ACK   # rank 0's parts are done, not every other rank's yet
        return TransferState.COMPLETE

    @property
    def checksum(self) -> int | None:
        return self._checksum

    @property
    def sent_bytes(self) -> int:
        """Wire bytes of every part (a remote one's once acknowledged: all of them when `finish` returned)."""
        with self._cond:
            return sum(t.sent_bytes for _, t in self._locals) + self._remote_bytes

    def send_layers(self, l0: int, l1: int) -> None:
        """Rank 0's layers [l0, l1); the other ranks send theirs as their own step computes them."""
        for _, t in self._locals:
            t.send_layers(l0, l1)

    def send_all(self) -> None:
        for _, t in self._locals:
            t.send_all()
        if self._by_step:
            for part in self._remote:
                self._sender.ordered(part.src_rank, {"op": "send_all", "tid": part.tid})

    def finish(self, timeout: float = 10.0) -> int:
        """Until every part's receiver acknowledged it; the checksum combined over the receiving ranks (as their
        engine's `RankedReceiver` combines what landed). Raises `error`."""
        deadline = time.monotonic() + timeout
        for part, t in self._locals:
            try:
                acked = t.finish(max(0.0, deadline - time.monotonic()))
            except TransferError as exc:
                self._fail(exc)
                break
            with self._cond:
                self._acked[part.dst_rank] = (self._acked.get(part.dst_rank, 0) + acked) & MASK64
        if self._failures:   # stop the others; their reports (which may name the cause) come at once
            self._stop_parts(str(self._failures[0]))
            deadline = min(deadline, time.monotonic() + STOPPED_REPORT_WAIT_S)
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._reported) == len(self._remote),
                                       max(0.0, deadline - time.monotonic())) and not self._failures:
                self._failures.append(TransferError(
                    f"kv transfer {self.request_id!r}: not every tensor-parallel rank's part was acknowledged within "
                    f"{timeout} s", "timeout"))
        error = self.error
        if error is not None:
            self.abort(str(error))
            raise error
        self._checksum = combine_ranks([self._acked.get(d, 0) for d in range(self._receivers)])
        self._sender.forget(self)
        return self._checksum

    def abort(self, reason: str = "") -> None:
        """Every rank drops its part (their receivers give the blocks back); no-op once acknowledged."""
        for _, t in self._locals:
            t.abort(reason)
        self._fail(TransferError(f"kv transfer {self.request_id!r} aborted: {reason}", "aborted"))
        self._stop_parts(reason)
        self._sender.forget(self)

    def part_done(self, tid: int, frame: dict[str, Any]) -> None:
        """A remote part's report (a link thread): its ack, or its failure, which fails the whole transfer."""
        part = next((p for p in self._remote if p.tid == tid), None)
        if part is None:
            return
        with self._cond:
            if tid in self._reported:   # e.g. its link broke after its ack: that part is done
                return
            self._reported.add(tid)
            if frame.get("ok"):
                self._acked[part.dst_rank] = (self._acked.get(part.dst_rank, 0) + int(frame.get("checksum") or 0)) \
                    & MASK64
                self._remote_bytes += int(frame.get("nbytes") or 0)
            self._cond.notify_all()
        if frame.get("ok"):
            self._sender.remote_bytes(int(frame.get("nbytes") or 0))
            return
        why = f"kv transfer {self.request_id!r}, tensor-parallel rank {part.src_rank}: {frame.get('error')}"
        self._fail(from_code(frame.get("code"), why))
        for _, t in self._locals:
            t.abort(why)

    def rank_lost(self, rank: int, why: str) -> None:
        for part in self._remote:
            if part.src_rank == rank:
                self.part_done(part.tid, {"ok": False, "code": "lost", "error": f"its KV endpoint is gone: {why}"})

    def _stop_parts(self, reason: str) -> None:
        if self._checksum is None:
            for part in self._remote:
                if part.tid not in self._reported:
                    self._sender.links[part.src_rank].post("abort", tid=part.tid, reason=reason)

    def _fail(self, exc: TransferError) -> None:
        with self._cond:
            if self._checksum is None:
                self._failures.append(exc)
            self._cond.notify_all()


class RankedSender:
    def __init__(self, local: KVSender, links: RankLinks, ordered: Ordered) -> None:
        """`local`: rank 0's sender on its slice (or on the whole pool of a one-rank engine, `links` empty);
        `links`: to ranks 1..; `ordered(rank, message)` hands a message to that rank's endpoint in order with the
        engine's steps (the engine thread only)."""
        self.local, self.links, self.ordered = local, links, ordered
        self.size = links.size
        self.layout = local.layout
        if self.layout.rank_slices != self.size and not (self.size == 1 and self.layout.rank_slices == 1):
            raise ValueError(f"rank 0's pool is slice {self.layout.rank_slice} of {self.layout.rank_slices}, "
                             f"links reach {self.size} ranks")
        self._lock = threading.Lock()
        self._transfers: dict[int, RankedTransfer] = {}   # by each remote part's tid
        self._tids = itertools.count(1)
        # a receiving engine's rank 0 KV address -> per sending rank, the receiving addresses it sends to
        self._rank_addresses: dict[str, dict[int, list[str]]] = {}
        self._remote_bytes = 0
        links.on("sent", self._sent)
        links.on_lost(self._rank_lost)

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self.local.bytes_sent + self._remote_bytes

    def connect(self, dst: Destination | dict) -> None:
        """Every rank opens (or finds open) its connections to the receiving pools it sends to; blocks up to
        about `connect_timeout` (off the engine thread). TransferError naming the rank that could not."""
        dst = _parse(dst)
        parts = self._plan(dst)
        replies = [(part.src_rank, self.links[part.src_rank].ask("connect", dst=part.dst.to_dict()))
                   for part in parts if part.src_rank]
        for part in parts:
            if not part.src_rank:
                self.local.connect(part.dst)
        deadline = time.monotonic() + self.local.connect_timeout + REQUEST_TIMEOUT_S
        for rank, fut in replies:
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except TransferError:
                raise
            except Exception as exc:   # no reply in time
                raise TransferError(f"kv receiver {dst.address}: tensor-parallel rank {rank} did not connect: "
                                    f"{exc or type(exc).__name__}", "unreachable") from None

    def start(self, dst: Destination | dict, src_block_ids: list[int],
              connect: bool = True) -> RankedTransfer | Transfer:
        """As KVSender.start, for every rank (see the module docstring for who sends when)."""
        dst = _parse(dst)
        if self.size == 1 and not dst.ranks:   # one pool to one pool: nothing to combine
            return self.local.start(dst, src_block_ids, connect)
        parts = self._plan(dst)
        local: list[tuple[_Part, Transfer]] = []
        try:
            for part in parts:
                if not part.src_rank:
                    local.append((part, self.local.start(part.dst, src_block_ids, connect)))
        except BaseException:
            for _, lt in local:
                lt.abort("another part could not start")
            raise
        remote = [replace(part, tid=next(self._tids)) for part in parts if part.src_rank]
        t = RankedTransfer(self, dst, local, remote, by_step=not connect)
        with self._lock:
            for part in remote:
                self._transfers[part.tid] = t
        try:
            for part in remote:
                link = self.links[part.src_rank]
                body = {"tid": part.tid, "dst": part.dst.to_dict(), "src": list(src_block_ids)}
                if link.lost is not None:
                    t.part_done(part.tid, {"ok": False, "code": "lost",
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
        """As KVSender.forget_peer, for every rank's connections to that engine."""
        with self._lock:
            others = self._rank_addresses.pop(address, {})
        for a in others.get(0, [address]):
            self.local.forget_peer(a)
        for rank, addresses in others.items():
            for other in addresses if rank else []:
                self.links[rank].post("forget_peer", address=other)

    def keep_peers(self, addresses: Iterable[str]) -> None:
        """As KVSender.keep_peers (rank 0's addresses of the receiving engines to keep), for every rank."""
        keep = set(addresses)
        with self._lock:
            self._rank_addresses = {a: ranks for a, ranks in self._rank_addresses.items() if a in keep}
            kept = list(self._rank_addresses.values())
        self.local.keep_peers(keep | {a for ranks in kept for a in ranks.get(0, [])})
        for link in self.links.links:
            link.post("keep_peers", addresses=[a for ranks in kept for a in ranks.get(link.rank, [])])

    def close(self) -> None:
        """Rank 0's connections close (the other ranks' close with their endpoints)."""
        self.local.close()

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def forget(self, t: RankedTransfer) -> None:
        with self._lock:
            for tid in t.tids:
                self._transfers.pop(tid, None)

    def remote_bytes(self, n: int) -> None:
        with self._lock:
            self._remote_bytes += n

    def _plan(self, dst: Destination) -> list[_Part]:
        """The parts of a transfer into dst's engine: (sending rank, receiving pool) for every pair of pools with
        KV heads in common (regroup.writers; rank r to rank r between engines sliced the same way, several sending
        ranks into one pool sliced over fewer ranks), each for dst's blocks (a lender may send fewer than were
        reserved). LayoutMismatchError when the engines' KV does not fit or dst's pools are not its rank slices."""
        pools = [replace(dst, ranks=[]), *(replace(d, block_ids=list(dst.block_ids)) for d in dst.ranks)]
        try:
            layouts = [KVLayout.from_dict(d.layout) for d in pools]
        except ValueError as exc:
            raise LayoutMismatchError(f"kv destination {dst.address}: {exc}") from None
        for d, lay in enumerate(layouts):
            if (lay.rank_slices, lay.rank_slice) != ((len(pools), d) if len(pools) > 1 else (1, 0)):
                raise LayoutMismatchError(
                    f"kv destination {dst.address}: its engine's KV is in {len(pools)} rank slice(s), its pool {d} is "
                    f"slice {lay.rank_slice} of {lay.rank_slices}")
            self.layout.engine_layout().check_compatible(lay.engine_layout(), mine="sender", theirs="receiver")
        mine = [replace(self.layout, rank_slice=p) for p in range(self.size)]
        parts = []
        for d, found in enumerate(writers(mine, layouts)):
            if not found:
                raise LayoutMismatchError(f"kv destination {dst.address}: its pool {d} of {len(pools)} has no KV head "
                                          f"in common with this engine's {self.size} rank slices")
            parts += [_Part(src, d, pools[d]) for src in found]
        by_rank: dict[int, list[str]] = {}
        for part in parts:
            by_rank.setdefault(part.src_rank, []).append(part.dst.address)
        with self._lock:
            self._rank_addresses[dst.address] = by_rank
        return parts

    def _sent(self, rank: int, frame: dict[str, Any]) -> None:
        tid = frame.get("tid", 0)
        with self._lock:
            t = self._transfers.get(tid)
        if t is not None:
            t.part_done(tid, frame)

    def _rank_lost(self, rank: int, why: str) -> None:
        with self._lock:
            pending = list(set(self._transfers.values()))
        for t in pending:
            t.rank_lost(rank, why)


def _parse(dst: Destination | dict) -> Destination:
    return Destination.from_dict(dst) if isinstance(dst, dict) else dst
