"""The broadcast ring that hands tensor-parallel ranks their step inputs (engine/shm_ring.py), in one process:
a writer and two readers attached to the same /dev/shm file, doorbells on real pipes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdcluster.engine.attention import AttentionMetadata, PrefillChunk
from pdcluster.engine.shm_ring import BroadcastRing, RingTimeout
from pdcluster.engine.step_inputs import StepInputs, decode, encode


@pytest.fixture
def ring():
    writer = BroadcastRing.create(2, slots=2, slot_bytes=64)
    readers = [BroadcastRing.attach(*writer.attach_args()) for _ in range(2)]
    pipes = [mp.Pipe() for _ in range(2)]
    yield writer, readers, [w for w, _ in pipes], [r for _, r in pipes]
    writer.unlink()
    for r in readers + [writer]:
        r.close()


def test_messages_arrive_in_order_through_slots_inline_and_control(ring):
    writer, readers, doorbells, conns = ring
    writer.write(b"one", doorbells, 1.0)
    writer.send_control(("pool", {"n": 3}), doorbells)
    big = bytes(range(256)) * 4   # over a 64-byte slot: travels in the pipe
    writer.write(big, doorbells, 1.0)
    for i, (reader, conn) in enumerate(zip(readers, conns, strict=True)):
        assert reader.read(i, conn, 1.0) == ("step", b"one")
        assert reader.read(i, conn, 1.0) == ("control", ("pool", {"n": 3}))
        assert reader.read(i, conn, 1.0) == ("step", big)
        assert reader.read(i, conn, 0.01) is None
        reader.mark_done(i)
        assert writer.read_count(i) == writer.done_count(i) == 2


def test_a_slot_is_reused_only_after_every_reader_read_it(ring):
    writer, readers, doorbells, conns = ring
    writer.write(b"a", doorbells, 1.0)
    writer.write(b"b", doorbells, 1.0)
    assert readers[0].read(0, conns[0], 1.0) == ("step", b"a")
    with pytest.raises(RingTimeout, match=r"rank\(s\) \[2\] did not read"):   # reader 1 (rank 2) is behind
        writer.write(b"c", doorbells, 0.2)


def test_step_inputs_survive_the_wire_form():
    meta = AttentionMetadata(slot_mapping=torch.tensor([13, 16, 17], dtype=torch.int32),
                             num_decode_tokens=1, decode_block_tables=torch.tensor([[3, 0]], dtype=torch.int32),
                             decode_context_lens=torch.tensor([2], dtype=torch.int32),
                             prefills=[PrefillChunk(1, 3, 0, torch.tensor([4]))])
    inputs = StepInputs(torch.tensor([7, 8, 9]), torch.tensor([1, 0, 1]), meta, [0, 2])
    back = decode(encode(inputs))
    assert back.sample_rows == [0, 2] and back.meta.num_decode_tokens == 1
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens"):
        a, b = getattr(meta, name), getattr(back.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(back.ids, inputs.ids) and torch.equal(back.positions, inputs.positions)
    (chunk,) = back.meta.prefills
    assert (chunk.start, chunk.end, chunk.num_cached) == (1, 3, 0) and torch.equal(chunk.block_table, torch.tensor([4]))
