"""Per-rank KV transfer (issue #34): engines whose KV pool is sliced per tensor-parallel rank (a device, or
`kv_pool_per_rank` on CPU) move each rank's slice over its own channel, into the same rank's slice of the receiving
engine, driven and combined by rank 0 (kv_transfer/per_rank/).

Two ranks per engine, rank 1 in a real process of its own (tests/rank_kv_helpers.py: its slice and its endpoint,
driven as the engine drives a rank), rank 0 here: the layer-wise push (rank 1 sends each layer during its own step)
and the send-at-once path land byte-exact in both ranks' slices with one combined checksum on both sides; a
corrupted write on one rank fails the whole transfer as a checksum error on both sides; a rank that dies fails it
as "lost" at once; nothing stays reserved on any rank. Then the engine knob (token-exact against TP = 1) and a
cluster of a TP = 2 prefill node and a TP = 2 decode node, both sliced per rank.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import ExitStack

import pytest
import torch
from rank_kv_helpers import RankProcess, serve_every_prompt_remotely, slice_kv

from pdcluster.kv_transfer import (
    ChecksumError,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    SharedKVPool,
    TransferError,
)
from pdcluster.kv_transfer.per_rank import RankedReceiver, RankedSender, RankEndpointSpec, RankLinks

pytestmark = pytest.mark.timeout(180)

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 10, 4, 2, 8
SHAPE = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)   # one rank's slice: its K and V planes per layer
SRC, DST = [0, 1, 2, 5], [3, 4, 7, 9]
SEEDS = (11, 12)   # rank 0's and rank 1's slice of the sending engine


class Pair:
    """A sending and a receiving engine of two ranks each, sliced per rank: rank 0's slices here, rank 1's in
    processes of their own."""

    def __init__(self, stack: ExitStack, corrupt: str = "", backend: str = "tcp") -> None:
        """`backend` "shm": the receiving slices live in shared memory (rank 1's endpoint moves its slice there) and
        the senders pick shm (auto) on this one host."""
        shm = backend == "shm"
        self.tx0 = slice_kv(SHAPE, torch.float32, SEEDS[0])
        rx0 = stack.enter_context(_unlinking(SharedKVPool.create(SHAPE, torch.float32))) if shm else None
        self.rx0 = rx0.tensor if rx0 is not None else slice_kv(SHAPE, torch.float32, None)
        self.tx1 = stack.enter_context(_closing(RankProcess(
            RankEndpointSpec(receive=False, backend="auto" if shm else "tcp"), SHAPE, torch.float32, SEEDS[1],
            corrupt=corrupt)))
        self.rx1 = stack.enter_context(_closing(RankProcess(RankEndpointSpec(receive=True, shared_memory=shm), SHAPE,
                                                            torch.float32, None)))
        rx_links = RankLinks([self.rx1.info["link"]])
        stack.callback(rx_links.close)
        local_rx = KVReceiver(self.rx0, shm_name=rx0.name if rx0 is not None else None, rank_slice=(0, 2))
        stack.callback(local_rx.close)
        self.receiver = RankedReceiver(local_rx, rx_links, [self.rx1.info["kv_addr"]])
        tx_links = RankLinks([self.tx1.info["link"]])
        stack.callback(tx_links.close)
        local_tx = KVSender(self.tx0, backend="auto" if shm else "tcp", rank_slice=(0, 2))
        stack.callback(local_tx.close)
        self.sender = RankedSender(local_tx, tx_links, lambda rank, message: self.tx1.tell(message))

    def step(self, transfer) -> None:
        """A prefill step whose layers the transfer streams: rank 0 sends each layer, rank 1 during its step."""
        for layer in range(LAYERS):
            transfer.send_layers(layer, layer + 1)
        assert self.tx1.step(), "rank 1 streamed nothing during the step"

    def landed_exactly(self) -> bool:
        tx1 = slice_kv(SHAPE, torch.float32, SEEDS[1])
        return torch.equal(self.rx0[:, :, DST], self.tx0[:, :, SRC]) \
            and torch.equal(self.rx1.pool()[:, :, DST], tx1[:, :, SRC])

    def reserved(self) -> int:
        return self.receiver.num_active_reservations


class _unlinking:
    def __init__(self, pool: SharedKVPool) -> None:
        self.pool = pool

    def __enter__(self) -> SharedKVPool:
        return self.pool

    def __exit__(self, *exc) -> None:
        self.pool.close()


class _closing:
    def __init__(self, proc: RankProcess) -> None:
        self.proc = proc

    def __enter__(self) -> RankProcess:
        return self.proc

    def __exit__(self, *exc) -> None:
        self.proc.close()


def wait(receiver: RankedReceiver, rid: str, timeout: float = 10.0):
    return asyncio.run(receiver.wait(rid, timeout))


@pytest.mark.parametrize("layerwise, backend", [(True, "tcp"), (False, "tcp"), (True, "shm")])
def test_each_rank_moves_its_slice_into_the_same_rank_with_one_combined_checksum(layerwise, backend):
    with ExitStack() as stack:
        pair = Pair(stack, backend=backend)
        dst = pair.receiver.reserve("r1", DST, timeout_s=20)
        assert [d.layout["rank_slice"] for d in dst.ranks] == [1] and dst.layout["rank_slices"] == 2
        assert dst.ranks[0].address == pair.rx1.info["kv_addr"] != dst.address
        pair.sender.connect(dst.to_dict())   # over the wire as the Prefill message carries it
        if layerwise:   # started on the engine thread before the step that computes the layers
            transfer = pair.sender.start(dst.to_dict(), SRC, connect=False)
            pair.step(transfer)
        else:   # after that step: rank 1 hears start and send_all in order and sends every layer at once
            assert not pair.tx1.step()
            transfer = pair.sender.start(dst.to_dict(), SRC, connect=False)
            transfer.send_all()
        checksum = transfer.finish(timeout=20)
        assert transfer.backend == backend   # rank 0's (rank 1's picks the same: its slice is in shm too)
        result = wait(pair.receiver, "r1")
        assert result.ok and result.checksum == checksum
        assert result.nbytes == 2 * len(SRC) * LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4   # both ranks' slices
        assert pair.landed_exactly()
        assert pair.reserved() == 0
        assert pair.sender.bytes_sent == result.nbytes == pair.receiver.bytes_received


def test_blocks_computed_before_move_from_any_thread_over_the_links():
    """A lender's copy (connect=True, off the engine thread): every rank connects, sends and finishes at once."""
    with ExitStack() as stack:
        pair = Pair(stack)
        dst = pair.receiver.reserve("lend", DST, timeout_s=20)
        checksum = pair.sender.send(dst, SRC, timeout=20)
        assert wait(pair.receiver, "lend").checksum == checksum
        assert pair.landed_exactly() and pair.reserved() == 0


def test_a_corrupted_write_on_one_rank_fails_the_transfer_on_both_sides():
    with ExitStack() as stack:
        pair = Pair(stack, corrupt="tcp")   # rank 1's writes damaged on the way; rank 0's intact
        dst = pair.receiver.reserve("bad", DST, timeout_s=20)
        pair.sender.connect(dst)
        transfer = pair.sender.start(dst, SRC, connect=False)
        pair.step(transfer)
        with pytest.raises(ChecksumError, match="tensor-parallel rank 1"):
            transfer.finish(timeout=20)
        with pytest.raises(ChecksumError, match="tensor-parallel rank 1"):
            wait(pair.receiver, "bad")
        assert asyncio.run(pair.receiver.settle("bad", 10))
        assert pair.reserved() == 0


@pytest.mark.parametrize("dies", ["receiving", "sending"])
def test_a_rank_that_dies_fails_the_transfer_at_once_and_leaks_no_reservation(dies):
    with ExitStack() as stack:
        pair = Pair(stack)
        dst = pair.receiver.reserve("dead", DST, timeout_s=30)
        pair.sender.connect(dst)
        transfer = pair.sender.start(dst, SRC, connect=False)
        (pair.rx1 if dies == "receiving" else pair.tx1).kill()
        start = time.monotonic()
        if dies == "receiving":
            pair.step(transfer)   # rank 1's writes meet a closed socket
        else:
            for layer in range(LAYERS):
                transfer.send_layers(layer, layer + 1)
        with pytest.raises(TransferError) as failed:
            transfer.finish(timeout=20)
        assert failed.value.code in ("lost", "aborted", "cancelled")   # its own part, or rank 0's cancelled for it
        with pytest.raises(TransferError) as landed:
            wait(pair.receiver, "dead")
        assert landed.value.code in ("lost", "aborted")
        assert time.monotonic() - start < 10, "waited for a dead rank"
        assert asyncio.run(pair.receiver.settle("dead", 10))
        assert pair.receiver.local.num_active_reservations == 0
        if dies == "sending":
            assert pair.reserved() == 0   # rank 1's receiver gave its part back too
        with pytest.raises(TransferError, match="rank 1"):   # a new reservation (or connect) fails, holding nothing
            if dies == "receiving":
                pair.receiver.reserve("after", DST, timeout_s=5)
            else:
                pair.sender.connect(pair.receiver.reserve("after", DST, timeout_s=5))
        if dies == "receiving":
            assert pair.receiver.local.num_active_reservations == 0


def test_slices_pair_only_with_the_same_rank_of_an_engine_sliced_the_same_way():
    with ExitStack() as stack:
        pair = Pair(stack)
        dst = pair.receiver.reserve("odd", DST, timeout_s=20)
        whole = KVSender(torch.zeros(SHAPE), backend="tcp")   # a pool holding a whole (one-rank) engine's KV
        stack.callback(whole.close)
        with pytest.raises(LayoutMismatchError, match="total_kv_heads: receiver 4 vs sender 2"):   # another model
            whole.start(dst, SRC)
        with pytest.raises(LayoutMismatchError, match="KV is in 1 rank slice.s., its pool 0 is slice 0 of 2"):
            pair.sender.start({**dst.to_dict(), "ranks": []}, SRC)
        swapped = {**dst.to_dict(), "ranks": [{**dst.ranks[0].to_dict(), "layout": dst.layout}]}
        with pytest.raises(LayoutMismatchError, match="its pool 1 is slice 0 of 2"):   # rank 1's pool named rank 0's
            pair.sender.start(swapped, SRC)
        # a slice aimed at another rank's slice anyway is refused by the handshake (test_kv_slice_regroup.py)
        assert asyncio.run(pair.receiver.settle("odd", 10)) and pair.reserved() == 0


@pytest.mark.slow
def test_a_cpu_engine_sliced_per_rank_generates_exactly_as_tp1(tmp_path, make_engine):
    """`kv_pool_per_rank`: each CPU rank allocates its own slice, as a device rank does; greedy output is TP = 1's
    through chunked prefill, prefix hits and preemption, and the KV budget counts every rank's slice."""
    from engine_helpers import make_prompts, run_all

    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    prefix = make_prompts([64], seed=7)[0]
    prompts = [prefix + p for p in make_prompts([5, 70], seed=8)] + make_prompts([120, 9, 57], seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine_args = dict(dtype="float32", device="cpu", max_num_batched_tokens=48, num_gpu_blocks_override=40,
                       block_size=8, max_num_seqs=6)
    reference = run_all(make_engine(model, **engine_args), prompts, greedy)
    engine = make_engine(model, tensor_parallel_size=2, kv_pool_per_rank=True, **engine_args)
    assert engine.rank_sliced_pool and engine.copies_blocks   # lends and fetches each rank its slice
    assert engine.kv_pool.tensor.shape[1] == 2 and engine.kv_pool.num_kv_heads == 2   # rank 0's slice only
    assert run_all(engine, prompts, greedy) == reference
    stats = engine.get_stats()
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0
    engine.shutdown()   # one tensor-parallel group per process at a time
    sized = make_engine(model, tensor_parallel_size=2, kv_pool_per_rank=True, dtype="float32", device="cpu",
                        block_size=8, num_gpu_blocks_override=None,
                        kv_cache_memory=2 * 40 * 8 * 4 * 2 * 8 * 4)   # 40 blocks of both slices
    assert sized.kv_pool.num_blocks == 40


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_prefill_and_decode_nodes_sliced_per_rank_answer_like_tp1_and_transformers(tmp_path):
    from cluster_helpers import total
    from engine_helpers import hf_greedy, make_prompts
    from transformers import AutoTokenizer

    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine import LLM
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny-gqa"), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    prompts = make_prompts([12, 40, 77], seed=5)
    n = 12
    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    want = [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]
    assert want[:2] == hf_greedy(model, prompts[:2], n)
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) for ids in want]
    node = {"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu", "dtype": "float32",
            "tensor_parallel_size": 2, "kv_pool_per_rank": True}
    (tmp_path / "cluster").mkdir()
    with LocalCluster(model=model, work_dir=tmp_path / "cluster", num_prefill=1, num_decode=1, port=0,
                      cluster=f"per-rank-{uuid.uuid4().hex[:6]}", lease_ttl=2, threads_per_node=1,
                      node_config=node, router_config={"disagg_min_tokens": 0}) as cluster:
        cluster.wait_ready(1, 1, timeout=240, serving=True)

        after = serve_every_prompt_remotely(cluster, prompts, n, texts)
        assert total(after, 'pdcluster_node_prefills_total{path="local"}') == 0
        # (a prefill node whose KV is one pool feeding these: tests/test_cluster_hetero_pools.py)


