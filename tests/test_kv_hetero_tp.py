"""P/D between engines of different tensor_parallel_size (issue #34 item 3).

The KV layout carries the model's KV heads (`total_kv_heads`) beside the split (tensor_parallel_size, heads per
rank): the handshake accepts any split of the same heads, refuses other heads naming the field, and refuses a
split that does not multiply out. Heads are regrouped on the way (kv_transfer/regroup.py): by the sender into the
receiver's pool over shm, by the receiver over tcp (scattered reads) and tcp+int8 (from its dequantized staging),
byte-exact for float and int8 pools, GQA and the replicated case (fewer KV heads than ranks), layer by layer, with
the end-to-end checksum over what landed (the device channels: tests/test_kv_device_regroup.py). Then a real
cluster: a TP = 2 prefill node feeding a TP = 1 decode node, and a TP = 1 prefill node feeding a TP = 2 decode
node of a model with one KV head (each decode rank holds a copy), greedy output identical to the offline engine
and to transformers.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from kv_pool_helpers import BLOCK_SIZE, BLOCKS, HEAD_DIM, LAYERS, model_kv, pool_shape, split

from pdcluster.device import rank_kv_heads
from pdcluster.kv_transfer import (
    ChecksumError,
    KVLayout,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    SharedKVPool,
    TransferError,
)
from pdcluster.kv_transfer.regroup import Regroup
from pdcluster.kv_transfer.testing import corrupt_writes

# (model KV heads, sender TP, receiver TP): GQA splits both ways, and replicated heads on either side
SPLITS = [(4, 2, 1), (4, 1, 2), (4, 4, 2), (2, 1, 4), (1, 2, 1), (2, 4, 1), (1, 2, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def joined(pool: torch.Tensor, total: int) -> list[torch.Tensor]:
    """Every copy of the model KV a pool holds (one per set of ranks holding each head once)."""
    tp = pool.shape[1] // 2
    copies = max(1, tp // total)
    out = []
    for c in range(copies):
        kv = torch.zeros(pool.shape[0], 2, *pool.shape[2:4], total, pool.shape[5], dtype=pool.dtype)
        seen: dict[int, int] = {}
        for r in range(tp):
            for i, h in enumerate(rank_kv_heads(total, r, tp)):
                if seen.get(h, 0) == c:
                    kv[:, :, :, :, h] = pool[:, 2 * r:2 * r + 2, :, :, i]
                seen[h] = seen.get(h, 0) + 1
        out.append(kv)
    return out


@pytest.fixture
def receiver():
    made = []

    def make(total: int, tp: int, dtype: torch.dtype) -> tuple[KVReceiver, torch.Tensor]:
        shm = SharedKVPool.create(pool_shape(total, tp, dtype), dtype)
        rx = KVReceiver(shm.tensor, shm_name=shm.name, total_kv_heads=total)
        made.append((rx, shm))
        return rx, shm.tensor

    yield make
    for rx, shm in made:
        rx.close()
        shm.close()


# ---- the layout and the handshake -------------------------------------------------------------------------


@pytest.mark.parametrize("total, tp", [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (1, 4), (3, 3)])
def test_rank_heads_are_the_heads_the_engine_loads_into_each_rank(total, tp):
    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.tp_shards import local_kv_heads, shard_slice

    config = ModelConfig(architecture="llama", vocab_size=16, hidden_size=8 * HEAD_DIM, intermediate_size=16,
                         num_layers=1, num_heads=8 if tp != 3 else 6, num_kv_heads=total, head_dim=HEAD_DIM,
                         rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_model_len=64,
                         tie_word_embeddings=False, qkv_bias=False)
    from pdcluster.engine.kv_cache import make_pool

    pool, _ = make_pool(config, BLOCK_SIZE, torch.float32, torch.device("cpu"), tp, lambda _: 2)
    layout = KVLayout.of(pool.tensor, pool.model_kv_heads)   # what the nodes hand KVSender / KVReceiver
    assert layout.num_kv_heads == local_kv_heads(config, tp) and layout.total_kv_heads == total
    for r in range(tp):
        part = shard_slice("model.layers.0.self_attn.k_proj.weight", (total * HEAD_DIM, 8), config, r, tp)
        start, size = (0, total * HEAD_DIM) if part is None else part[1:]
        assert layout.rank_heads(r) == range(start // HEAD_DIM, (start + size) // HEAD_DIM)


def test_the_handshake_checks_the_model_heads_not_their_split():
    tp2 = KVLayout.of(torch.zeros(pool_shape(4, 2, torch.float32)), 4)
    tp1 = KVLayout.of(torch.zeros(pool_shape(4, 1, torch.float32)))
    assert (tp2.total_kv_heads, tp2.num_kv_heads, tp1.total_kv_heads) == (4, 2, 4)
    tp2.check_compatible(tp1)
    tp1.check_compatible(tp2)
    assert not tp1.same_planes(tp2)
    assert KVLayout.from_dict(tp2.to_dict()) == tp2
    old_peer = {k: v for k, v in tp2.to_dict().items() if k != "total_kv_heads"}   # before the field: no copies
    assert KVLayout.from_dict(old_peer).total_kv_heads == 4
    other_model = KVLayout.of(torch.zeros(pool_shape(2, 1, torch.float32)))
    with pytest.raises(LayoutMismatchError, match="total_kv_heads: sender 2 vs receiver 4"):
        tp2.check_compatible(other_model)
    replicated = KVLayout.of(torch.zeros(pool_shape(1, 2, torch.float32)), 1)
    assert (replicated.num_kv_heads, replicated.total_kv_heads) == (1, 1)
    with pytest.raises(LayoutMismatchError, match="total_kv_heads: sender 2 vs receiver 1"):   # 2 heads, 1 each
        replicated.check_compatible(KVLayout.of(torch.zeros(pool_shape(2, 2, torch.float32))))


@pytest.mark.parametrize("changes, why", [
    ({"num_kv_heads": 3}, "3 KV heads per rank x tensor_parallel_size 2 does not hold total_kv_heads 4"),
    ({"total_kv_heads": 6}, "does not hold total_kv_heads 6"),
    ({"total_kv_heads": 3, "num_kv_heads": 1, "tensor_parallel_size": 2}, "does not hold total_kv_heads 3"),
    ({"total_kv_heads": 2, "num_kv_heads": 1, "tensor_parallel_size": 3}, "does not hold total_kv_heads 2"),
    ({"total_kv_heads": 0}, "layout.total_kv_heads: expected a positive int"),
    ({"total_kv_heads": -4}, "layout.total_kv_heads: expected a positive int"),
    ({"total_kv_heads": True}, "layout.total_kv_heads: expected a positive int"),
    ({"total_kv_heads": "4"}, "layout.total_kv_heads: expected a positive int"),
    ({"tensor_parallel_size": None}, "layout.tensor_parallel_size: expected a positive int"),
    ({"latent": True}, "a latent pool is 1 x 1 of 1"),
])
def test_a_peer_whose_split_does_not_multiply_out_is_refused(changes, why):
    good = KVLayout.of(torch.zeros(pool_shape(4, 2, torch.float32))).to_dict()
    with pytest.raises(ValueError, match=why):
        KVLayout.from_dict({**good, **changes})
    if changes == {"tensor_parallel_size": None}:   # an older peer (no total_kv_heads, so the product stands for it)
        old = {k: v for k, v in good.items() if k != "total_kv_heads"}
        with pytest.raises(ValueError, match="expected positive ints"):
            KVLayout.from_dict({**old, **changes})


def test_the_receiver_refuses_a_lying_split_at_the_handshake(receiver):
    import socket

    from pdcluster.kv_transfer.handshake import client_handshake
    from pdcluster.kv_transfer.tcp import WIRE_VERSION, Wire

    rx, _ = receiver(4, 1, torch.float32)
    lie = {**KVLayout.of(torch.zeros(pool_shape(4, 2, torch.float32))).to_dict(), "num_kv_heads": 1}
    host, port = rx.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "s", "layout": lie}
        with pytest.raises(LayoutMismatchError, match="does not hold total_kv_heads 4"):
            client_handshake(Wire(s), None, hello, "rx")


# ---- regrouping on the way --------------------------------------------------------------------------------


def test_pieces_map_each_receiver_slot_to_a_sender_rank_holding_its_head():
    lay = {(total, tp): KVLayout.of(torch.zeros(pool_shape(total, tp, torch.float32)), total)
           for total, tp in [(4, 1), (4, 2), (1, 2), (1, 1), (2, 4), (2, 1)]}
    two_to_one = Regroup(lay[4, 2], lay[4, 1])
    assert [(p.dst_rank, p.dst_head, p.src_rank, p.src_head, p.n) for p in two_to_one.pieces] == \
        [(0, 0, 0, 0, 2), (0, 2, 1, 0, 2)]
    assert two_to_one.wire_ranks == [0, 1] and two_to_one.wire_layer_bytes == lay[4, 1].layer_bytes
    copies = Regroup(lay[1, 1], lay[1, 2])   # one KV head, each receiver rank a copy: one read off the wire
    assert [p.copy_of is None for p in copies.pieces] == [True, False]
    from_copies = Regroup(lay[1, 2], lay[1, 1])   # the sender's second rank holds a copy: it stays home
    assert from_copies.wire_ranks == [0] and from_copies.wire_layer_bytes == lay[1, 1].layer_bytes
    assert Regroup(lay[2, 4], lay[2, 1]).wire_ranks == [0, 2]   # ranks 0, 1 hold head 0; ranks 2, 3 head 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("total, src_tp, dst_tp", SPLITS)
def test_heads_regroup_byte_exact_layer_by_layer(receiver, backend, dtype, total, src_tp, dst_tp):
    kv = model_kv(total * 10 + src_tp, total, dtype)
    src = split(kv, src_tp)
    rx, pool = receiver(total, dst_tp, dtype)
    before = pool.clone()
    sender = KVSender(src, backend=backend, total_kv_heads=total)
    try:
        dst = rx.reserve("r", [7, 8, 2, 3])
        t = sender.start(dst, [0, 1, 5, 6])
        for layer in range(LAYERS):   # the layer-wise push
            t.send_layers(layer, layer + 1)
        checksum = t.finish(10)
        res = asyncio.run(rx.wait("r", 10))
    finally:
        sender.close()
    assert res.checksum == checksum and res.nbytes == 4 * LAYERS * KVLayout.of(split(kv, 1)).layer_bytes
    for copy in joined(pool, total):   # every receiver rank's copy of a replicated head too
        assert torch.equal(copy[:, :, [7, 8, 2, 3]], kv[:, :, [0, 1, 5, 6]])
    untouched = [b for b in range(BLOCKS) if b not in (7, 8, 2, 3)]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])


@pytest.mark.slow
def test_parallel_tcp_streams_each_regroup_their_share(receiver):
    kv = model_kv(8, 4, torch.float32)
    rx, pool = receiver(4, 2, torch.float32)
    sender = KVSender(split(kv, 1), backend="tcp", num_streams=3, total_kv_heads=4)
    try:
        sender.send(rx.reserve("p", list(range(BLOCKS))), list(range(BLOCKS))[::-1], timeout=10)
        asyncio.run(rx.wait("p", 10))
    finally:
        sender.close()
    assert torch.equal(joined(pool, 4)[0], kv[:, :, list(range(BLOCKS))[::-1]])


@pytest.mark.slow
@pytest.mark.parametrize("total, src_tp, dst_tp", [(4, 2, 1), (2, 1, 4), (1, 2, 1)])
def test_int8_wire_compression_regroups_on_the_receiver(receiver, total, src_tp, dst_tp):
    kv = model_kv(5, total, torch.bfloat16)
    rx, pool = receiver(total, dst_tp, torch.bfloat16)
    sender = KVSender(split(kv, src_tp), backend="tcp", quant="int8", total_kv_heads=total)
    try:
        assert sender.send(rx.reserve("q", [3, 4]), [9, 10], timeout=10)
        asyncio.run(rx.wait("q", 10))
    finally:
        sender.close()
    want = kv[:, :, [9, 10]].float()
    step = want.abs().amax(dim=(3, 5), keepdim=True) / 127   # one scale per (plane, block, head), as same-TP
    for copy in joined(pool, total):
        got = copy[:, :, [3, 4]].float()
        assert ((got - want).abs() <= step * 0.5 + want.abs() * 2**-7).all()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shm", "tcp", "tcp+int8"])
def test_the_checksum_covers_what_lands_after_regrouping(receiver, backend):
    dtype = torch.float32
    rx, _ = receiver(4, 1, dtype)
    sender = KVSender(split(model_kv(1, 4, dtype), 2), backend=backend.split("+")[0],
                      quant="int8" if "+" in backend else None, total_kv_heads=4)
    try:
        with corrupt_writes(backend), pytest.raises(ChecksumError):   # the connection is made inside
            sender.send(rx.reserve("c", [1, 2]), [3, 4], timeout=10)
        with pytest.raises(TransferError, match="checksum"):
            asyncio.run(rx.wait("c", 10))
    finally:
        sender.close()


@pytest.mark.slow
def test_a_lender_of_another_split_fills_a_fetching_node(receiver):
    """FetchKV between two decode nodes of different TP: the lender's copy is the same sender path."""
    from pdcluster.node.kv_lender import KVLender

    kv = model_kv(3, 4, torch.float32)
    rx, pool = receiver(4, 2, torch.float32)
    sender = KVSender(split(kv, 1), total_kv_heads=4)   # auto: shm on one host
    try:
        checksum, backend = KVLender._send(sender, rx.reserve("f", [0, 1]), [4, 5], 10)
        assert (backend, asyncio.run(rx.wait("f", 10)).checksum) == ("shm", checksum)
    finally:
        sender.close()
    assert torch.equal(joined(pool, 4)[0][:, :, [0, 1]], kv[:, :, [4, 5]])


