"""MLA and MoE across prefill/decode and tensor parallelism (issue #29 item 3).

The latent KV pool (engine/kv_cache.py: one plane of kv_latent_dim rows per layer, whatever the TP size) through
every channel that moves planes (shm, tcp, tcp+int8, gloo), layer by layer, byte-exact; its layout in the
handshake, so a latent pool paired with a per-head one, or with another latent dim or dtype, is refused naming the
field; a DeepSeek-V3-shaped model at TP = 2 token-exact with TP = 1 (heads split, latent replicated: one copy in
the pool); and a whole 1P1D cluster per architecture: the DeepSeek model with its latent KV moved by shm then by
tcp, and Qwen3-MoE, Qwen3 and Mixtral models, greedy output identical to the offline engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import uuid

import pytest
import torch
from cluster_helpers import client, node_metrics, total, wait_idle
from engine_helpers import hf_greedy, make_prompts, run_all

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.device import CPU_BLOCK_SIZE
from pdcluster.kv_transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    SharedKVPool,
    TransferError,
    quant,
)
from pdcluster.kv_transfer.handshake import client_handshake
from pdcluster.kv_transfer.layout import blocks_of
from pdcluster.kv_transfer.tcp import WIRE_VERSION, Wire

pytestmark = pytest.mark.timeout(300)

LATENT = 30   # the tiny deepseek configs' kv_lora_rank 24 + qk_rope_head_dim 6
LAYERS, BLOCKS, BLOCK_SIZE = 3, 16, 4


def latent_shape(dtype: torch.dtype = torch.float32, latent: int = LATENT) -> tuple[int, ...]:
    """The engine's latent pool shape (KVCachePool(latent=True)): one plane of latent rows per layer."""
    from pdcluster.engine.kv_cache import KVCachePool

    return tuple(KVCachePool(BLOCKS, LAYERS, BLOCK_SIZE, 1, latent, dtype, latent=True).tensor.shape)


def latent_pool(seed: int | None = None, dtype: torch.dtype = torch.float32, latent: int = LATENT) -> torch.Tensor:
    """A latent pool, random rows when `seed` is given (an int8 pool's with their scales), else zeros."""
    from pdcluster.engine.kv_cache import quantize_rows

    shape = latent_shape(dtype, latent)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape[:-1], latent, generator=g)
    return quantize_rows(rows) if dtype == torch.int8 else rows.to(dtype)


def mla_config():
    """A DeepSeek-shaped ModelConfig (only what the pool and the shard plan read)."""
    from pdcluster.engine.config import ModelConfig

    return ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=LAYERS, num_heads=4, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=10000.0, rope_scaling=None, max_model_len=128, tie_word_embeddings=False,
                       qkv_bias=False, kv_latent_dim=LATENT)


# ---- the layout ----------------------------------------------------------------------------------------------


def test_latent_layout_has_one_plane_per_layer_whatever_the_tensor_parallel_size():
    from pdcluster.engine.kv_cache import KVCachePool, make_pool

    layout = KVLayout.of(latent_pool(0))
    assert (layout.latent, layout.kv_planes, layout.num_kv_heads, layout.head_dim) == (True, 1, 1, LATENT)
    assert layout.tensor_parallel_size == 1 and layout.shape == tuple(latent_pool().shape)
    assert layout.layer_bytes == BLOCK_SIZE * LATENT * 4 and list(layout.planes(1, 3)) == [1, 2]
    assert KVLayout.from_dict(layout.to_dict()) == layout
    int8 = KVLayout.of(latent_pool(0, torch.int8))
    assert (int8.latent, int8.head_dim, int8.scale_bytes, int8.row) == (True, LATENT, 2, LATENT + 2)
    # the engine's own pools: an MLA config at TP = 1 and 2 (shared CPU pool) has the same one-plane layout
    config = mla_config()
    for tp in (1, 2):
        pool, _ = make_pool(config, BLOCK_SIZE, torch.bfloat16, torch.device("cpu"), tp, lambda _: BLOCKS)
        assert isinstance(pool, KVCachePool) and pool.latent
        assert KVLayout.of(pool.tensor) == KVLayout.of(latent_pool(None, torch.bfloat16))
    # an older peer's layout (no `latent`) is a per-head pool
    per_head = KVLayout.of(torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, 2, 16))
    old = {k: v for k, v in per_head.to_dict().items() if k != "latent"}
    assert KVLayout.from_dict(old) == per_head and not per_head.latent
    with pytest.raises(ValueError, match="layout.latent"):
        KVLayout.from_dict({**layout.to_dict(), "latent": 1})
    with pytest.raises(ValueError, match="a latent pool's"):   # one plane per layer holds one latent row per token
        KVLayout.of(torch.zeros(LAYERS, 1, BLOCKS, BLOCK_SIZE, 2, LATENT))