def test_a_node_record_with_rank_addresses_that_are_not_strings_is_refused():
    """A record read from etcd is anyone's bytes: kv_rank_addrs must be a list of strings, kv_rank_slices >= 0."""
    import json

    from pdcluster.control.records import NodeInfo

    info = NodeInfo(node_id="d0", role="decode", kv_rank_addrs=["tcp://h:7401"])
    body = json.loads(info.to_json())
    assert NodeInfo.from_json(info.to_json()).kv_rank_addrs == ["tcp://h:7401"]
    for bad in ("tcp://h:7401", [1], {"1": "x"}, None):
        with pytest.raises(ValueError, match="kv_rank_addrs must be a list of strings"):
            NodeInfo.from_json(json.dumps({**body, "kv_rank_addrs": bad}))
    with pytest.raises(ValueError, match="non-negative integer"):
        NodeInfo.from_json(json.dumps({**body, "capacity": {**body["capacity"], "kv_rank_slices": -1}}))


def test_an_extended_reservation_outlives_its_first_deadline_in_every_rank_slice():
    """A decode node whose prefill node reports progress extends the reservation: every rank's slice keeps it
    past the first deadline (rank 1's through its link), and the transfer then lands."""
    with ExitStack() as stack:
        pair = Pair(stack)
        dst = pair.receiver.reserve("r1", DST, timeout_s=1.0)
        time.sleep(0.5)
        assert pair.receiver.extend("r1", 3.0)
        time.sleep(1.0)   # past the first deadline: the receivers' reapers ran
        dst.renew(3.0)
        pair.sender.connect(dst.to_dict())
        transfer = pair.sender.start(dst.to_dict(), SRC, connect=False)
        transfer.send_all()
        checksum = transfer.finish(timeout=20)
        result = wait(pair.receiver, "r1")
        assert result.ok and result.checksum == checksum and pair.landed_exactly()
        assert not pair.receiver.extend("gone", 3.0)