# ---- a cluster: TP = 2 prefill → TP = 1 decode, and TP = 1 prefill → TP = 2 decode ------------------------


def offline_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The offline engine at TP = 1, greedy, exactly n tokens."""
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine import LLM

    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prefill_and_decode_nodes_of_different_tp_answer_like_tp1_and_transformers(tmp_path):
    from cluster_helpers import client, complete, node_metrics, total, wait_idle
    from engine_helpers import hf_greedy, make_prompts
    from transformers import AutoTokenizer

    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.engine.testing import make_tiny_model

    # GQA, 4 KV heads: 2 per prefill rank, all 4 in the decode node's one rank (moved by shm, the sender regroups)
    gqa = make_tiny_model(str(tmp_path / "tiny-gqa"), "llama", num_attention_heads=8, num_key_value_heads=4,
                          hidden_size=64, intermediate_size=128)
    # 1 KV head: the decode node's 2 ranks each hold a copy (moved by tcp, the receiver regroups and copies)
    mqa = make_tiny_model(str(tmp_path / "tiny-mqa"), "qwen2", num_attention_heads=4, num_key_value_heads=1,
                          hidden_size=64, intermediate_size=128)
    prompts = make_prompts([12, 40, 77], seed=5)
    n = 12
    want = {"tiny-gqa": offline_greedy(gqa, prompts, n), "tiny-mqa": offline_greedy(mqa, prompts, n)}
    assert want["tiny-gqa"][:2] == hf_greedy(gqa, prompts[:2], n)
    assert want["tiny-mqa"][:2] == hf_greedy(mqa, prompts[:2], n)
    tokenizer = AutoTokenizer.from_pretrained(gqa)   # make_tiny_model's tokenizer, the same for both
    node = {"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu", "dtype": "float32"}
    (tmp_path / "cluster").mkdir()
    with LocalCluster(model=gqa, work_dir=tmp_path / "cluster", num_prefill=1, num_decode=0, port=0,
                      cluster=f"hetero-tp-{uuid.uuid4().hex[:6]}", lease_ttl=2, threads_per_node=1,
                      node_config={**node, "tensor_parallel_size": 2},
                      router_config={"models": [mqa], "disagg_min_tokens": 0}) as cluster:
        cluster.start_node("decode", "decode-gqa-tp1", tensor_parallel_size=1)
        cluster.start_node("prefill", "prefill-mqa-tp1", model=mqa, tensor_parallel_size=1, kv_backend="tcp")
        cluster.start_node("decode", "decode-mqa-tp2", model=mqa)
        cluster.wait_ready(2, 2, timeout=240, serving=True)

        async def serve(name: str) -> list[str]:
            api = client(cluster)
            outs = [await complete(api, name, p, n, stream=i % 2 == 0) for i, p in enumerate(prompts)]
            assert all(o.usage == n for o in outs)
            return [o.text for o in outs]

        for name in ("tiny-gqa", "tiny-mqa"):
            texts = [tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                     for ids in want[name]]
            assert asyncio.run(serve(name)) == texts, name
        decode = node_metrics(cluster, "decode")
        for node_id in ("decode-gqa-tp1", "decode-mqa-tp2"):   # every prompt's KV came from the prefill node
            assert decode[node_id].get('pdcluster_node_prefills_total{path="remote"}', 0.0) == len(prompts), node_id
        prefill = node_metrics(cluster, "prefill")
        assert prefill["prefill-0"].get('pdcluster_kv_transfer_bytes_total{backend="shm"}', 0) > 0
        assert prefill["prefill-mqa-tp1"].get('pdcluster_kv_transfer_bytes_total{backend="tcp"}', 0) > 0
        after = wait_idle(cluster)
        assert total(after, "pdcluster_kv_transfer_failures_total") == 0
        assert total(after, 'pdcluster_node_prefills_total{path="local"}') == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("mine, peer_slices, peer_tp", [(1, 0, 2), (2, 0, 1), (2, 2, 2), (2, 4, 4), (4, 2, 2),
                                                        (4, 0, 1)])
@pytest.mark.parametrize("spec, peer_spec", [("", ""), ("ngram", "ngram"), ("ngram", "")])
def test_registration_pairs_any_tp_sizes_and_refuses_only_another_speculative_config(role, device, mine, peer_slices,
                                                                                     peer_tp, spec, peer_spec):
    """Nodes of one model pair whatever their tensor_parallel_size and however their pools are sliced, on CPU and on
    a device (every channel regroups heads: tests/test_kv_device_regroup.py, test_kv_slice_regroup.py); a prefill
    node with a speculative_config its decode peer does not have is the one mismatch refused."""
    from types import SimpleNamespace

    from pdcluster.control.records import Capacity, NodeInfo
    from pdcluster.node.service import NodeService

    other = "decode" if role == "prefill" else "prefill"
    peer = NodeInfo(node_id=f"{other}-0", role=other, model="m", kv_backends=["tcp"], speculative=peer_spec,
                    capacity=Capacity(tensor_parallel_size=peer_tp, kv_rank_slices=peer_slices))
    node = SimpleNamespace(role=role, config=SimpleNamespace(tensor_parallel_size=mine),
                           engine=SimpleNamespace(device=torch.device(device), rank_sliced_pool=mine > 1),
                           speculative=lambda: spec, served_model_name=lambda: "m",
                           view=SimpleNamespace(nodes_by_role=lambda r: [peer]))
    why = NodeService._peer_mismatch(node)
    prefill_spec, decode_spec = (spec, peer_spec) if role == "prefill" else (peer_spec, spec)
    if prefill_spec and prefill_spec != decode_spec:
        assert why.startswith(f"speculative_config {spec or 'none'} differs from {other} node {other}-0's "
                              f"{peer_spec or 'none'}") and why.endswith("refusing to register"), why
    else:
        assert why == "", why