def test_mismatched_layouts_are_refused_naming_the_field():
    latent = KVLayout.of(latent_pool(0))
    per_head = KVLayout.of(torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, 1, LATENT))
    with pytest.raises(LayoutMismatchError, match="latent: sender False vs receiver True"):
        latent.check_compatible(per_head)
    with pytest.raises(LayoutMismatchError, match="kv_latent_dim: sender 40 vs receiver 30"):
        latent.check_compatible(KVLayout.of(latent_pool(0, latent=40)))
    with pytest.raises(LayoutMismatchError, match="dtype: sender 'bfloat16' vs receiver 'float32'"):
        latent.check_compatible(KVLayout.of(latent_pool(0, torch.bfloat16)))
    with pytest.raises(LayoutMismatchError, match=r"dtype: sender 'int8' vs receiver 'float32'; scale_bytes"):
        latent.check_compatible(KVLayout.of(latent_pool(0, torch.int8)))
    latent.check_compatible(KVLayout.of(latent_pool(1)))   # the same layout: nothing to say


# ---- every channel moves latent pools --------------------------------------------------------------------------


@pytest.fixture
def latent_receiver():
    made = []

    def make(dtype: torch.dtype = torch.float32, latent: int = LATENT):
        shm = SharedKVPool.create(latent_shape(dtype, latent), dtype)   # a decode node's pool
        rx = KVReceiver(shm.tensor, host="127.0.0.1", shm_name=shm.name)
        made.append((rx, shm))
        return rx, shm.tensor

    yield make
    for rx, shm in made:
        rx.close()
        shm.close()


def send(src: torch.Tensor, dst: dict, src_ids: list[int], backend: str, layers, quant_: str | None = None) -> int:
    sender = KVSender(src, backend=backend, quant=quant_)
    try:
        t = sender.start(dst, src_ids)
        for l0, l1 in layers:
            t.send_layers(l0, l1)
        return t.finish(timeout=20)
    finally:
        sender.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("backend", ["shm", "tcp", "gloo"])
def test_latent_blocks_travel_byte_exact_layer_by_layer(latent_receiver, backend, dtype):
    rx, pool = latent_receiver(dtype)
    src = latent_pool(3, dtype)
    dst_ids, src_ids = [9, 2, 3, 4, 15], [0, 5, 6, 7, 1]
    dst = rx.reserve("r", dst_ids)
    checksum = send(src, dst.to_dict(), src_ids, backend, [(0, 1), (1, 2), (2, 3)])   # one plane per layer
    result = asyncio.run(rx.wait("r", 10))
    assert result.ok and result.checksum == checksum
    assert result.nbytes == len(dst_ids) * KVLayout.of(src).block_bytes
    assert torch.equal(blocks_of(pool, dst_ids).view(torch.uint8), blocks_of(src, src_ids).view(torch.uint8))
    assert not blocks_of(pool, [b for b in range(BLOCKS) if b not in dst_ids]).view(torch.uint8).any()
    assert rx.num_active_reservations == 0


