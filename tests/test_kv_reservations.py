"""The receiver's reservation table as a plain state machine: every transition, driven by a fake clock."""

from __future__ import annotations

import random

import pytest

from pdcluster.kv_transfer.errors import ChecksumError, TransferError
from pdcluster.kv_transfer.reservations import Reservation, ReservationTable, State


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def failed() -> list[Reservation]:
    return []


@pytest.fixture
def table(clock, failed) -> ReservationTable:
    return ReservationTable(16, grace_s=0.5, clock=clock, on_fail=failed.append)


def write(table: ReservationTable, res: Reservation, owner: str, runs, checksum: int = 7, landed: int = 7) -> None:
    res = table.begin_write(res.request_id, res.token, owner, runs)
    table.end_write(res, 100, checksum, landed)


# ---- reserve ----------------------------------------------------------------------------------------------


def test_reserve_validates_and_holds_blocks(table, clock):
    res = table.reserve("a", [3, 1, 2], timeout_s=5)
    assert res.state is State.RESERVED and res.deadline == clock.now + 5 and res.block_ids == [3, 1, 2]
    assert "a" in table and len(table) == 1 and len(res.token) == 32
    assert table.reserve("b", [4], 5).token != res.token
    for rid, blocks, match in [
        ("c", [], "at least one"),
        ("c", [16], "outside"),
        ("c", [-1], "outside"),
        ("c", [5, 5], "duplicates"),
        ("a", [9], "already has an active reservation"),
        ("c", [9, 2], "already reserved by another request"),
    ]:
        with pytest.raises(ValueError, match=match):
            table.reserve(rid, blocks, 5)
    assert len(table) == 2


# ---- open / write / done: the happy path and its refusals ----------------------------------------------


def test_open_then_writes_then_done_completes_and_frees_blocks(table, failed):
    res = table.reserve("a", [1, 2, 3], 5)
    assert table.open("a", res.token, "s1", [1, 2, 3]) is res
    assert res.state is State.OPEN and res.owner == "s1"
    write(table, res, "s1", [(1, 2)], checksum=10, landed=10)
    write(table, res, "s1", [(3, 1)], checksum=20, landed=20)
    assert res.state is State.OPEN  # no done yet
    assert table.done("a", res.token, "s1", 2, 30, notify="conn") is res
    assert res.state is State.COMPLETE and res.notify == "conn" and "a" not in table
    result = res.result()
    assert result.ok and result.checksum == 30 and result.nbytes == 200 and result.error is None
    table.reserve("again", [1, 2, 3], 5)  # the blocks are free
    assert not failed


def test_done_before_the_last_write_lands_waits_for_it(table):
    res = table.reserve("a", [1, 2], 5)
    table.open("a", res.token, "s1", [1, 2])
    write(table, res, "s1", [(1, 1)], checksum=1, landed=1)
    table.done("a", res.token, "s1", 2, 3)
    assert res.state is State.OPEN and res.expected_writes == 2
    write(table, res, "s1", [(2, 1)], checksum=2, landed=2)
    assert res.state is State.COMPLETE and "a" not in table


def test_a_write_may_overtake_its_open_and_claims_the_reservation(table):
    res = table.reserve("a", [1, 2], 5)
    table.begin_write("a", res.token, "s1", [(1, 2)], direct=True)
    assert res.state is State.OPEN and res.owner == "s1" and res.direct and res.inflight == 1
    table.open("a", res.token, "s1", [1, 2])  # the late open of the same sender is fine
    with pytest.raises(TransferError, match="open to another sender"):
        table.open("a", res.token, "s2", [1, 2])


def test_done_without_open_is_rejected_and_binds_nothing(table):
    res = table.reserve("a", [1, 2], 5)
    for blocks in ([1, 9], [1, [2]], ["1"]):
        with pytest.raises(TransferError, match="open names blocks not reserved"):
            table.open("a", res.token, "s1", blocks)
    assert res.state is State.RESERVED and res.owner is None  # a rejected open binds nothing
    with pytest.raises(TransferError, match="without an accepted open"):
        table.done("a", res.token, "s1", 1, 0)
    assert res.state is State.RESERVED and res.expected_writes is None
    table.open("a", res.token, "s2", [1, 2])  # another sender can still have it
    assert res.owner == "s2"


