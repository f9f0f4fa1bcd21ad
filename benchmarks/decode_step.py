"""Decode step probe: the time of one engine decode step (B sequences, one new token each), eager vs compiled
(EngineArgs.enforce_eager), interleaved in one process so both see the same machine load.

Each variant is an LLMEngine on the same model with B requests of a P-token prompt; once every request is
decoding, the timed loop alternates the variants round by round: per round, each runs `--steps` engine steps
(scheduler, step inputs, model, logits, sampler; ms/step) and as many bare model passes over a frozen step
(`runner.execute` on the inputs of one decode step; ms/forward). Reports the median over rounds, and for the
compiled variant its cold start (engine construction, the first step that compiles, dynamo's recompiles).

    .venv/bin/python benchmarks/decode_step.py                          # SmolLM2-135M bf16, B=32, 1 thread
    .venv/bin/python benchmarks/decode_step.py --dtype float32 --batch 1 --json
    .venv/bin/python benchmarks/decode_step.py --model-dir /tmp/benchmodel --variants eager,compiled

`--offline`: instead, whole offline runs (`LLM.generate`) of benchmarks/vs_vllm.py's workload (64 requests, prompts
of 32..256 random ids, 16..128 output tokens, greedy, ignore_eos) per variant, after a warm-up pass over 64 other
requests; per round a new request set (no prefix-cache hits), run by each variant in turn; output tok/s per run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

VARIANTS = {"eager": dict(enforce_eager=True), "compiled": dict(enforce_eager=False)}


def default_model(dtype: str) -> str:
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    return ensure_converted(default_model_source(), default_model_dir(dtype), dtype)[0]


def build(model: str, dtype: str, batch: int, prompt: int, kwargs: dict):
    from pdcluster.engine import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    t = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=model, dtype=dtype, max_num_seqs=max(batch, 1), kv_cache_memory=1 << 30,
                                  **kwargs))
    built = time.perf_counter() - t
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(17, vocab) for _ in range(prompt)],
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100_000))
    t = time.perf_counter()
    first = None
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
        first = first or time.perf_counter() - t
    t = time.perf_counter()
    engine.step()   # first decode step: a new token count, a compile for the compiled variant
    first_decode = time.perf_counter() - t
    return engine, {"build_s": round(built, 2), "first_prefill_step_s": round(first, 2),
                    "first_decode_step_s": round(first_decode, 2)}


def offline(model: str, args, names: list[str]) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vs_vllm import KV_CACHE_GIB, MAX_NUM_SEQS, make_requests

    from pdcluster.engine import LLM, SamplingParams

    warmup = make_requests(64, 1)

    def generate(llm, batch):
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in batch]
        return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in batch], params)]

    llms, tokens, runs = {}, {}, {n: [] for n in names}
    for name in names:
        t = time.perf_counter()
        llms[name] = LLM(model=model, dtype=args.dtype, kv_cache_memory=KV_CACHE_GIB << 30, max_num_seqs=MAX_NUM_SEQS,
                         **VARIANTS[name])
        generate(llms[name], warmup)
        print(f"{name}: built and warmed up in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    same = True
    for r in range(args.rounds):
        reqs = make_requests(64, 10 + r)   # new prompts each round: no prefix-cache hits on an earlier round's
        out = sum(n for _, n in reqs)
        for name in names:
            t = time.perf_counter()
            tokens[name] = generate(llms[name], reqs)
            runs[name].append(round(out / (time.perf_counter() - t), 1))
        same = same and all(tokens[n] == tokens[names[0]] for n in names)
        print(f"round {r}: " + ", ".join(f"{n} {runs[n][-1]} tok/s" for n in names), file=sys.stderr)
    for llm in llms.values():
        llm.engine.shutdown()
    return {"model": os.path.basename(model.rstrip("/")), "dtype": args.dtype, "threads": args.threads,
            "load_average": os.getloadavg(), "tok_s_runs": runs,
            "tok_s": {n: statistics.median(v) for n, v in runs.items()}, "same_tokens": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="default: SmolLM2-135M-Instruct, converted once")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="eager,compiled")
    ap.add_argument("--offline", action="store_true", help="whole offline runs of the vs_vllm workload instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    model = args.model_dir or default_model(args.dtype)
    names = args.variants.split(",")
    if args.offline:
        result = offline(model, args, names)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
        return
    engines, cold = {}, {}
    for name in names:
        engines[name], cold[name] = build(model, args.dtype, args.batch, args.prompt, VARIANTS[name])
        print(f"{name}: cold start {cold[name]}", file=sys.stderr)
    steps = {n: [] for n in names}
    forwards = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            engine = engines[name]
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            steps[name].append((time.perf_counter() - t) / args.steps * 1e3)
            seqs = list(engine.scheduler.running)
            from pdcluster.engine.scheduler import ScheduledBatch

            inputs, _ = engine.runner.prepare(ScheduledBatch(seqs, [1] * len(seqs)))
            engine.runner.execute(inputs)
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.runner.execute(inputs)
            forwards[name].append((time.perf_counter() - t) / args.steps * 1e3)
        print(f"round {r}: " + ", ".join(f"{n} {steps[n][-1]:.2f} / {forwards[n][-1]:.2f} ms" for n in names),
              file=sys.stderr)
    result = {
        "model": os.path.basename(model.rstrip("/")), "dtype": args.dtype, "batch": args.batch,
        "prompt": args.prompt, "threads": args.threads, "load_average": os.getloadavg(),
        "ms_per_step": {n: round(statistics.median(v), 2) for n, v in steps.items()},
        "ms_per_forward": {n: round(statistics.median(v), 2) for n, v in forwards.items()},
        "cold_start": cold,
        "compiles": {n: engines[n].runner.compiled.compiles for n in names if engines[n].runner.compiled},
    }
    for engine in engines.values():
        engine.shutdown()
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
