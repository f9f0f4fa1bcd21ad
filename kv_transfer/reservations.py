"""The receiver's reservation table: a plain state machine, no sockets, no threads, no locks.

    reserve ─► RESERVED ──open / first write (binds the owner)──► OPEN ──done + every write landed──► COMPLETE
                  │                                               │
                  └──── cancel / expire / abort / owner lost / checksum mismatch ──► FAILED ──quiet──► RELEASED

A reservation expects one writer (a sender session: its owner), or several when the sending engine's pool is sliced
per rank and more than one sending rank fills this pool's heads (kv_transfer/per_rank/): each writer claims a slot
with its first open or write, announces its own total with its own done and is checked on its own; the reservation
completes (and every writer is acknowledged) once every expected writer's writes landed and matched, and fails for
all when any one fails (a checksum, its connection lost, its abort) or the deadline passes with a writer missing.
A reservation leaves the table when it reaches COMPLETE or RELEASED; its blocks go back to the owner
of the pool then. FAILED holds the blocks while a write is still in flight and, for reservations a
direct writer (shm) may be copying into without a word, for `grace_s` more. The caller (receiver.py)
serialises calls with its own lock and does the I/O: replies, block tags, handing results over.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pdcluster.control.lifecycle import check_move
from pdcluster.kv_transfer.checksum import combine
from pdcluster.kv_transfer.errors import ChecksumError, TransferError, from_code


class State(enum.Enum):
    RESERVED = "reserved"  # blocks held, no sender yet
    OPEN = "open"  # a sender (the owner) claimed it; its writes land
    COMPLETE = "complete"  # all announced writes landed and their checksums match (terminal)
    FAILED = "failed"  # no more writes; blocks held until no write can still land
    RELEASED = "released"  # failed and quiet: blocks handed back (terminal)


_NEXT = {
    State.RESERVED: {State.OPEN, State.FAILED},
    State.OPEN: {State.COMPLETE, State.FAILED},
    State.FAILED: {State.RELEASED},
    State.COMPLETE: set(),
    State.RELEASED: set(),
}


@dataclass
class TransferResult:
    request_id: str
    ok: bool
    error: str | None = None  # the human message of a failure
    checksum: int = 0
    nbytes: int = 0
    code: str | None = None  # the failure's machine code (errors.CODES); None when ok

    def raise_if_failed(self) -> "TransferResult":
        if not self.ok:
            raise from_code(self.code, f"kv transfer {self.request_id!r} failed: {self.error}")
        return self


@dataclass
class Writer:
    """One sender session's share of a reservation: its writes, and the total its done announced."""

    session: str
    direct: bool = False  # it writes into the pool without the receiver seeing the bytes (shm)
    writes: int = 0  # its writes landed
    expected_writes: int | None = None  # announced by its done
    done_checksum: int = 0
    landed_checksum: int = 0
    notify: Any = None  # opaque to the table: whom the receiver answers when the reservation resolves
    ready: bool = False  # every write it announced landed and matched


@dataclass
class Write:
    """One write being accepted (begin_write .. end_write / abort_write)."""

    reservation: "Reservation"
    writer: Writer


@dataclass
class Reservation:
    request_id: str
    block_ids: list[int]
    token: str
    deadline: float  # clock seconds
    num_writers: int = 1  # the sender sessions expected to write it, each its own part (pools sliced per rank)
    block_set: frozenset[int] = field(init=False)
    state: State = State.RESERVED
    writers: dict[str, Writer] = field(default_factory=dict)  # by session, in the order they claimed it
    writes: int = 0  # writes landed (every writer's)
    inflight: int = 0  # writes landing now
    landed_checksum: int = 0  # every writer's combined
    nbytes: int = 0
    error: str | None = None
    code: str | None = None  # the failure's machine code (errors.CODES)
    release_at: float = 0.0

    def __post_init__(self) -> None:
        self.block_set = frozenset(self.block_ids)

    @property
    def owner(self) -> str | None:
        """The session of the (first) sender that opened it."""
        return next(iter(self.writers), None)

    @property
    def direct(self) -> bool:
        return any(w.direct for w in self.writers.values())

    @property
    def expected_writes(self) -> int | None:
        """The writes every writer's done announced, once all of them came."""
        if len(self.writers) < self.num_writers or any(w.expected_writes is None for w in self.writers.values()):
            return None
        return sum(w.expected_writes or 0 for w in self.writers.values())

    @property
    def notify(self) -> Any:
        """The (first) writer's: whom the receiver answers."""
        w = next(iter(self.writers.values()), None)
        return w.notify if w is not None else None

    def result(self) -> TransferResult:
        ok = self.state is State.COMPLETE
        return TransferResult(self.request_id, ok, self.error, self.landed_checksum, self.nbytes, self.code)

    def _move(self, state: State) -> None:
        self.state = check_move(_NEXT, self.state, state, f"reservation {self.request_id!r}")


