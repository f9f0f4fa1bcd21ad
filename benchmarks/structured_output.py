"""The cost of structured output: decode tokens/s at batch 1, 16 and 64 with a JSON schema against without,
in the same run, on the same engine (issue 28 asks for <= 10 % slower at batch 16).

For each batch size B, B requests (the same chat-like prompt, temperature 0.8, per-request seeds) run once free
(`ignore_eos`, so that none ends early) and once under SCHEMA (a JSON object whose array of short strings can
run on). Every `LLMEngine.step()` is timed; a step counts when it is a pure decode step of the full batch (all
B requests decoding, none prefilling or finished), so both sides compare the same work: tokens/s = B / median
step time. The grammar's share is the bitmask fill (one matcher per row, xgrammar's C++) and its application
(one masked op over the batch) plus accepting each sampled token. Compile time is reported separately: the
first (cold) compile of SCHEMA for the model's tokenizer, and a cached one.

    .venv/bin/python benchmarks/structured_output.py                        # the default model (SmolLM2-135M)
    .venv/bin/python benchmarks/structured_output.py --model DIR --device cuda --batches 1 16 64 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.llm_engine import LLMEngine

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "score": {"type": "number"}},
          "required": ["title", "tags", "score"], "additionalProperties": False}
PROMPT = "List many tags about the sea, as JSON with a title, tags and a score."


def default_model() -> str:
    from pdcluster.engine.convert import convert_model, default_model_source

    return convert_model(default_model_source(), tempfile.mkdtemp(prefix="so-bench-"), dtype="float32")


def decode_rate(engine: LLMEngine, prompt: list[int], batch: int, tokens: int, grammar: bool) -> tuple[float, int]:
    """(tokens/s over full-batch decode steps, steps counted)."""
    for i in range(batch):
        p = SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=not grammar,
                           structured_outputs={"json": SCHEMA} if grammar else None)
        engine.add_request(f"{'g' if grammar else 'f'}{batch}-{i}", prompt, p)
    times: list[float] = []
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        full = (len(sched.running) == batch and not sched.waiting and not sched.waiting_for_grammar
                and all(s.num_computed_tokens == s.num_tokens - 1 for s in sched.running))
        start = time.perf_counter()
        outs = engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        if full and not any(o.finished for o in outs):
            times.append(time.perf_counter() - start)
    return (batch / statistics.median(times) if times else 0.0), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF checkpoint directory (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=48, help="max output tokens per request")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model or default_model(), device=args.device, dtype=args.dtype,
                                  max_num_seqs=max(args.batches), max_model_len=512))
    prompt = engine.tokenizer.encode(PROMPT)

    compiler = engine.grammar_compiler()
    start = time.perf_counter()
    compiler.compile({"json": SCHEMA})
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile({"json": SCHEMA})
    cached = time.perf_counter() - start

    decode_rate(engine, prompt, 2, 8, True)   # warm-up: kernels, allocator, the bitmask buffer
    rows = []
    for b in args.batches:
        free, n_free = decode_rate(engine, prompt, b, args.tokens, False)
        guided, n_guided = decode_rate(engine, prompt, b, args.tokens, True)
        rows.append({"batch": b, "free_tok_s": round(free, 1), "schema_tok_s": round(guided, 1),
                     "slower_pct": round(100 * (1 - guided / free), 1) if free and guided else None,
                     "steps": [n_free, n_guided]})
    engine.shutdown()
    result = {"device": args.device, "compile_cold_ms": round(cold * 1e3, 2),
              "compile_cached_ms": round(cached * 1e3, 3), "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"grammar compile: cold {result['compile_cold_ms']} ms, cached {result['compile_cached_ms']} ms")
    print(f"{'batch':>6} {'free tok/s':>11} {'schema tok/s':>13} {'slower':>8} {'steps':>10}")
    for r in rows:
        print(f"{r['batch']:>6} {r['free_tok_s']:>11} {r['schema_tok_s']:>13} {r['slower_pct']!s:>7}% "
              f"{r['steps'][0]:>4}/{r['steps'][1]:<4}")


if __name__ == "__main__":
    main()