def test_owner_checks(table):
    res = table.reserve("a", [1, 2], 5)
    table.open("a", res.token, "s1", [1])
    with pytest.raises(TransferError, match="open to another sender"):
        table.begin_write("a", res.token, "s2", [(1, 1)])
    with pytest.raises(TransferError, match="without an accepted open"):
        table.done("a", res.token, "s2", 0, 0)
    assert res.inflight == 0 and res.state is State.OPEN


def test_frames_need_the_token_live_blocks_and_a_live_reservation(table):
    res = table.reserve("a", [1, 2], 5)
    for rid, token, match in [("a", "0" * 32, "bad token"), ("a", None, "bad token"), ("zz", res.token, "no active"),
                              (7, res.token, "no active")]:  # fmt: skip
        with pytest.raises(TransferError, match=match):
            table.begin_write(rid, token, "s1", [(1, 1)])
    with pytest.raises(TransferError, match=r"blocks \[3\] are not reserved"):
        table.begin_write("a", res.token, "s1", [(2, 2)])
    assert res.state is State.RESERVED and res.inflight == 0


# ---- failures: checksum, cancel, abort, expiry, lost owner -------------------------------------------------


def test_checksum_mismatch_on_a_write_fails_the_reservation(table, failed):
    res = table.reserve("a", [1], 5)
    table.open("a", res.token, "s1", [1])
    with pytest.raises(ChecksumError, match="sent 0x7, landed 0x8"):
        write(table, res, "s1", [(1, 1)], checksum=7, landed=8)
    assert res.state is State.FAILED and failed == [res] and res.inflight == 0
    with pytest.raises(TransferError, match="already failed: checksum mismatch"):
        table.begin_write("a", res.token, "s1", [(1, 1)])


@pytest.mark.parametrize("writes, total", [(1, 99), (0, 5)])
def test_done_total_that_disagrees_with_what_landed_fails(table, writes, total):
    res = table.reserve("a", [1], 5)
    table.open("a", res.token, "s1", [1])
    write(table, res, "s1", [(1, 1)], checksum=5, landed=5)
    table.done("a", res.token, "s1", writes, total)  # a wrong sum, or more writes landed than announced
    assert res.state is State.FAILED and "checksum mismatch: sender total" in res.error


def test_cancel_after_open_holds_blocks_until_no_write_is_in_flight(table, clock, failed):
    res = table.reserve("a", [1, 2], 5)
    table.open("a", res.token, "s1", [1, 2])  # not direct: no grace period
    inflight = table.begin_write("a", res.token, "s1", [(1, 2)])
    assert table.cancel("a") and res.state is State.FAILED and failed == [res]
    assert table.release() == [] and "a" in table  # a write is still landing
    table.end_write(inflight, 100, 1, 1)  # it lands after all, but cannot complete a failed reservation
    assert res.state is State.FAILED
    assert table.release() == [res] and res.state is State.RELEASED and "a" not in table
    result = res.result()
    assert not result.ok and result.error == "cancelled by the receiver's owner"
    with pytest.raises(TransferError, match="already failed: cancelled"):  # late frames learn why
        table.begin_write("a", res.token, "s1", [(1, 1)])
    assert not table.cancel("a") and not table.cancel("never")


@pytest.mark.parametrize("opened, direct, held", [(False, False, True), (True, True, True), (True, False, False)])
def test_grace_period_for_reservations_a_direct_writer_may_touch(table, clock, opened, direct, held):
    res = table.reserve("a", [1], 5)
    if opened:
        table.open("a", res.token, "s1", [1], direct=direct)
    table.cancel("a")
    assert (table.release() == []) is held
    clock.now += 0.5
    assert table.release() == ([res] if held else [])


def test_sender_abort_needs_the_token(table):
    res = table.reserve("a", [1], 5)
    with pytest.raises(TransferError, match="bad token"):
        table.abort("a", "x" * 32, "why")
    table.abort("a", res.token, "prefill failed")
    assert res.state is State.FAILED and res.error == "aborted by the sender: prefill failed"