def test_a_layer_range_of_a_latent_pool_touches_only_those_planes(latent_receiver):
    rx, pool = latent_receiver()
    src = latent_pool(4)
    dst = rx.reserve("r", [1, 2])
    send(src, dst.to_dict(), [7, 8], "tcp", [(1, 2)])
    assert asyncio.run(rx.wait("r", 10)).ok
    assert torch.equal(pool[1, 0, 1:3], src[1, 0, 7:9])
    assert not pool[0].any() and not pool[2].any()


def test_int8_wire_compression_of_a_latent_pool(latent_receiver):
    rx, pool = latent_receiver(torch.bfloat16)
    src = latent_pool(5, torch.bfloat16)
    dst = rx.reserve("q", [0, 1, 2])
    send(src, dst.to_dict(), [3, 4, 5], "tcp", [(0, 2), (2, 3)], quant_="int8")
    result = asyncio.run(rx.wait("q", 10))
    layout = KVLayout.of(pool)
    assert result.nbytes == quant.wire_bytes(3, LAYERS, BLOCK_SIZE, 1, LATENT, kv_planes=1)
    assert result.nbytes < 3 * layout.block_bytes * 0.6
    got, want = blocks_of(pool, [0, 1, 2]).float(), blocks_of(src, [3, 4, 5]).float()
    step = want.abs().amax(dim=(3, 5), keepdim=True) / 127   # one scale per (block, layer): block_size x row
    assert not torch.equal(got, want) and ((got - want).abs() <= step * 0.5 + want.abs() * 2**-7).all()


def test_a_mismatched_pair_is_refused_by_sender_and_receiver(latent_receiver):
    rx, pool = latent_receiver()
    dst = rx.reserve("m", [1]).to_dict()
    per_head = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, 1, LATENT)
    with pytest.raises(LayoutMismatchError, match="latent: receiver True vs sender False"):
        send(per_head, dst, [0], "tcp", [(0, LAYERS)])
    with pytest.raises(LayoutMismatchError, match="kv_latent_dim: receiver 30 vs sender 40"):
        send(latent_pool(0, latent=40), dst, [0], "shm", [(0, LAYERS)])
    # a sender that skipped its check (a stale or forged destination): the receiver's handshake refuses it
    host, port = rx.address.rsplit(":", 1)
    theirs = KVLayout.of(per_head).to_dict()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "s", "layout": theirs}
        with pytest.raises(LayoutMismatchError, match="latent: sender False vs receiver True"):
            client_handshake(Wire(s), None, hello, "rx")
    rx.cancel("m")
    with pytest.raises(TransferError, match="cancelled"):
        asyncio.run(rx.wait("m", 5))
    assert not pool.any() and rx.num_active_reservations == 0


# ---- tensor parallelism of MLA weights ---------------------------------------------------------------------


def test_mla_weights_split_by_heads_and_latent_projections_replicated():
    from pdcluster.engine.tp_shards import check_divisible, shard_slice, split_dim

    config = mla_config()
    attn = "model.layers.0.self_attn."
    assert split_dim(attn + "q_b_proj.weight") == split_dim(attn + "kv_b_proj.weight") == 0   # by heads
    assert split_dim(attn + "q_proj.weight") == 0 and split_dim(attn + "o_proj.weight") == 1
    for name in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight"):
        assert split_dim(attn + name) is None
    assert shard_slice(attn + "kv_b_proj.weight", (4 * 22, 24), config, 1, 2) == (0, 44, 44)   # heads 2 and 3
    check_divisible(config, 4)   # 4 KV heads would allow 4; a latent model's num_key_value_heads never matters
    check_divisible(dataclasses.replace(config, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="does not divide num_attention_heads 4"):
        check_divisible(config, 3)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TP_ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=48, num_gpu_blocks_override=40,
                 block_size=8, max_num_seqs=4)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("mla") / "tiny-deepseek"), "deepseek_v3")


