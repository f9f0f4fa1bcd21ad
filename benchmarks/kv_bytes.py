"""KV bytes per token of each architecture, and what moving an 8k-token prompt's KV costs on this box.

    .venv/bin/python benchmarks/kv_bytes.py [--json] [--tokens 8192] [--backends shm,tcp] [--reps 3] [--no-transfer]

Bytes per token come from the engine's own pool shapes (`KVCachePool.shape_for` on the `ModelConfig` the engine
parses from each model's published config.json values, below): a per-head pool `[layers, 2 * tp, blocks,
block_size, kv_heads, head_dim]`, a latent (MLA) pool `[layers, 1, blocks, block_size, 1, kv_lora_rank +
qk_rope_head_dim]`, bf16 and the int8 KV cache (values + a 2-byte scale per row). "at TP 8" is what one prefill
engine of 8 ranks ships: per-head pools hold every rank's heads (KV heads replicated when fewer than ranks), a
latent pool one copy.

The transfer part moves the KV of a `--tokens` prompt (block_size 16) of two real shapes, DeepSeek-V3's latent
pool and Llama-3-70B's GQA pool of a similar size, bf16, from a spawned sender process into this process's
receiver pool (POSIX shm, as a decode node's), through `KVSender` / `KVReceiver` on each backend: start() ->
finish() returned (the receiver verified the checksum and acknowledged), the median of `--reps`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdcluster.engine.config import ModelConfig  # noqa: E402
from pdcluster.engine.kv_cache import KVCachePool  # noqa: E402
from pdcluster.kv_transfer import KVLayout, KVReceiver, KVSender, SharedKVPool  # noqa: E402

BLOCK_SIZE = 16

# The fields of each model's config.json (Hugging Face Hub) that decide its KV pool and its parse.
_LLAMA = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0)
MODELS: dict[str, dict] = {
    "Llama-3.1-8B (GQA)": dict(_LLAMA, architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "Llama-3-70B (GQA)": dict(_LLAMA, architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "Qwen3-32B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128),
    "Qwen3-30B-A3B (MoE)": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                                hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "Qwen3-235B-A22B (MoE)": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                                  hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                  num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                                  num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True),
    "Mixtral-8x7B (MoE)": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
                               hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                               num_experts_per_tok=2),
    "DeepSeek-V3 (MLA)": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
                              hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                              num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                              num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                              first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5),
}
TRANSFER_MODELS = ("DeepSeek-V3 (MLA)", "Llama-3-70B (GQA)")


def config_of(name: str) -> ModelConfig:
    return ModelConfig.from_dict(MODELS[name])


def bytes_per_token(config: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes one token's KV takes in the engine's pool (all layers and planes), from the pool's own shape."""
    shape = KVCachePool.shape_for(config, num_blocks=1, block_size=1, dtype=dtype, tp=tp)
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def kv_table() -> list[dict]:
    rows = []
    for name in MODELS:
        config = config_of(name)
        shape = KVCachePool.shape_for(config, 1, BLOCK_SIZE, torch.bfloat16)
        rows.append({"model": name, "pool": "latent" if config.kv_latent_dim else "per-head",
                     "layers": config.num_layers, "planes_per_layer": shape[1], "heads": shape[4], "row": shape[5],
                     "bf16": bytes_per_token(config, torch.bfloat16),
                     "int8": bytes_per_token(config, torch.int8),
                     "bf16_tp8": bytes_per_token(config, torch.bfloat16, tp=8)})
    return rows


# ---- transfer: sender child ----------------------------------------------------------------------------------


def _random_pool(shape: tuple[int, ...]) -> torch.Tensor:
    pool = torch.empty(shape, dtype=torch.bfloat16)
    for layer in pool:   # random bits layer by layer: no fp32 copy of a multi-GiB pool
        layer.view(torch.int16).random_(-(2**15), 2**15)
    return pool


def _sender_main(conn, shape: tuple[int, ...]) -> None:
    pool = _random_pool(shape)
    senders: dict[str, KVSender] = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        backend, dst = msg
        sender = senders.get(backend) or senders.setdefault(backend, KVSender(pool, backend=backend))
        t0 = time.perf_counter()
        t = sender.start(dst, list(range(shape[2])))
        t.send_layers(0, shape[0])
        t.finish(timeout=300)
        conn.send(time.perf_counter() - t0)
    for sender in senders.values():
        sender.close()


def measure_transfers(name: str, tokens: int, backends: list[str], reps: int) -> list[dict]:
    config = config_of(name)
    num_blocks = -(-tokens // BLOCK_SIZE)
    shape = KVCachePool.shape_for(config, num_blocks, BLOCK_SIZE, torch.bfloat16)
    shm = SharedKVPool.create(shape, torch.bfloat16)
    rx = KVReceiver(shm.tensor, host="127.0.0.1", shm_name=shm.name)
    conn, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_sender_main, args=(child, shape), daemon=True)
    proc.start()
    out = []
    try:
        assert conn.recv() == "ready"
        nbytes = num_blocks * KVLayout.of(shm.tensor).block_bytes
        for backend in backends:
            times = []
            for i in range(reps + 1):   # the first connects (and maps the pool, compiles the copy kernel)
                rid = f"{backend}-{i}"
                dst = rx.reserve(rid, list(range(num_blocks)), timeout_s=300)
                conn.send((backend, dst.to_dict()))
                elapsed = conn.recv()
                assert asyncio.run(rx.wait(rid, 60)).ok
                if i:
                    times.append(elapsed)
            median = statistics.median(times)
            out.append({"model": name, "backend": backend, "tokens": tokens, "bytes": nbytes,
                        "seconds": round(median, 4), "GB_per_s": round(nbytes / median / 1e9, 2)})
    finally:
        conn.send(None)
        proc.join(30)
        rx.close()
        shm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--backends", default="shm,tcp")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-transfer", action="store_true", help="only the bytes-per-token table")
    args = ap.parse_args()
    table = kv_table()
    transfers = [] if args.no_transfer else [
        row for name in TRANSFER_MODELS
        for row in measure_transfers(name, args.tokens, args.backends.split(","), args.reps)]
    if args.json:
        print(json.dumps({"kv_bytes_per_token": table, "transfers": transfers}, indent=1))
        return
    print(f"{'model':24} {'pool':8} {'layers':>6} {'rows':>6} {'row':>5} {'bf16 B/token':>13} {'int8 B/token':>13} "
          f"{'bf16 at TP 8':>13}")
    for r in table:
        print(f"{r['model']:24} {r['pool']:8} {r['layers']:6} {r['planes_per_layer'] * r['heads']:6} {r['row']:5} "
              f"{r['bf16']:13,} {r['int8']:13,} {r['bf16_tp8']:13,}")
    for r in transfers:
        print(f"{r['model']:24} {r['backend']:4} {r['tokens']} tokens: {r['bytes'] / 2**20:8.1f} MiB in "
              f"{r['seconds'] * 1e3:7.1f} ms ({r['GB_per_s']} GB/s)")


if __name__ == "__main__":
    main()
