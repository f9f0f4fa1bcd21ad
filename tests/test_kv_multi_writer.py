"""A receiving KV pool filled by several sending ranks (issue #34 item 3): prefill sliced per rank over more ranks than
decode (TP 2 -> one whole pool, TP 4 -> TP 2 slices), each sending rank writing the heads it holds straight into the
receiving pool's slots (regroup.py), no extra copy.

The receiver reserves the blocks once for every writer the sending engine has for that pool (`sender_slices`,
regroup.writer_count): each writer (a sender session) claims its own slot, announces and is checked on its own, and
the reservation completes, every writer acknowledged, only once all of them landed; any one failing (a checksum, its
connection or its rank lost, a missing writer past the deadline) fails it for all and hands the blocks back. First
the table alone, then real transfers over tcp and shm: byte-exact against a whole pool of the receiving engine, one
checksum on both sides; a sending rank SIGKILLed mid-transfer failing both sides at once; a writer that never comes
freeing the blocks at the deadline.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import pytest
import torch
from rank_kv_helpers import SlicedEngine, slice_kv

from pdcluster.kv_transfer import KVLayout, KVReceiver, KVSender, SharedKVPool, TransferError
from pdcluster.kv_transfer.errors import ChecksumError
from pdcluster.kv_transfer.per_rank import RankedSender
from pdcluster.kv_transfer.regroup import writer_count
from pdcluster.kv_transfer.reservations import ReservationTable, State

pytestmark = pytest.mark.timeout(240)

L, NB, BS, HD, HEADS = 3, 10, 4, 8, 4   # layers, blocks, block size, head dim; the model's 4 KV heads
SRC, DST = [0, 1, 5, 6], [7, 8, 2, 3]


def _slice(heads: int) -> tuple[int, ...]:
    return (L, 2, NB, BS, heads, HD)


# ---- the reservation table -------------------------------------------------------------------------------------


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write(table: ReservationTable, res, owner: str, block: int, checksum: int, landed: int | None = None) -> None:
    w = table.begin_write(res.request_id, res.token, owner, [(block, 1)])
    table.end_write(w, 10, checksum, checksum if landed is None else landed)


def test_a_reservation_for_two_writers_completes_once_both_landed_and_checks_each_on_its_own():
    table = ReservationTable(8, clock=Clock())
    res = table.reserve("a", [1, 2], 5, writers=2)
    table.open("a", res.token, "s1", [1, 2])
    _write(table, res, "s1", 1, 3)
    table.done("a", res.token, "s1", 1, 3, notify="n1")
    assert res.state is State.OPEN and res.writers["s1"].ready   # the other writer's part is still to come
    with pytest.raises(TransferError, match="this sender's part is complete"):
        _write(table, res, "s1", 2, 4)
    _write(table, res, "s2", 2, 4)   # the second writer claims its slot with its first write
    with pytest.raises(TransferError, match="open to 2 other senders"):
        table.open("a", res.token, "s3", [1])
    assert res.state is State.OPEN and "a" in table
    table.done("a", res.token, "s2", 1, 4, notify="n2")
    assert res.state is State.COMPLETE and "a" not in table
    assert [w.landed_checksum for w in res.writers.values()] == [3, 4]   # each writer's ack: its own writes
    result = res.result()
    assert result.ok and result.checksum == 7 and result.nbytes == 20
    table.reserve("b", [1, 2], 5)   # the blocks are free
    with pytest.raises(ValueError, match="writers"):
        table.reserve("c", [3], 5, writers=0)


@pytest.mark.parametrize("how", ["checksum", "lost", "abort", "deadline"])
def test_one_writer_failing_fails_the_reservation_for_every_writer(how):
    clock, failed = Clock(), []
    table = ReservationTable(8, clock=clock, on_fail=failed.append)
    res = table.reserve("a", [1, 2], 5, writers=2)
    _write(table, res, "s1", 1, 3)
    table.done("a", res.token, "s1", 1, 3, notify="n1")   # s1 is ready and waits for s2
    if how == "checksum":
        table.open("a", res.token, "s2", [2])
        with pytest.raises(ChecksumError):
            _write(table, res, "s2", 2, 4, landed=5)
    elif how == "lost":
        table.open("a", res.token, "s2", [2])
        assert table.drop_owner("s2", "sender connection lost") == [res]
    elif how == "abort":
        table.abort("a", res.token, "tensor-parallel rank 1 is gone")
    else:   # the second writer never came
        clock.now += 6
        assert table.expire() == [res]
    assert res.state is State.FAILED and failed == [res] and res.code == {
        "checksum": "checksum", "lost": "lost", "abort": "aborted", "deadline": "expired"}[how]
    clock.now += 1
    assert table.release() == [res] and "a" not in table and not table._held


def test_only_the_loss_of_one_of_its_writers_fails_it_even_one_whose_part_landed():
    table = ReservationTable(8, clock=Clock())
    res = table.reserve("a", [1], 5, writers=2)
    assert table.drop_owner("s1", "gone") == []   # no part of it yet
    _write(table, res, "s1", 1, 3)
    table.done("a", res.token, "s1", 1, 3)
    assert table.drop_owner("s9", "gone") == [] and res.state is State.OPEN   # not a writer of it
    assert table.drop_owner("s1", "gone") == [res]   # its ack could not reach it any more


def test_the_writers_a_pool_expects_are_the_sending_slices_holding_its_heads():
    whole = KVLayout.of(torch.zeros(_slice(HEADS)))
    half = KVLayout.of(torch.zeros(_slice(2)))
    assert [writer_count(whole, n) for n in (0, 1, 2, 4)] == [1, 1, 2, 4]
    assert [writer_count(half.sliced(r, 2), 4) for r in (0, 1)] == [2, 2]   # TP 4 -> TP 2: two each
    assert writer_count(half.sliced(1, 2), 2) == 1 and writer_count(half.sliced(1, 2), 1) == 1
    one = KVLayout.of(torch.zeros(_slice(1))).sliced(3, 4)
    assert writer_count(one, 2) == 1   # TP 2 -> TP 4: one sending rank holds the slice's head
    latent = KVLayout.of(torch.zeros(L, 1, NB, BS, 1, 40))
    assert writer_count(latent, 4) == writer_count(latent.sliced(0, 2), 4) == 1   # every slice the whole latent


# ---- transfers: sending ranks in processes of their own into one pool --------------------------------------------


def _whole_receiver(stack: ExitStack, shm: bool) -> tuple[KVReceiver, torch.Tensor]:
    seg = SharedKVPool.create(_slice(HEADS), torch.float32) if shm else None
    if seg is not None:
        stack.callback(seg.close)
    pool = seg.tensor if seg is not None else torch.zeros(_slice(HEADS))
    rx = KVReceiver(pool, shm_name=seg.name if seg is not None else None)
    stack.callback(rx.close)
    return rx, pool


def _push(sender: RankedSender, engine: SlicedEngine, dst) -> int:
    """As the prefill node: connect every rank, start on the engine thread, rank 0's layers and every other rank's
    during the step, then finish."""
    sender.connect(dst.to_dict())
    t = sender.start(dst.to_dict(), SRC, connect=False)
    for layer in range(L):
        t.send_layers(layer, layer + 1)
    engine.step()
    return t.finish(timeout=20)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_two_sending_ranks_fill_one_whole_pool_in_one_reservation(backend):
    """Prefill TP 2 sliced -> decode TP 1 (one pool): one reservation, two writers (rank 0 here, rank 1 from its
    process during its step), each writing its heads into the pool's slots; byte-exact, the receiver's checksum the
    one the sender's finish returned, every head once on the wire."""
    shm = backend == "shm"
    with ExitStack() as stack:
        tx = SlicedEngine(stack, _slice(2), 2, seeds=(41, 42), backend="auto" if shm else "tcp")
        rx, pool = _whole_receiver(stack, shm)
        for rid in ("p1", "p2"):   # twice: the connections and the writer slots of the second are new
            dst = rx.reserve(rid, DST, timeout_s=20, sender_slices=2)
            checksum = _push(tx.sender, tx, dst)
            result = asyncio.run(rx.wait(rid, 10))
            assert result.ok and result.checksum == checksum
            assert result.nbytes == len(SRC) * L * 2 * BS * HEADS * HD * 4   # every head once
        assert torch.equal(pool[:, :, DST], tx.model_kv()[:, :, SRC])
        untouched = [b for b in range(NB) if b not in DST]
        assert not pool[:, :, untouched].any()
        assert rx.num_active_reservations == 0
        assert tx.sender.bytes_sent == rx.bytes_received == 2 * len(SRC) * L * 2 * BS * HEADS * HD * 4


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_four_sending_ranks_fill_two_receiving_slices_two_each(backend):
    """Prefill TP 4 -> decode TP 2, both sliced per rank: each receiving slice's reservation (rank 1's in its own
    process) expects the two sending ranks holding its heads; one combined checksum on both sides."""
    shm = backend == "shm"
    with ExitStack() as stack:
        tx = SlicedEngine(stack, _slice(1), 4, seeds=(51, 52, 53, 54), backend="auto" if shm else "tcp")
        rx = SlicedEngine(stack, _slice(2), 2, shm=shm)
        dst = rx.receiver.reserve("q", DST, timeout_s=30, sender_slices=4)
        checksum = _push(tx.sender, tx, dst)
        result = asyncio.run(rx.receiver.wait("q", 15))
        assert result.ok and result.checksum == checksum
        assert result.nbytes == tx.sender.bytes_sent == len(SRC) * L * 2 * BS * HEADS * HD * 4
        kv = tx.model_kv()
        for d, got in enumerate(rx.pools()):
            assert torch.equal(got[:, :, DST], kv[:, :, SRC, :, 2 * d:2 * d + 2]), d
        assert rx.receiver.num_active_reservations == 0


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_sending_rank_killed_mid_transfer_fails_both_sides_at_once_and_nothing_stays_reserved(backend):
    """Rank 1 of the sending engine is SIGKILLed after it opened its part: rank 0's part (waiting for an ack that
    comes only once every writer landed) and the receiver's reservation fail within seconds, not at the deadline;
    the blocks are free again."""
    shm = backend == "shm"
    with ExitStack() as stack:
        tx = SlicedEngine(stack, _slice(2), 2, seeds=(41, 42), backend="auto" if shm else "tcp")
        rx, _ = _whole_receiver(stack, shm)
        dst = rx.reserve("dead", DST, timeout_s=60, sender_slices=2)
        tx.sender.connect(dst.to_dict())
        t = tx.sender.start(dst.to_dict(), SRC, connect=False)
        for layer in range(L):
            t.send_layers(layer, layer + 1)
        time.sleep(0.5)   # rank 1 has its start and opened its part
        tx.procs[0].kill()
        began = time.monotonic()
        with pytest.raises(TransferError) as failed:
            t.finish(timeout=30)
        assert failed.value.code in ("lost", "aborted")
        with pytest.raises(TransferError) as landed:
            asyncio.run(rx.wait("dead", 30))
        assert landed.value.code in ("lost", "aborted")
        assert time.monotonic() - began < 10, "waited for a dead rank"
        assert rx.num_active_reservations == 0
        rx.reserve("again", DST, timeout_s=5)   # the blocks are free
        asyncio.run(rx.settle("again", 5))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_writer_that_never_comes_frees_the_blocks_at_the_deadline(backend):
    """The reservation expects two sending ranks and only one writes: its part lands but is not acknowledged alone;
    at the deadline the reservation fails for it (its finish raises "expired") and the blocks go back."""
    shm = backend == "shm"
    with ExitStack() as stack:
        rx, _ = _whole_receiver(stack, shm)
        only = KVSender(slice_kv(_slice(2), torch.float32, 41), backend="auto" if shm else "tcp", rank_slice=(0, 2))
        stack.callback(only.close)
        dst = rx.reserve("half", DST, timeout_s=1.5, sender_slices=2)
        t = only.start(dst, SRC)
        t.send_all()
        with pytest.raises(TransferError) as failed:
            t.finish(timeout=20)
        assert failed.value.code == "expired"
        with pytest.raises(TransferError) as landed:
            asyncio.run(rx.wait("half", 10))
        assert landed.value.code == "expired"
        assert rx.num_active_reservations == 0
        rx.reserve("again", DST, timeout_s=5)
        asyncio.run(rx.settle("again", 5))