def test_expiry_by_deadline(table, clock):
    late = table.reserve("late", [1], timeout_s=1)
    opened = table.reserve("opened", [2], timeout_s=1)
    table.open("opened", opened.token, "s1", [2])
    keep = table.reserve("keep", [3], timeout_s=10)
    clock.now += 0.5
    assert table.expire() == []
    clock.now += 1
    with pytest.raises(TransferError, match="past its deadline"):  # refused even before the reaper runs
        table.begin_write("late", late.token, "s1", [(1, 1)])
    assert table.expire() == [late, opened]
    assert late.error.startswith("deadline exceeded (0.50 s late") and keep.state is State.RESERVED
    assert table.expire() == []  # failed ones do not fail again


def test_lost_owner_fails_only_its_reservations(table, failed):
    a, b, c = (table.reserve(r, [i], 5) for i, r in enumerate("abc"))
    table.open("a", a.token, "s1", [0])
    table.open("b", b.token, "s2", [1])
    assert table.drop_owner("s1", "sender connection lost (tcp)") == [a]
    assert failed == [a] and b.state is State.OPEN and c.state is State.RESERVED
    table.fail(a, "again")  # failing twice is a no-op
    assert failed == [a] and a.error == "sender connection lost (tcp)"


def test_illegal_transitions_are_refused(table):
    res = table.reserve("a", [1], 5)
    with pytest.raises(RuntimeError, match="reserved -> complete is not a transition"):
        res._move(State.COMPLETE)
    table.open("a", res.token, "s1", [1])
    with pytest.raises(RuntimeError, match="open -> reserved"):
        res._move(State.RESERVED)
    write(table, res, "s1", [(1, 1)])
    table.done("a", res.token, "s1", 1, 7)
    assert res.state is State.COMPLETE
    for state in State:
        with pytest.raises(RuntimeError, match="not a transition"):
            res._move(state)
    with pytest.raises(TransferError, match="no active reservation"):  # frames after completion
        table.done("a", res.token, "s1", 1, 7)


def test_random_walks_keep_blocks_and_states_consistent(clock):
    """Whatever the order of operations: a block is held by at most one live reservation, terminal
    reservations are out of the table, and every reservation ends in a terminal state."""
    rng = random.Random(0)
    table = ReservationTable(12, grace_s=0.2, clock=clock)
    seen: list[Reservation] = []
    for step in range(3000):
        live = [r for r in seen if r.request_id in table and table._active[r.request_id] is r]
        op = rng.choice(["reserve", "open", "write", "done", "cancel", "tick", "release", "drop", "abort"])
        r = rng.choice(live) if live else None
        owner = rng.choice(["s1", "s2"])
        try:
            if op == "reserve":
                seen.append(table.reserve(f"r{step}", rng.sample(range(12), rng.randint(1, 3)), rng.uniform(0, 2)))
            elif op == "tick":
                clock.now += rng.uniform(0, 0.3)
                table.expire()
            elif op == "release":
                table.release()
            elif op == "drop":
                table.drop_owner(owner, "lost")
            elif r is not None and op == "open":
                table.open(r.request_id, r.token, owner, r.block_ids[:1], direct=rng.random() < 0.5)
            elif r is not None and op == "write":
                w = table.begin_write(r.request_id, r.token, owner, [(r.block_ids[0], 1)])
                table.end_write(w, 1, 3, 3 if rng.random() < 0.95 else 4)
            elif r is not None and op == "done":
                table.done(r.request_id, r.token, owner, r.writes + rng.choice([0, 0, 1]), r.landed_checksum)
            elif r is not None and op == "cancel":
                table.cancel(r.request_id)
            elif r is not None and op == "abort":
                table.abort(r.request_id, r.token, "x")
        except (TransferError, ValueError):
            pass
        live = [r for r in seen if r.request_id in table]
        held = [b for r in live for b in r.block_ids]
        assert len(held) == len(set(held)) and set(held) == table._held
        assert all(r.state in (State.RESERVED, State.OPEN, State.FAILED) for r in live)
        assert all(r.state in (State.COMPLETE, State.RELEASED) for r in seen if r.request_id not in table)
    clock.now += 100
    table.expire()
    table.release()
    assert len(table) == 0 and not table._held
    assert {r.state for r in seen} == {State.COMPLETE, State.RELEASED} and len(seen) > 100