@pytest.mark.slow
def test_deepseek_at_tp2_equals_tp1(deepseek_dir, make_engine):
    from pdcluster.engine.testing import prefill_logits

    prefix = make_prompts([40], seed=3)[0]
    prompts = [prefix + p for p in make_prompts([5, 60], seed=4)] + make_prompts([90, 9], seed=5)
    ref = make_engine(deepseek_dir, **TP_ENGINE)
    ref_logits = prefill_logits(ref, prompts[2], list(range(15)))
    # the first prompt alone, then the rest (chunked over 48-token steps): the second hits the cached prefix
    ref_out = run_all(ref, prompts[:1], GREEDY) + run_all(ref, prompts[1:], GREEDY, prefix="s")
    engine = make_engine(deepseek_dir, tensor_parallel_size=2, **TP_ENGINE)
    assert engine.kv_pool.tensor.shape[1] == 1   # one latent copy, shared by both ranks
    assert (prefill_logits(engine, prompts[2], list(range(15))) - ref_logits).abs().max().item() < 1e-4
    assert run_all(engine, prompts[:1], GREEDY) + run_all(engine, prompts[1:], GREEDY, prefix="s") == ref_out
    assert engine.get_stats().prefix_cache_hit_tokens >= 40


# ---- whole 1P1D clusters -----------------------------------------------------------------------------------

CLUSTER_PROMPTS = ["Hello world! How are you today?", "The quick brown fox",
                   "A paged KV cache stores keys and values in fixed-size blocks. Prefill is compute bound",
                   "decode is memory bound, so a disaggregated cluster runs them on different nodes."]


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def per_head_dirs(tmp_path_factory) -> dict[str, str]:
    """The other new architectures, each served by its own prefill/decode pair: {model name: directory}."""
    from pdcluster.engine.testing import make_tiny_model

    root = tmp_path_factory.mktemp("per-head")
    return {f"tiny-{arch}": make_tiny_model(str(root / f"tiny-{arch}"), arch) for arch in ("qwen3", "mixtral")}


def offline_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdcluster.engine import LLM

    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]


