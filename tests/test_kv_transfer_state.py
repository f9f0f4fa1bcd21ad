"""The sender's Transfer as a state machine: every transition and every refused move, with fake streams (no
sockets, no threads but the one a blocking `finish` needs). The wire round trip of error codes is in
tests/test_kv_error_codes.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import ChecksumError, TransferError
from pdcluster.kv_transfer.sender import _NEXT, ByteCount, Transfer, TransferState

S = TransferState


class FakeStream:
    """Records what a Transfer queues instead of running it."""

    def __init__(self) -> None:
        self.ops: list[tuple[object, bool]] = []

    def submit(self, transfer: Transfer, fn, even_if_failed: bool = False) -> None:
        self.ops.append((fn, even_if_failed))


class FakePeer:
    channel_cls = SimpleNamespace(name="tcp")

    def __init__(self, streams: int = 1) -> None:
        self.streams = [FakeStream() for _ in range(streams)]
        self.forgotten: list[Transfer] = []

    def forget(self, t: Transfer) -> None:
        self.forgotten.append(t)


def make(streams: int = 1, blocks: int = 4) -> tuple[Transfer, FakePeer, ByteCount]:
    dst = Destination(request_id="r", address="127.0.0.1:1", block_ids=list(range(blocks)), token="t" * 32,
                      deadline=time.time() + 30, backends=["tcp"], layout={})
    peer, delivered = FakePeer(streams), ByteCount()
    t = Transfer(peer, dst, list(range(10, 10 + blocks)), dst.block_ids, num_layers=2, delivered=delivered)
    return t, peer, delivered


def finish_in_thread(t: Transfer, timeout: float = 5.0) -> tuple[threading.Thread, list]:
    box: list = []

    def run() -> None:
        try:
            box.append(t.finish(timeout))
        except Exception as exc:
            box.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + 5
    while t.state is S.SENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return th, box


# ---- the table -------------------------------------------------------------------------------------------


def test_the_transition_table_covers_every_state_and_terminal_states_have_no_exit():
    assert set(_NEXT) == set(S)
    assert _NEXT[S.COMPLETE] == set() and _NEXT[S.FAILED] == set()
    assert all(S.FAILED in _NEXT[s] for s in (S.SENDING, S.FINISHING, S.AWAITING_ACK))


@pytest.mark.parametrize("state, target", [(a, b) for a in S for b in S if b not in _NEXT[a]])
def test_every_move_outside_the_table_is_refused(state, target):
    t, _, _ = make()
    t._state = state   # set up the state directly: what is under test is the refusal
    with pytest.raises(RuntimeError, match="is not a transition"):
        t._move(target)
    assert t.state is state


# ---- the happy paths ---------------------------------------------------------------------------------------


def test_a_new_transfer_is_sending_and_queues_one_write_per_stream():
    t, peer, _ = make(streams=2)
    assert t.state is S.SENDING and not t.failed and t.error is None and t.checksum is None
    t.send_layers(0, 1)
    t.send_all()
    assert [len(s.ops) for s in peer.streams] == [2, 2] and t.state is S.SENDING
    assert t.write_header(5, 100) is None and t.state is S.SENDING  # a write out, finish() not called yet


def test_the_last_write_after_finish_carries_the_done_then_the_ack_completes():
    t, peer, delivered = make()
    t.send_all()
    assert t.write_header(3, 64) is None  # not yet finishing
    t.send_layers(1, 2)
    th, box = finish_in_thread(t)
    assert t.state is S.FINISHING
    fn, even_if_failed = peer.streams[0].ops[-1]   # the done op, queued behind the writes
    assert not even_if_failed
    done = t.write_header(4, 32)  # the last unsent write
    assert done == {"writes": 2, "checksum": 7} and t.state is S.AWAITING_ACK   # 3 + 4: combine() adds
    assert t.take_done(1.0) is None   # the done op then sends nothing more
    t.acked(7)
    th.join(5)
    assert t.state is S.COMPLETE and box == [7] and t.checksum == 7 and peer.forgotten == [t]
    assert delivered.total == 96   # acknowledged bytes count once, on the ack


def test_the_done_goes_in_its_own_frame_when_every_write_was_out_before_finish():
    t, _, delivered = make()
    t.send_all()
    t.write_header(9, 10)
    th, box = finish_in_thread(t)
    assert t.take_done(1.0) == {"writes": 1, "checksum": 9} and t.state is S.AWAITING_ACK
    t.acked(9)
    th.join(5)
    assert box == [9] and t.state is S.COMPLETE and delivered.total == 10


def test_finish_with_no_writes_announces_zero_writes():
    t, _, _ = make()
    th, box = finish_in_thread(t)
    assert t.take_done(1.0) == {"writes": 0, "checksum": 0}
    t.acked(0)
    th.join(5)
    assert box == [0]


def test_take_done_waits_for_a_write_still_going_out():
    t, _, _ = make()
    t.send_all()
    finish_in_thread(t)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(t.take_done(5.0)), daemon=True)
    waiter.start()
    time.sleep(0.05)
    assert got == [] and t.state is S.FINISHING
    assert t.write_header(2, 8) == {"writes": 1, "checksum": 2}   # this write carries it ...
    waiter.join(5)
    assert got == [None]   # ... so the done op has nothing to send
    t.acked(2)


# ---- failures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [S.SENDING, S.FINISHING, S.AWAITING_ACK])
def test_fail_from_every_live_state_and_the_first_outcome_wins(at):
    t, _, _ = make()
    t.send_all()
    if at is not S.SENDING:
        finish_in_thread(t, timeout=5)
    if at is S.AWAITING_ACK:
        t.write_header(1, 1)
    assert t.state is at
    first = TransferError("receiver said no", "refused")
    t.fail(first)
    t.fail(TransferError("later", "lost"))
    t.acked(1)   # a late ack changes nothing either
    assert t.state is S.FAILED and t.failed and t.error is first and t.error.code == "refused"
    with pytest.raises(TransferError, match="receiver said no"):
        t.finish(1)


def test_an_ack_with_another_checksum_fails_with_checksum_error_and_counts_no_bytes():
    t, _, delivered = make()
    t.send_all()
    th, box = finish_in_thread(t)
    t.write_header(5, 50)
    t.acked(6)
    th.join(5)
    assert t.state is S.FAILED and isinstance(t.error, ChecksumError) and t.error.code == "checksum"
    assert isinstance(box[0], ChecksumError) and delivered.total == 0


def test_finish_times_out_fails_and_tells_the_receiver():
    t, peer, _ = make()
    t.send_all()
    with pytest.raises(TransferError, match="no acknowledgement within 0.05 s") as exc:
        t.finish(0.05)
    assert exc.value.code == "timeout" and t.state is S.FAILED and peer.forgotten == [t]
    _, even_if_failed = peer.streams[0].ops[-1]   # the abort frame goes out although the transfer failed
    assert even_if_failed


def test_take_done_times_out_when_writes_never_go_out():
    t, _, _ = make()
    t.send_all()
    finish_in_thread(t, timeout=5)
    with pytest.raises(TransferError, match="writes not sent within 0.05 s") as exc:
        t.take_done(0.05)
    assert exc.value.code == "timeout"
    t.fail(exc.value)   # what the stream's worker does with it
    assert t.state is S.FAILED


def test_take_done_after_a_failure_sends_nothing():
    t, _, _ = make()
    t.send_all()
    finish_in_thread(t, timeout=5)
    t.fail(TransferError("gone", "lost"))
    assert t.take_done(1.0) is None and t.state is S.FAILED


def test_abort_fails_a_live_transfer_and_queues_the_abort_frame():
    t, peer, _ = make()
    t.abort("prefill failed")
    assert t.state is S.FAILED and t.error.code == "aborted" and "prefill failed" in str(t.error)
    assert peer.streams[0].ops[-1][1]   # even_if_failed


def test_abort_and_fail_take_the_transfer_out_of_its_peers_table_without_finish():
    t, peer, _ = make()
    t.abort("engine failed")   # the caller never calls finish
    assert peer.forgotten == [t]
    t2, peer2, _ = make()
    t2.fail(TransferError("gone", "lost"))
    assert peer2.forgotten == [t2]


def completed() -> tuple[Transfer, FakePeer]:
    """A transfer of no writes, finished and acknowledged."""
    t, peer, _ = make()
    th, _ = finish_in_thread(t)
    t.take_done(1.0)
    t.acked(0)
    th.join(5)
    assert t.state is S.COMPLETE
    return t, peer


def test_abort_after_the_ack_changes_nothing_and_sends_nothing():
    t, peer = completed()
    ops = len(peer.streams[0].ops)
    t.abort("late")
    t.fail(TransferError("late", "lost"))
    assert t.state is S.COMPLETE and t.error is None and len(peer.streams[0].ops) == ops


# ---- refused moves -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [S.SENDING, S.FINISHING])
def test_an_ack_before_the_done_went_out_is_refused(at):
    t, _, _ = make()
    t.send_all()
    if at is S.FINISHING:
        finish_in_thread(t, timeout=5)
    with pytest.raises(RuntimeError, match=f"an ack in state {at.value}"):
        t.acked(0)
    assert t.state is at
    t.fail(TransferError("done with it"))


def test_a_second_ack_is_refused():
    t, _ = completed()
    with pytest.raises(RuntimeError, match="an ack in state complete"):
        t.acked(0)
    assert t.state is S.COMPLETE


def test_send_after_finish_is_refused_and_send_after_failure_is_ignored():
    t, peer, _ = make()
    finish_in_thread(t, timeout=5)
    with pytest.raises(TransferError, match="send after finish"):
        t.send_layers(0, 1)
    t.fail(TransferError("x", "lost"))
    ops = len(peer.streams[0].ops)
    t.send_layers(0, 1)   # the engine thread keeps calling layer by layer: nothing happens
    assert len(peer.streams[0].ops) == ops


def test_send_layers_checks_the_layer_range():
    t, _, _ = make()
    for l0, l1 in [(-1, 1), (1, 1), (0, 3), (2, 1)]:
        with pytest.raises(ValueError, match="layers"):
            t.send_layers(l0, l1)
    assert t.state is S.SENDING