class ReservationTable:
    def __init__(
        self,
        num_blocks: int,
        *,
        grace_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        on_fail: Callable[[Reservation], None] | None = None,
    ):
        self.num_blocks = num_blocks
        self.grace_s = grace_s
        self.clock = clock
        self.on_fail = on_fail  # called as a reservation turns FAILED (its error is set)
        self._active: dict[str, Reservation] = {}
        self._held: set[int] = set()
        self._recent_failures: OrderedDict[str, tuple[str, str]] = OrderedDict()  # (code, error): late frames learn why

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._active

    # ---- transitions -------------------------------------------------------------------------------

    def reserve(self, request_id: str, block_ids: list[int], timeout_s: float, writers: int = 1) -> Reservation:
        """Hold `block_ids` for `writers` sender sessions (each writes its part) until `timeout_s` passes."""
        if not isinstance(writers, int) or writers < 1:
            raise ValueError(f"writers: expected an int >= 1, got {writers!r}")
        if not block_ids:
            raise ValueError("block_ids: expected at least one block")
        bad = [b for b in block_ids if not isinstance(b, int) or not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block_ids: {bad[:5]} outside 0..{self.num_blocks - 1}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block_ids: duplicates")
        if request_id in self._active:
            raise ValueError(f"request_id: {request_id!r} already has an active reservation")
        taken = self._held.intersection(block_ids)
        if taken:
            raise ValueError(f"block_ids: {sorted(taken)[:5]} already reserved by another request")
        res = Reservation(request_id, list(block_ids), secrets.token_hex(16), self.clock() + timeout_s, writers)
        self._active[request_id] = res
        self._held.update(block_ids)
        self._recent_failures.pop(request_id, None)
        return res

    def open(self, request_id: Any, token: Any, owner: str, blocks: Iterable[int], direct: bool = False) -> Reservation:
        """A sender announces the blocks it will write; binds the reservation to it (its owner)."""
        res = self.check(request_id, token)
        outside = [b for b in blocks if not isinstance(b, int) or b not in res.block_set]
        if outside:
            raise TransferError(f"open names blocks not reserved by {request_id!r}: {outside[:5]}", "refused")
        self._claim(res, owner, direct)
        return res

    def begin_write(
        self, request_id: Any, token: Any, owner: str, runs: list[tuple[int, int]], direct: bool = False
    ) -> Write:
        """Accept one write into runs (start, n): all checks happen before any byte lands. A write may
        overtake its open on another stream, so it claims the reservation too."""
        res = self.check(request_id, token)
        outside = [b for s, n in runs for b in range(s, s + n) if b not in res.block_set]
        if outside:
            raise TransferError(f"blocks {outside[:5]} are not reserved by {res.request_id!r}", "refused")
        writer = self._claim(res, owner, direct)
        res.inflight += 1
        return Write(res, writer)

    def end_write(self, write: Write, nbytes: int, checksum: int, landed: int) -> None:
        """The write's bytes landed; it may complete the reservation (state COMPLETE, out of the table).
        Raises ChecksumError (the reservation failed) when what landed is not what was sent."""
        res, w = write.reservation, write.writer
        res.inflight -= 1
        res.writes += 1
        w.writes += 1
        res.nbytes += nbytes
        res.landed_checksum = combine(res.landed_checksum, landed)
        w.landed_checksum = combine(w.landed_checksum, landed)
        if landed != checksum:
            error = f"checksum mismatch on a write of {nbytes} bytes: sent {checksum:#x}, landed {landed:#x}"
            self.fail(res, error, "checksum")
            raise ChecksumError(error)
        self._try_complete(res, w)

    def abort_write(self, write: Write, error: str) -> None:
        """A write broke off midway (its bytes may be partly in the pool)."""
        write.reservation.inflight -= 1
        self.fail(write.reservation, error, "lost")

    def done(
        self, request_id: Any, token: Any, owner: str, writes: int, checksum: int, notify: Any = None
    ) -> Reservation:
        """The owner announces its total; completes the reservation if every write already landed."""
        res = self.check(request_id, token)
        w = res.writers.get(owner)
        if res.state is not State.OPEN or w is None or w.expected_writes is not None:
            # e.g. a sender whose open was rejected but that sent done before hearing so: it must not
            # bind the reservation (its connection's close would then fail it).
            raise TransferError(f"done for {request_id!r} without an accepted open", "refused")
        w.expected_writes, w.done_checksum, w.notify = writes, checksum, notify
        self._try_complete(res, w)
        return res

    def abort(self, request_id: Any, token: Any, reason: str) -> None:
        """The sender gives up (the token is its authority, whichever connection it uses)."""
        self.fail(self.check(request_id, token), f"aborted by the sender: {reason}", "aborted")

    def cancel(self, request_id: str, reason: str = "cancelled by the receiver's owner") -> bool:
        res = self._active.get(request_id)
        if res is None:
            return False
        self.fail(res, reason, "cancelled")
        return True

    def extend(self, request_id: str, timeout_s: float) -> bool:
        """Its owner still waits for it: the deadline moves to `timeout_s` from now (never earlier). False when
        there is no such reservation or it already failed."""
        res = self._active.get(request_id)
        if res is None or res.state is State.FAILED:
            return False
        res.deadline = max(res.deadline, self.clock() + timeout_s)
        return True

    def expire(self) -> list[Reservation]:
        now = self.clock()
        late = [r for r in self._active.values() if r.state is not State.FAILED and now > r.deadline]
        for r in late:
            self.fail(r, f"deadline exceeded ({now - r.deadline:.2f} s late)", "expired")
        return late

    def drop_owner(self, owner: str, reason: str) -> list[Reservation]:
        """A writer's connection is gone: fail what it writes (with every other writer's part)."""
        lost = [r for r in self._active.values() if owner in r.writers and r.state is not State.FAILED]
        for r in lost:
            self.fail(r, reason, "lost")
        return lost

    def fail(self, res: Reservation, error: str, code: str = "failed") -> None:
        """Fail `res` with a human `error` and a machine `code` (errors.CODES); failing twice keeps the first."""
        if res.state is State.FAILED:
            return
        # A direct writer checks the block tags right before copying and does not wait for its open to
        # be seen: one may be copying without having said a word, so hold the blocks back a while.
        grace = self.grace_s if res.direct or len(res.writers) < res.num_writers else 0.0
        res._move(State.FAILED)
        res.error, res.code, res.release_at = error, code, self.clock() + grace
        if self.on_fail is not None:
            self.on_fail(res)

    def release(self) -> list[Reservation]:
        """Failed reservations that no write can touch any more leave the table (RELEASED)."""
        now = self.clock()
        ready = [
            r for r in self._active.values() if r.state is State.FAILED and r.inflight == 0 and now >= r.release_at
        ]
        for r in ready:
            r._move(State.RELEASED)
            self._remove(r)
            self._recent_failures[r.request_id] = (r.code or "failed", r.error or "")
            while len(self._recent_failures) > 1024:
                self._recent_failures.popitem(last=False)
        return ready

    # ---- checks ------------------------------------------------------------------------------------

    def check(self, request_id: Any, token: Any) -> Reservation:
        """The live reservation a sender's frame may act on; a TransferError with the reason otherwise (a
        frame for a failed reservation gets that failure's code: a late write after a checksum mismatch is a
        ChecksumError too)."""
        res = self._active.get(request_id) if isinstance(request_id, str) else None
        if res is None:
            if isinstance(request_id, str) and request_id in self._recent_failures:
                code, error = self._recent_failures[request_id]
                raise from_code(code, f"reservation {request_id!r} already failed: {error}")
            raise TransferError(f"no active reservation {request_id!r}", "missing")
        if not isinstance(token, str) or not hmac.compare_digest(token, res.token):
            raise TransferError(f"bad token for reservation {request_id!r}", "refused")
        if res.state is State.FAILED:
            raise from_code(res.code, f"reservation {request_id!r} already failed: {res.error}")
        if self.clock() > res.deadline:
            raise TransferError(f"reservation {request_id!r} is past its deadline", "expired")
        return res

    def _claim(self, res: Reservation, owner: str, direct: bool) -> Writer:
        w = res.writers.get(owner)
        if w is None:
            if len(res.writers) >= res.num_writers:
                others = "another sender" if res.num_writers == 1 else f"{res.num_writers} other senders"
                raise TransferError(f"reservation {res.request_id!r} is open to {others}", "refused")
            w = res.writers[owner] = Writer(owner, direct)
            if res.state is State.RESERVED:
                res._move(State.OPEN)
        elif w.ready:
            raise TransferError(f"reservation {res.request_id!r}: this sender's part is complete", "refused")
        return w

    def _try_complete(self, res: Reservation, w: Writer) -> None:
        if w.expected_writes is None or w.writes < w.expected_writes or res.state is not State.OPEN:
            return
        if w.writes > w.expected_writes or w.landed_checksum != w.done_checksum:
            self.fail(
                res,
                f"checksum mismatch: sender total {w.done_checksum:#x} over {w.expected_writes} writes, "
                f"landed {w.landed_checksum:#x} over {w.writes} writes",
                "checksum",
            )
            return
        w.ready = True
        if len(res.writers) == res.num_writers and all(x.ready for x in res.writers.values()):
            res._move(State.COMPLETE)
            self._remove(res)

    def _remove(self, res: Reservation) -> None:
        del self._active[res.request_id]
        self._held.difference_update(res.block_ids)