async def serve_all(cluster, model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    async with client(cluster) as api:
        outs = await asyncio.gather(*(api.completions.create(model=model, prompt=p, max_tokens=max_tokens,
                                                             temperature=0) for p in prompts))
    return [o.choices[0].text for o in outs]


def remote_prefills(cluster, decode_node: str) -> float:
    return node_metrics(cluster, "decode")[decode_node].get('pdcluster_node_prefills_total{path="remote"}', 0.0)


@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_every_new_architecture_through_1p1d_deepseek_latent_kv_by_shm_and_tcp(deepseek_dir, qwen3_moe_dir,
                                                                                per_head_dirs, tmp_path):
    from transformers import AutoTokenizer

    from pdcluster.cli.supervisor import LocalCluster

    tokenizer = AutoTokenizer.from_pretrained(deepseek_dir)   # both tiny models share make_tiny_model's tokenizer
    prompts = [tokenizer.encode(t) for t in CLUSTER_PROMPTS]
    again = [p[::-1] for p in prompts]   # for the tcp round: no prefix the decode node has cached
    n = 12
    want = {"tiny-deepseek": offline_greedy(deepseek_dir, prompts + again, n),
            "tiny-qwen3-moe": offline_greedy(qwen3_moe_dir, prompts, n),
            **{name: offline_greedy(path, prompts, n) for name, path in per_head_dirs.items()}}
    assert want["tiny-deepseek"][:2] == hf_greedy(deepseek_dir, prompts[:2], n)   # transformers' output too
    texts = {name: [tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                    for ids in outs] for name, outs in want.items()}
    # whole blocks (the CPU's default size); per token one latent plane per layer: 2 layers x 30 values x fp32,
    # against the per-head pool's 2 layers x (K, V) x 2 KV heads x 24
    bs = CPU_BLOCK_SIZE
    latent_bytes = [sum(-(-len(p) // bs) for p in ps) * bs * 2 * LATENT * 4 for ps in (prompts, again)]
    per_head_bytes = sum(-(-len(p) // bs) for p in prompts) * bs * 2 * 2 * 2 * 24 * 4
    node = {"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu", "dtype": "float32"}
    (tmp_path / "cluster").mkdir()
    with LocalCluster(model=deepseek_dir, work_dir=tmp_path / "cluster", num_prefill=1, num_decode=1, port=0,
                      cluster=f"mla-{uuid.uuid4().hex[:6]}", lease_ttl=2, threads_per_node=1,
                      node_config={**node, "kv_backend": "shm"},
                      router_config={"models": [qwen3_moe_dir, *per_head_dirs.values()], "disagg_min_tokens": 0}
                      ) as cluster:
        cluster.start_node("prefill", "prefill-moe", model=qwen3_moe_dir)
        cluster.start_node("decode", "decode-moe", model=qwen3_moe_dir)
        for name, path in per_head_dirs.items():
            cluster.start_node("prefill", f"prefill-{name}", model=path)
            cluster.start_node("decode", f"decode-{name}", model=path)
        cluster.wait_ready(4, 4, timeout=180, serving=True)

        # DeepSeek, latent KV by shm: every request prefilled remotely, output as offline
        assert asyncio.run(serve_all(cluster, "tiny-deepseek", prompts, n)) == texts["tiny-deepseek"][:4]
        assert remote_prefills(cluster, "decode-0") == len(prompts)
        shm = node_metrics(cluster, "prefill")["prefill-0"]
        assert shm['pdcluster_kv_transfer_bytes_total{backend="shm"}'] == latent_bytes[0]

        # Qwen3-MoE (per-head K/V) through its own pair
        assert asyncio.run(serve_all(cluster, "tiny-qwen3-moe", prompts, n)) == texts["tiny-qwen3-moe"]
        assert remote_prefills(cluster, "decode-moe") == len(prompts)
        moe = node_metrics(cluster, "prefill")["prefill-moe"]
        assert moe['pdcluster_kv_transfer_bytes_total{backend="shm"}'] == per_head_bytes

        # Qwen3 (q/k norms) and Mixtral (top-2 experts), each through its pair
        for name in per_head_dirs:
            assert asyncio.run(serve_all(cluster, name, prompts, n)) == texts[name], name
            assert remote_prefills(cluster, f"decode-{name}") == len(prompts)

        # DeepSeek again with the latent KV by tcp: a tcp prefill node replaces the shm one
        cluster.start_node("prefill", "prefill-tcp", kv_backend="tcp")
        cluster.wait_ready(5, 4, timeout=120)
        old = next(s for s in cluster.services if s.node_id == "prefill-0")
        old.proc.send_signal(signal.SIGTERM)
        assert old.proc.wait(30) == 0
        cluster.services.remove(old)
        cluster.wait_ready(0, 0, timeout=30, nodes={"prefill-tcp", "prefill-moe", "decode-0", "decode-moe",
                                                     *(f"{role}-{name}" for name in per_head_dirs
                                                       for role in ("prefill", "decode"))})
        assert asyncio.run(serve_all(cluster, "tiny-deepseek", again, n)) == texts["tiny-deepseek"][4:]
        assert remote_prefills(cluster, "decode-0") == 2 * len(prompts)
        tcp = node_metrics(cluster, "prefill")["prefill-tcp"]
        assert tcp['pdcluster_kv_transfer_bytes_total{backend="tcp"}'] == latent_bytes[1]
        after = wait_idle(cluster)
        assert total(after, "pdcluster_kv_transfer_failures_total") == 0
        assert total(after, 'pdcluster_node_prefills_total{path="local"}') == 0
