"""Offline throughput of the engine vs transformers `generate` on the newer architectures (Qwen3, Qwen3-MoE,
Mixtral, DeepSeek-V3; `--arch`), on one random checkpoint written by engine.testing.make_tiny_model, measured in
the same run.

For each dtype both sides are loaded once, warmed up, then timed in alternation (engine, transformers, engine, ...,
`--rounds` each) so a load change on a shared box hits both; reported: the median of each side's rounds and the
median of the per-round ratios (the steadier figure when the box's load swings).
  engine        `engine.LLM.generate` over all requests (continuous batching)
  transformers  `generate` in left-padded static batches of --static-batch; a batch runs to its longest member
                and only each member's requested tokens count
Requests: prompt and output lengths uniform in --prompt-len / --output-len, fixed seed, greedy, ignore_eos. The
first requests' greedy outputs are compared between the two sides (fp32: identical expected).

    .venv/bin/python benchmarks/new_architectures.py --arch qwen3_moe            # fp32 and bf16
    .venv/bin/python benchmarks/new_architectures.py --arch mixtral --quick

Another architecture: add its make_tiny_model overrides to ARCHS.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import DTYPES, Request, engine_generate, hf_generate_batch, make_requests  # noqa: E402

_COMMON = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
               max_position_embeddings=2048, initializer_range=0.02)
# make_tiny_model(arch, **overrides): hidden >= 512 and, for the MoE models, >= 8 experts with top-k >= 2
ARCHS: dict[str, dict] = {
    "qwen3": dict(_COMMON, head_dim=64, intermediate_size=1536, tie_word_embeddings=True),
    "qwen3_moe": dict(_COMMON, head_dim=64, intermediate_size=1536, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=384, mlp_only_layers=[0]),
    "mixtral": dict(_COMMON, intermediate_size=768, num_local_experts=8, num_experts_per_tok=2),
    # V3's proportions at hidden 512: MLA (q LoRA 192, latent 128 + rope 32, nope 64, v 64; MHA heads), layer 0
    # dense, then 16 experts in 4 groups (best 2 kept), top-4 sigmoid with correction bias, one shared expert
    "deepseek_v3": dict(_COMMON, num_key_value_heads=8, intermediate_size=1536, q_lora_rank=192, kv_lora_rank=128,
                        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
                        num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=256,
                        n_shared_experts=1, first_k_dense_replace=1,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                             mscale_all_dim=1.0, original_max_position_embeddings=512)),
}


def make_model(path: str, arch: str) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(path, arch, **ARCHS[arch])


def hf_static(model, reqs: list[Request], batch: int) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, len(reqs), batch):
        tokens += hf_generate_batch(model, reqs[i:i + batch])
    return time.perf_counter() - t, tokens


def bench_dtype(name: str, model_dir: str, reqs: list[Request], warmup: list[Request], args) -> dict:
    from transformers import AutoModelForCausalLM

    from pdcluster.engine import LLM

    dtype = DTYPES[name]
    out_tokens = sum(r.max_tokens for r in reqs)
    llm = LLM(model=model_dir, dtype=dtype, device="cpu", kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
              max_num_seqs=args.max_num_seqs)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    engine_generate(llm, warmup)
    hf_static(hf, warmup[:args.static_batch], args.static_batch)
    engine_s, hf_s = [], []
    engine_tokens = hf_tokens = None
    for r in range(args.rounds):
        elapsed, engine_tokens = engine_generate(llm, reqs)
        engine_s.append(elapsed)
        elapsed, hf_tokens = hf_static(hf, reqs, args.static_batch)
        hf_s.append(elapsed)
        log(f"[{name}] round {r + 1}: engine {out_tokens / engine_s[-1]:.1f} tok/s, transformers "
            f"{out_tokens / hf_s[-1]:.1f} tok/s (load average {os.getloadavg()[0]:.1f})")
    llm.shutdown()
    del llm, hf
    gc.collect()
    check = min(len(reqs), args.check_requests)
    same = sum(a == b for a, b in zip(engine_tokens[:check], hf_tokens[:check], strict=True))
    res = {"dtype": name, "engine_tok_s": round(out_tokens / statistics.median(engine_s), 1),
           "hf_static_tok_s": round(out_tokens / statistics.median(hf_s), 1),
           "engine_s": [round(s, 2) for s in engine_s], "hf_s": [round(s, 2) for s in hf_s],
           "greedy_identical": f"{same}/{check}"}
    res["engine_vs_hf"] = round(res["engine_tok_s"] / res["hf_static_tok_s"], 2)
    res["round_ratios"] = [round(h / e, 2) for e, h in zip(engine_s, hf_s, strict=True)]
    res["median_round_ratio"] = statistics.median(res["round_ratios"])
    log(f"[{name}] engine {res['engine_tok_s']} tok/s vs transformers {res['hf_static_tok_s']} tok/s: "
        f"{res['engine_vs_hf']}x (per round {res['round_ratios']}); greedy outputs identical for {same}/{check} "
        f"requests")
    return res


def log(msg: str) -> None:
    print(msg, file=sys.stderr if ARGS is not None and ARGS.json else sys.stdout, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_moe", choices=sorted(ARCHS))
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 192), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each side, alternating")
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--check-requests", type=int, default=8, help="greedy outputs compared on this many")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    p.add_argument("--model-dir", help="reuse a model directory instead of writing one to a temp dir")
    p.add_argument("--quick", action="store_true", help="16 requests, lengths 16..64, 2 rounds")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_requests, args.rounds = 16, 2
        args.prompt_len, args.output_len = (16, 64), (16, 64)
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: unknown dtype {d!r}; use fp32 and/or bf16")
    return args


ARGS = None


def main(argv=None) -> dict:
    global ARGS
    ARGS = args = parse_args(argv)
    vocab = ARCHS[args.arch]["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="pdcluster-bench-") as tmp:
        model_dir = args.model_dir or make_model(tmp, args.arch)
        reqs = make_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed)
        warmup = make_requests(args.static_batch, tuple(args.prompt_len), tuple(args.output_len), vocab,
                               args.seed + 1)
        result = {"arch": args.arch, "model": ARCHS[args.arch], "requests": len(reqs),
                  "prompt_tokens": sum(len(r.prompt) for r in reqs), "output_tokens": sum(r.max_tokens for r in reqs),
                  "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                  "load_average_start": os.getloadavg(), "results": []}
        log(f"{args.arch}: {len(reqs)} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} "
            f"output tokens; torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
        for name in args.dtypes.split(","):
            result["results"].append(bench_dtype(name, model_dir, reqs, warmup, args))
    result["load_average_end"] = os.getloadavg()
    log("")
    log(f"{'dtype':6} {'engine tok/s':>12} {'hf tok/s':>10} {'ratio':>6} {'round ratio':>12} {'greedy same':>12}")
    for r in result["results"]:
        log(f"{r['dtype']:6} {r['engine_tok_s']:>12} {r['hf_static_tok_s']:>10} {r['engine_vs_hf']:>6} "
            f"{r['median_round_ratio']:>12} {r['greedy_identical']:>12}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
