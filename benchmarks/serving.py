"""Online serving benchmark against the OpenAI API of a pdcluster router (or vLLM-compatible server).

Requests arrive as a Poisson process (`--request-rate`, inf = all at once), with synthetic prompt /
output lengths (uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]) or a ShareGPT-format
`--dataset`. Streaming completions with token-id prompts and ignore_eos, so every request produces
exactly its output length. Reports throughput, TTFT / TPOT / ITL / E2E percentiles and goodput.

    # against a running router
    python benchmarks/serving.py --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    # start a local cluster first: 1 prefill + 1 decode node, or one decode node doing both
    python benchmarks/serving.py --start 1p1d --num-prompts 64 --request-rate 4
    python benchmarks/serving.py --start colocated --num-prompts 64 --request-rate 4
    # the router alone (one router process, a fake decode node stepping every --fake-step-ms, this process
    # only generating load), optionally profiled (cProfile of the router process)
    python benchmarks/serving.py --start fake --num-prompts 512 --max-concurrency 256 --profile /tmp/router.prof
    # the router alone, this tree against another checkout (`git worktree add /tmp/base HEAD`), interleaved
    python benchmarks/serving.py --compare /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import uvloop
from sse_client import HTTPError, SSEConnection

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("PDCLUSTER_BENCH_CODE") or str(REPO))
request_timeout = getattr(asyncio, "timeout", None) or (lambda _s: contextlib.nullcontext())  # 3.10: no bound


@dataclass
class Result:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)   # perf_counter() of each text chunk after the first
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


def make_requests(args, vocab: int) -> list[tuple[list[int] | str, int]]:
    rng = random.Random(args.seed)
    if args.dataset:
        data = json.loads(Path(args.dataset).read_text())
        pairs = []
        for conv in data:
            turns = conv.get("conversations") or conv.get("conversation") or []
            if len(turns) >= 2:
                pairs.append((turns[0]["value"], max(1, len(turns[1]["value"]) // 4)))  # ~4 chars per token
        rng.shuffle(pairs)
        return [(p, min(o, args.output_len * 4)) for p, o in pairs[: args.num_prompts]]

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.randint(lo, hi)

    return [([rng.randrange(3, vocab) for _ in range(length(args.input_len))], length(args.output_len))
            for _ in range(args.num_prompts)]


async def one_request(conn: SSEConnection, model: str, prompt, max_tokens: int) -> Result:
    res = Result(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    start = last = time.perf_counter()
    try:
        async with request_timeout(600.0):
            status, events = await conn.post_events("/v1/completions", body)
            if status != 200:
                res.error = f"HTTP {status}: {b''.join([e async for e in events])[:200]!r}"
                return res
            async for data in events:
                if data == b"[DONE]":
                    continue
                now = time.perf_counter()
                # Cheap per chunk (the client must not be what is measured): JSON only for the usage chunk.
                if b'"text":""' not in data and b'"text": ""' not in data and b'"choices":[]' not in data \
                        and b'"choices": []' not in data:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                        res.arrivals.append(now)
                    last = now
                elif b'"usage":{' in data or b'"usage": {' in data:
                    usage = orjson.loads(data)["usage"]
                    res.output_len = usage["completion_tokens"]
                    res.prompt_len = usage["prompt_tokens"]
    except (HTTPError, TimeoutError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        await conn.close()
    res.e2e = time.perf_counter() - start
    return res


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


async def run(args, url: str, model: str, vocab: int) -> dict:
    requests = make_requests(args, vocab)
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    # One connection per concurrent stream, reused (keep-alive) by the next request of that slot.
    ssl_context = ssl.create_default_context()   # shared: each connection would otherwise load the CA bundle
    conns: list[SSEConnection] = []
    idle: list[SSEConnection] = []

    async def limited(prompt, n):
        async with limit:
            conn = idle.pop() if idle else None
            if conn is None:
                conn = SSEConnection(url, ssl_context)
                conns.append(conn)
            try:
                return await one_request(conn, model, prompt, n)
            finally:
                idle.append(conn)   # most recently used first: its connection is the warmest

    try:
        await limited(requests[0][0], 2)  # warm-up (connection, tokenizer, caches)
        tasks = []
        start = time.perf_counter()
        for prompt, n in requests:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results: list[Result] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        await asyncio.gather(*(conn.close() for conn in conns))
    ok = [r for r in results if not r.error]
    out_tokens = sum(r.output_len for r in ok)
    good = [r for r in ok if (not args.slo_ttft or r.ttft * 1000 <= args.slo_ttft)
            and (not args.slo_tpot or r.tpot * 1000 <= args.slo_tpot)]
    itls = [x for r in ok for x in r.itls]
    # While every request decodes (after the last first token, before the first finish), the decode node
    # runs at its full batch: the ITL there is what compares with an offline step at that batch.
    full = []
    if ok and all(r.arrivals for r in ok):
        begin = max(r.arrivals[0] - r.itls[0] for r in ok)
        end = min(r.arrivals[-1] for r in ok)
        full = [x for r in ok for x, t in zip(r.itls, r.arrivals, strict=True) if begin < t - x and t <= end]
    summary = {
        "url": url, "num_requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration, "request_rate": args.request_rate,
        "request_throughput": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "goodput_requests_per_s": len(good) / duration,
        "slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok if r.output_len > 1]),
                         ("itl", itls), ("full_batch_itl", full), ("e2e", [r.e2e for r in ok])):
        summary[f"{name}_ms"] = {"mean": statistics.fmean(values) * 1000 if values else 0.0,
                                 **{f"p{p}": pct(values, p) * 1000 for p in (50, 90, 99)}}
    return summary


async def main_async(args) -> dict:
    cluster = None
    fake = None
    own_dir = None   # the tokenizer dir made for --start fake without --model
    try:
        if args.start == "fake":
            from router_fake import FakeSetup

            model_dir = args.model or fake_model_dir()
            own_dir = None if args.model else model_dir
            fake = FakeSetup(model_dir, args.fake_step_ms / 1000, args.profile, args.router_workers, args.pin_router)
            await asyncio.to_thread(fake.wait_ready)
            url = fake.url
        elif args.start:
            from pdcluster.cli.supervisor import LocalCluster

            layouts = {"1p1d": (1, 1, 0), "colocated": (0, 1, 0), "2p2d": (2, 2, 0)}
            num_prefill, num_decode, _ = layouts[args.start]
            cluster = LocalCluster(model=args.model, num_prefill=num_prefill, num_decode=num_decode, port=0,
                                   cluster=f"bench-{args.start}",
                                   node_config={"kv_cache_memory": args.kv_cache_memory,
                                                "max_num_seqs": args.max_num_seqs, "dtype": args.dtype},
                                   router_config={"disagg_min_tokens": 0, "routing_policy": "least_loaded"},
                                   log_level="WARNING")
            await asyncio.to_thread(cluster.start)
            url, model_dir = cluster.url, cluster.model
        else:
            url, model_dir = args.url.rstrip("/"), args.model
        async with httpx.AsyncClient(base_url=url) as http:
            model = args.served_model or (await http.get("/v1/models")).json()["data"][0]["id"]
        vocab = 32000
        if model_dir:  # random prompt ids must be valid for both the model and its tokenizer
            from tokenizers import Tokenizer

            config = json.loads((Path(model_dir) / "config.json").read_text())
            size = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size()
            vocab = min(config.get("vocab_size", size), size, 32000)
        cpu = fake.cpu_seconds() if fake is not None else 0.0
        own = time.process_time()
        summary = await run(args, url, model, vocab)
        summary["setup"] = args.start or "external"
        out = summary["output_tokens_per_s"] * summary["duration_s"]
        # The load generator's own CPU per streamed token: on shared cores it competes with what it measures.
        summary["client_cpu_us_per_token"] = (time.process_time() - own) / max(out, 1) * 1e6
        if fake is not None:   # the router's CPU per streamed token: robust where other work shares the cores
            summary["router_cpu_us_per_token"] = (fake.cpu_seconds() - cpu) / max(out, 1) * 1e6
        return summary
    finally:
        if fake is not None:
            await asyncio.to_thread(fake.stop)
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)


def offline_decode_step_ms(args) -> float:
    """Mean `LLMEngine.step()` over the decode of `max_concurrency` requests of `input_len` random ids and
    `output_len` tokens, once every prompt is prefilled: what a decode node's step costs without the cluster."""
    from pdcluster.control.config import parse_bytes
    from pdcluster.engine import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                  kv_cache_memory=parse_bytes(args.kv_cache_memory)))
    rng = random.Random(args.seed)
    vocab = min(engine.model_config.vocab_size, 32000)
    for i in range(args.max_concurrency):
        engine.add_request(f"r{i}", [rng.randrange(17, vocab) for _ in range(args.input_len)],
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return elapsed / max(steps, 1) * 1e3


def fake_model_dir() -> str:
    """The router tests' tiny byte-fallback tokenizer, with room for the benchmark's lengths."""
    sys.path.insert(0, str(REPO / "tests"))
    from router_fakes import make_tokenizer_dir

    return make_tokenizer_dir(tempfile.mkdtemp(prefix="pdcluster-bench-tok-"), max_position_embeddings=8192)


def code_tree(checkout: str, into: str) -> str:
    """A directory that imports `pdcluster` (all its rooms) from `checkout` as the installed package maps them."""
    root = Path(into) / "pdcluster"
    root.mkdir(parents=True)
    for entry in (Path(checkout) / "pdcluster").iterdir():
        (root / entry.name).symlink_to(entry)
    for room in ("router", "engine", "kv_transfer", "prefill_node", "decode_node"):
        if (Path(checkout) / room).is_dir():
            (root / room).symlink_to(Path(checkout) / room)
    return into


def compare(args) -> None:
    """Rounds of (baseline, this tree) in alternating order, each run a fresh router + fake node + load."""
    model_dir = args.model or fake_model_dir()   # shared by every run
    base = code_tree(args.compare, tempfile.mkdtemp(prefix="pdcluster-bench-base-"))
    try:
        results = compare_rounds(args, model_dir, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if not args.model:
            shutil.rmtree(model_dir, ignore_errors=True)
    print(f"medians of {args.rounds} rounds (load average now {os.getloadavg()[0]:.1f}):")
    for name, by_label in results.items():
        cells = []
        for label in ("before", "after"):
            rows = by_label[label]
            cells.append(f"{label} {statistics.median(x['output_tokens_per_s'] for x in rows):8.0f} tok/s "
                         f"{statistics.median(x['router_cpu_us_per_token'] for x in rows):6.1f} us/token "
                         f"TTFT p50 {statistics.median(x['ttft_ms']['p50'] for x in rows):6.1f} ms")
        print(f"  {name:6s} " + " | ".join(cells))


def compare_rounds(args, model_dir: str, base: str) -> dict[str, dict[str, list[dict]]]:
    runs = [(f"c{c}", ["--num-prompts", str(4 * c), "--max-concurrency", str(c)])
            for c in map(int, args.concurrencies.split(","))]
    runs.append(("light", ["--num-prompts", "40", "--max-concurrency", "1", "--output-len", "8"]))
    results: dict[str, dict[str, list[dict]]] = {}
    for r in range(args.rounds):
        for name, extra in runs:
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                env = dict(os.environ, PDCLUSTER_BENCH_CODE=base if label == "before" else str(REPO))
                cmd = [sys.executable, __file__, "--start", "fake", "--json", "--model", model_dir,
                       "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                       "--fake-step-ms", str(args.fake_step_ms), *(["--pin-router"] if args.pin_router else []),
                       *extra]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"{label} {name} failed:\n{out.stderr[-3000:]}")
                summary = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault(name, {}).setdefault(label, []).append(summary)
                print(f"round {r} {name:6s} {label:6s}: {summary['output_tokens_per_s']:8.0f} tok/s, router CPU "
                      f"{summary['router_cpu_us_per_token']:6.1f} us/token (client "
                      f"{summary['client_cpu_us_per_token']:.1f}), TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, "
                      f"failed {summary['failed']}, load {os.getloadavg()[0]:.1f}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="router base URL (ignored with --start)")
    p.add_argument("--start", choices=["1p1d", "colocated", "2p2d", "fake"], help="start a local cluster first")
    p.add_argument("--model", default=None, help="model dir (--start: default a tiny random Llama)")
    p.add_argument("--served-model", default=None, help="model name for requests (default: /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--slo-ttft", type=float, default=0.0, help="goodput: TTFT SLO in ms")
    p.add_argument("--slo-tpot", type=float, default=0.0, help="goodput: TPOT SLO in ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per node, with --start")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fake-step-ms", type=float, default=5.0, help="--start fake: the fake node's step interval")
    p.add_argument("--pin-router", action="store_true",
                   help="--start fake / --compare: the router process(es) on CPUs of their own, the fake node and "
                        "the load generator on the others (measures what one router process streams)")
    p.add_argument("--router-workers", type=int, default=1,
                   help="--start fake: router processes on the one port (SO_REUSEPORT, as `router --workers N`)")
    p.add_argument("--profile", default="", help="--start fake: write the router process's cProfile stats here")
    p.add_argument("--compare", default="", metavar="CHECKOUT",
                   help="router alone (fake node), this tree against CHECKOUT side by side: streamed tokens/s at "
                        "--concurrencies, TTFT at concurrency 1; --rounds interleaved rounds, medians")
    p.add_argument("--concurrencies", default="64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--offline-step", action="store_true",
                   help="after the run: the offline engine's mean decode step with --max-concurrency prompts of "
                        "--input-len tokens, all decoding (--model, --dtype), and TPOT mean over it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if args.compare:
        compare(args)
        return
    summary = uvloop.run(main_async(args))   # the load generator on the loop the router uses: cheaper per event
    if args.offline_step:
        summary["offline_step_ms"] = offline_decode_step_ms(args)
        summary["tpot_over_offline_step"] = summary["tpot_ms"]["mean"] / summary["offline_step_ms"]
        full = summary["full_batch_itl_ms"]
        summary["full_batch_itl_over_offline_step"] = full["mean"] / summary["offline_step_ms"]
        print(f"offline decode step {summary['offline_step_ms']:.1f} ms at batch {args.max_concurrency}; "
              f"TPOT mean / step = {summary['tpot_over_offline_step']:.2f}; ITL while all {args.max_concurrency} "
              f"decode: mean {full['mean']:.1f} p50 {full['p50']:.1f} ms, mean / step = "
              f"{summary['full_batch_itl_over_offline_step']:.2f}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
        return
    print(f"setup {summary['setup']}: {summary['num_requests']} requests ({summary['failed']} failed) "
          f"in {summary['duration_s']:.1f} s at rate {summary['request_rate']}")
    print(f"  throughput {summary['request_throughput']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s, "
          f"goodput {summary['goodput_requests_per_s']:.2f} req/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[f"{name}_ms"]
        print(f"  {name.upper():5s} ms: mean {s['mean']:.1f}  p50 {s['p50']:.1f}  p90 {s['p90']:.1f}  "
              f"p99 {s['p99']:.1f}")
    if summary["errors"]:
        print("  errors:", summary["errors"])


if __name__ == "__main__":
    main()
