"""Speculative decoding against none, on the real model (SmolLM2-135M-Instruct), in the same run: output
tokens/s of the same greedy requests on one engine without speculation and on engines with each proposer.

Workloads (chat prompts through the model's template, `--tokens` output tokens at most; each round its own
prompts, drawn from a seed of the round and the workload). Copy-style, the answer copies from the prompt (vLLM's
n-gram case):
  copy    repeat / rewrite / fix a given text or code, or add a docstring or a sentence
  code    code edits: add type hints, rename variables, comment every line, add docstrings (4 snippets)
  summary summarise / list the points of / extract sentences from a document of 2-4 paragraphs (longer prompts)
  rewrite rewrite a paragraph with changes: past tense, replaced words, a numbered list, for a child
Not copy-style:
  open    open-ended questions, greedy (a small model still repeats itself: n-gram finds matches)
  sampled the open questions at temperature 1.0, top-p 0.95, seeded per request: little repetition (what the
          proposers cost when they rarely help; seeded, so every side draws the same tokens)
Sides, all loaded at once, each on the same prompts (new ones each round), run together step by step: the
engines take turns, one step each (the order rotates round by round), and each side's time is the sum of its own
steps, so a load other processes put on the machine falls on every side alike:
  base    no speculation
  ngram   {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
  draft   {"method": "draft_model", ...}: the same model in bfloat16 drafting for a float32 target (a drafter
          that agrees often: the mechanism's gain and overhead; with --dtype bfloat16 it drafts for itself)
Per workload and batch size B: each round runs --requests x B requests with B in flight at a time (a new request
as soon as one finishes, as a server at concurrency B does: one long answer does not hold up the others' seats);
tokens/s per side (median over rounds), the per-round ratio to base (median [min-max]), acceptance rate and mean
accepted length, and how many outputs equal base's (fp32: all expected; bf16 verification and decoding round
differently, so a near-tie may flip).

    .venv/bin/python benchmarks/speculative.py                         # every workload, batch 1 and 8, 3 rounds
    .venv/bin/python benchmarks/speculative.py --batches 1 --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.llm_engine import LLMEngine

TEXTS = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library and the public parks, while reducing spending on new office "
    "furniture. The final vote will take place next month.",
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        total = 0\n        for j in range(window):\n            total += values[i + j]\n"
    "        result.append(total / window)\n    return result\n",
    "Our store opens at nine in the morning and closes at eight in the evening from Monday to Friday. On "
    "Saturdays we open at ten and close at six. We are closed on Sundays and on public holidays.",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self, step=1):\n"
    "        self.count += step\n        return self.count\n\n    def reset(self):\n        self.count = 0\n",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperature, and food takes longer to cook.",
]
CODE = [
    TEXTS[1], TEXTS[3],
    "def parse_line(line):\n    parts = line.strip().split(',')\n    name = parts[0]\n    age = int(parts[1])\n"
    "    city = parts[2]\n    return {'name': name, 'age': age, 'city': city}\n\n\ndef parse_file(path):\n"
    "    rows = []\n    with open(path) as f:\n        for line in f:\n            rows.append(parse_line(line))\n"
    "    return rows\n",
    "async def fetch_all(session, urls):\n    results = {}\n    for url in urls:\n"
    "        async with session.get(url) as response:\n            if response.status == 200:\n"
    "                results[url] = await response.text()\n            else:\n                results[url] = None\n"
    "    return results\n",
]
COPY_ASKS = ["Repeat the following text exactly, word for word:\n\n{}",
             "Rewrite the following, keeping every sentence, and fix any mistakes:\n\n{}",
             "Here is some code. Return it unchanged but with a docstring added:\n\n{}",
             "Copy this text and then add one sentence at the end:\n\n{}"]
CODE_ASKS = ["Add type hints to this Python code and return the whole code:\n\n{}",
             "Rename every variable called `result` or `rows` to `out` in this code and return all of it:\n\n{}",
             "Add a comment above every line of this code that explains it:\n\n{}",
             "Return this code with a docstring added to each function:\n\n{}"]
SUMMARY_ASKS = ["Summarise the following document, quoting its most important sentences:\n\n{}",
                "Here is a document:\n\n{}\n\nList its main points, one per line, in the document's own words.",
                "Extract every sentence of this document that mentions a time or a number:\n\n{}"]
REWRITE_ASKS = ["Rewrite the following in the past tense, changing nothing else:\n\n{}",
                "Rewrite the following, replacing every 'and' with 'as well as':\n\n{}",
                "Rewrite the following as a numbered list, one sentence per item:\n\n{}",
                "Rewrite the following so that it is addressed to a child, keeping every fact:\n\n{}"]
PROSE = [TEXTS[0], TEXTS[2], TEXTS[4]]
OPEN_ASKS = ["Write a short story about a {} who learns to sing.", "Give three tips for a {} visiting Paris.",
             "Explain to a {} why the sky is blue.", "Describe the perfect weekend for a {}."]
WORKLOADS = ["copy", "code", "summary", "rewrite", "open", "sampled"]
NOUNS = ["cat", "student", "sailor", "robot", "baker", "child", "pilot", "farmer", "teacher", "dragon"]


def document(rng: random.Random) -> str:
    """Two to four paragraphs, a few hundred tokens (a longer prompt than the other workloads')."""
    return "\n\n".join(rng.sample(PROSE, rng.randint(2, 3)) + rng.sample(TEXTS[1::2], rng.randint(0, 1)))


def ask(workload: str, rng: random.Random) -> str:
    if workload == "copy":
        return rng.choice(COPY_ASKS).format(rng.choice(TEXTS))
    if workload == "code":
        return rng.choice(CODE_ASKS).format(rng.choice(CODE))
    if workload == "summary":
        return rng.choice(SUMMARY_ASKS).format(document(rng))
    if workload == "rewrite":
        return rng.choice(REWRITE_ASKS).format(rng.choice(PROSE))
    return rng.choice(OPEN_ASKS).format(rng.choice(NOUNS))


def prompts(tokenizer, workload: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 7919 + sum(map(ord, workload)))   # a workload's own prompts per round
    out = []
    for _ in range(n):
        text = ask(workload, rng)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def run(engines: dict[str, LLMEngine], prompts_: list[list[int]], tokens: int, tag: str, concurrency: int,
        sampled: bool = False) -> dict[str, tuple[float, list[list[int]], int]]:
    """Per side, (seconds, outputs, output tokens) of the requests run to the end on its engine, at most
    `concurrency` at a time (a closed-loop client: the next request is added as soon as one finishes, as a server
    at that concurrency runs). The engines step in turn (in the dict's order), each timed over its own steps only:
    a load that other processes put on the machine hits every side within a step's time of each other."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=tokens) if sampled \
            else SamplingParams(temperature=0.0, max_tokens=tokens)

    added = dict.fromkeys(engines, 0)

    def top_up(side: str, running: int) -> None:
        while running < concurrency and added[side] < len(prompts_):
            i = added[side]
            engines[side].add_request(f"{tag}-{i}", prompts_[i], params(i))
            added[side] += 1
            running += 1

    for side in engines:
        top_up(side, 0)
    outs: dict[str, dict[str, list[int]]] = {side: {} for side in engines}
    seconds = dict.fromkeys(engines, 0.0)
    while True:
        busy = [side for side, e in engines.items() if e.has_unfinished_requests()]
        if not busy:
            break
        for side in busy:
            start = time.perf_counter()
            done = engines[side].step()
            seconds[side] += time.perf_counter() - start
            outs[side].update((o.request_id, o.outputs[0].token_ids) for o in done if o.finished)
            top_up(side, added[side] - len(outs[side]))
    result = {}
    for side in engines:
        ordered = [outs[side][f"{tag}-{i}"] for i in range(len(prompts_))]
        result[side] = (seconds[side], ordered, sum(len(o) for o in ordered))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                    help="ngram: prompt_lookup_min and prompt_lookup_max")
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--sides", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=3,
                    help="requests per round: this many times the batch size (kept --batch at a time)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    model = args.model or ensure_converted(default_model_source(), default_model_dir(args.dtype), args.dtype)[0]
    drafter = args.model or ensure_converted(default_model_source(), default_model_dir("bfloat16"), "bfloat16")[0]
    common = dict(model=model, dtype=args.dtype, max_num_seqs=max(args.batches), kv_cache_memory=1 << 30,
                  max_model_len=1024)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
                       "prompt_lookup_max": args.lookup[1]},
             "draft": {"method": "draft_model", "model": drafter, "num_speculative_tokens": args.k}}
    engines = {"base": LLMEngine(EngineArgs(**common))}
    for side in args.sides:
        engines[side] = LLMEngine(EngineArgs(**common, speculative_config=specs[side]))
    tokenizer = engines["base"].tokenizer
    load = os.getloadavg()
    results = []
    for workload in args.workloads:
        for batch in args.batches:
            rates: dict[str, list[float]] = {s: [] for s in engines}
            ratios: dict[str, list[float]] = {s: [] for s in engines if s != "base"}
            same: dict[str, list[int]] = {s: [0, 0] for s in ratios}
            before = {s: e.get_stats() for s, e in engines.items()}
            run(engines, prompts(tokenizer, workload, batch, seed=999), 16, "warm", batch)
            for r in range(args.rounds):
                batch_prompts = prompts(tokenizer, workload, batch * args.requests, seed=r)
                order = list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]
                ran = run({side: engines[side] for side in order}, batch_prompts, args.tokens,
                          f"{workload}{batch}-{r}", batch, sampled=workload == "sampled")
                got = {}
                for side, (seconds, outs, n) in ran.items():
                    rates[side].append(n / seconds)
                    got[side] = outs
                for side in ratios:
                    ratios[side].append(rates[side][-1] / rates["base"][-1])
                    same[side][0] += sum(a == b for a, b in zip(got[side], got["base"], strict=True))
                    same[side][1] += len(batch_prompts)
            row = {"workload": workload, "batch": batch,
                   "tok_s": {s: round(statistics.median(v), 1) for s, v in rates.items()}}
            for side in ratios:
                st, b0 = engines[side].get_stats(), before[side]
                drafted = st.spec_num_draft_tokens - b0.spec_num_draft_tokens
                accepted = st.spec_num_accepted_tokens - b0.spec_num_accepted_tokens
                steps = st.spec_num_drafts - b0.spec_num_drafts
                row[side] = {"ratio": round(statistics.median(ratios[side]), 2),
                             "ratio_range": [round(min(ratios[side]), 2), round(max(ratios[side]), 2)],
                             "acceptance": round(accepted / drafted, 3) if drafted else None,
                             "mean_accepted_length": round(1 + accepted / steps, 2) if steps else None,
                             "same_as_base": f"{same[side][0]}/{same[side][1]}"}
            results.append(row)
            if not args.json:
                parts = [f"{workload:5s} batch {batch:3d}: base {row['tok_s']['base']:7.1f} tok/s"]
                for side in ratios:
                    d = row[side]
                    parts.append(f"{side} {row['tok_s'][side]:7.1f} tok/s {d['ratio']:.2f}x "
                                 f"[{d['ratio_range'][0]:.2f}-{d['ratio_range'][1]:.2f}] accept {d['acceptance']} "
                                 f"len {d['mean_accepted_length']} same {d['same_as_base']}")
                print(" | ".join(parts), flush=True)
    if args.json:
        print(json.dumps({"model": os.path.basename(model.rstrip("/")), "dtype": args.dtype, "k": args.k,
                          "requests_per_batch_slot": args.requests,
                          "tokens": args.tokens, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
                          "cpus": os.cpu_count(), "load_average_start": load, "load_average_end": os.getloadavg(),
                          "results": results}))
    else:
        print(f"load average (1, 5, 15 min) at the start {load}, at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
