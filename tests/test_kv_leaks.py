"""Issue #35: a node runs for weeks, so nothing the KV sender or receiver keeps per peer, transfer or result may
stay after its owner is gone. Sender and receiver share this process (real sockets, one small pool)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from pdcluster.kv_transfer import KVReceiver, KVSender, SharedKVPool, TransferError
from pdcluster.kv_transfer import receiver as receiver_module
from pdcluster.kv_transfer.sender import TransferState

SHAPE = (2, 2, 16, 4, 1, 8)  # layers, k/v, blocks, block_size, kv heads, head_dim


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def receivers():
    made: list[tuple[KVReceiver, SharedKVPool]] = []

    def make() -> KVReceiver:
        shm = SharedKVPool.create(SHAPE, torch.float32)
        rx = KVReceiver(shm.tensor, shm_name=shm.name)
        made.append((rx, shm))
        return rx

    yield make
    for rx, shm in made:
        rx.close()
        shm.close()


@pytest.fixture
def sender():
    tx = KVSender(torch.randn(SHAPE), backend="shm")
    yield tx
    tx.close()


def test_a_broken_connection_drops_the_peer_and_unmaps_the_receivers_pool(sender, receivers):
    rx = receivers()
    assert sender.send(rx.reserve("a", [1, 2]), [3, 4]) != 0
    (peer,) = sender._peers.values()
    remote = weakref.ref(peer.streams[0].channel.remote)
    rx.close()   # the decode node is gone: its end of the connection closes
    assert wait_until(lambda: not sender._peers), "a dead peer stays in the sender's table"
    assert not sender._gates
    gc.collect()   # `peer` is still referenced (as a caller's old Transfer would hold it): its channel let go
    assert peer.dead is not None and remote() is None, "the dead receiver's shared pool is still mapped"


def test_forget_peer_closes_and_forgets_only_that_receiver(sender, receivers):
    old, new = receivers(), receivers()
    for i, rx in enumerate((old, new)):
        sender.send(rx.reserve(f"r{i}", [i]), [i])
    assert {a for a, _ in sender._peers} == {old.address, new.address}
    (old_peer,) = [p for (a, _), p in sender._peers.items() if a == old.address]
    t = sender.start(old.reserve("late", [5]), [5])   # still in flight when the node leaves
    sender.forget_peer(old.address)
    assert {a for a, _ in sender._peers} == {new.address}
    assert wait_until(lambda: t.failed) and t.error.code == "lost"
    assert wait_until(lambda: old_peer.dead is not None) and not old_peer.transfers
    sender.keep_peers([old.address])   # the view without `new`
    assert not sender._peers
    assert sender.send(new.reserve("again", [7]), [7]) != 0   # a forgotten receiver is connected again


def test_an_aborted_transfer_leaves_its_peers_table(sender, receivers):
    rx = receivers()
    t = sender.start(rx.reserve("a", [1]), [1])
    (peer,) = sender._peers.values()
    assert peer.transfers == {t.xid: t}
    t.abort("prefill failed")
    assert t.state is TransferState.FAILED and peer.transfers == {}


def test_results_nobody_waits_for_are_dropped_after_their_ttl(sender, receivers, monkeypatch):
    now = [1000.0]   # the receiver's monotonic clock, moved by hand
    monkeypatch.setattr(receiver_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    rx = receivers()
    sender.send(rx.reserve("gone", [1]), [1])   # its owner never waits
    sender.send(rx.reserve("kept", [2]), [2])
    now[0] += receiver_module.RESULT_TTL_S - 1
    time.sleep(0.2)   # a few reaper passes
    assert set(rx._results) == {"gone", "kept"}
    assert asyncio.run(rx.wait("kept", 1)).ok   # a result taken in time is handed over as before
    now[0] += 2
    assert wait_until(lambda: not rx._results), "an unclaimed result stays forever"
    with pytest.raises(TransferError) as exc:
        asyncio.run(rx.wait("gone", 1))
    assert exc.value.code == "missing"


def test_a_receiver_never_reached_leaves_no_gate(sender, receivers):
    rx = receivers()
    dst = rx.reserve("a", [1])
    rx.close()   # nobody listens at its address any more
    with pytest.raises(TransferError) as exc:
        sender.connect(dst)
    assert exc.value.code == "unreachable" and not sender._gates and not sender._peers
