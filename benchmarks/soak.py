"""Soak: N minutes of mixed traffic against a cluster, sampling every process's memory, fds and threads.

    python benchmarks/soak.py --prefill 1 --decode 1 --minutes 10 --kv-cache-memory 256MiB

Starts a `LocalCluster` (the machinery of `pdcluster up`; a tiny random Llama without --model), then, from
`--concurrency` streams on loopback: prompts of random token ids (5-400), 8-200 output tokens, temperature 0
or 0.8, a share of the streams closed by the client after a few chunks (`--abort-share`), and optionally a
fault every `--fault-every` s (a prefill node SIGSTOPped for a few seconds: remote prefills time out and fall
back). Every `--sample-s` s it records for each process (etcd excluded) its USS / PSS / RSS
(/proc/PID/smaps_rollup), open fds, of which sockets (zmq sockets and TCP connections), threads, and for
nodes the KV blocks used / reserved (/metrics). After `--warmup-s` s of load the nodes go idle once: their
fds, threads and KV gauges then are the "idle" values; when the measured load ends they must come back to
them (and every KV block free). Printed: growth per 10k requests (least-squares slope of each series over
completed requests) and the idle values before and after. `--json` writes every sample.

Bounded: each request has a deadline, the load stops by itself after --minutes, the cluster stops on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_client import HTTPError, SSEConnection  # noqa: E402

from pdcluster.cli.smoke import scrape_metrics  # noqa: E402
from pdcluster.cli.supervisor import LocalCluster  # noqa: E402

MB = 2**20
KV_GAUGES = {"kv_used": "pdcluster_node_kv_blocks_used", "kv_reserved": "pdcluster_node_kv_blocks_reserved",
             "kv_free": "pdcluster_node_kv_blocks_free", "kv_total": "pdcluster_node_kv_blocks_total",
             "in_flight": "pdcluster_node_requests_in_flight"}


# ---- what one process looks like --------------------------------------------------------------------

@dataclass
class ProcSample:
    uss: int = 0   # bytes only this process maps (Private_*): what it would give back if it exited
    pss: int = 0
    rss: int = 0
    anon: int = 0   # anonymous memory (heap, arenas, torch's CPU tensors): USS without shared-memory pages
    shmem: int = 0   # resident shared-memory pages (KV pools: its own, and peers' it maps): RssShmem
    fds: int = 0
    sockets: int = 0   # fds that are sockets: TCP connections, zmq's (a zmq socket holds several)
    threads: int = 0
    kv: dict[str, float] = field(default_factory=dict)   # nodes: KV_GAUGES


def sample_process(pid: int, metrics_url: str | None = None) -> ProcSample:
    s = ProcSample()
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if not parts or not parts[0].isdigit():
                continue
            kib = int(parts[0]) * 1024
            if key == "Rss":
                s.rss = kib
            elif key == "Pss":
                s.pss = kib
            elif key in ("Private_Clean", "Private_Dirty"):
                s.uss += kib
            elif key == "Anonymous":
                s.anon = kib
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                s.threads = int(line.split()[1])
            elif line.startswith("RssShmem:"):
                s.shmem = int(line.split()[1]) * 1024
    for fd in os.listdir(f"/proc/{pid}/fd"):
        s.fds += 1
        try:
            s.sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass   # closed meanwhile
    if metrics_url:
        m = scrape_metrics(metrics_url)
        s.kv = {k: m.get(name, 0.0) for k, name in KV_GAUGES.items()}
    return s


def sample_cluster(cluster: LocalCluster) -> dict[str, ProcSample]:
    return {s.node_id: sample_process(s.proc.pid, s.metrics_url if s.kind != "router" else None)
            for s in cluster.services if s.alive}


def idle_values(sample: ProcSample) -> dict[str, float]:
    return {"fds": sample.fds, "sockets": sample.sockets, "threads": sample.threads,
            **{k: sample.kv.get(k, 0.0) for k in ("kv_used", "kv_reserved", "kv_free", "in_flight") if sample.kv}}


async def wait_idle(cluster: LocalCluster, timeout: float = 60.0) -> dict[str, ProcSample]:
    """Until every node runs nothing with no KV block used or reserved (fds and threads settled: two samples
    a second apart agree); the last samples. TimeoutError with the busy values after `timeout`."""
    deadline = time.monotonic() + timeout
    last: dict[str, ProcSample] = {}
    while True:
        now = await asyncio.to_thread(sample_cluster, cluster)
        busy = {n: idle_values(s) for n, s in now.items()
                if any(s.kv.get(k) for k in ("kv_used", "kv_reserved", "in_flight"))}
        settled = last and all(idle_values(now[n]) == idle_values(last.get(n, ProcSample())) for n in now)
        if not busy and settled:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"not idle after {timeout:.0f} s: {busy or {n: idle_values(s) for n, s in now.items()}}")
        last = now
        await asyncio.sleep(1.0)


# ---- the load ---------------------------------------------------------------------------------------

@dataclass
class LoadConfig:
    concurrency: int = 32
    prompt_len: tuple[int, int] = (5, 400)
    output_len: tuple[int, int] = (8, 200)
    abort_share: float = 0.3   # streams the client closes after `abort_after` chunks
    abort_after: int = 5
    hot_temperature: float = 0.8   # half the requests: greedy, the others sampled at this temperature
    request_timeout: float = 120.0
    max_model_len: int = 1 << 30   # prompt + output fit in it (the model's max_position_embeddings)
    seed: int = 0


@dataclass
class Counts:
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    last_errors: list[str] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.finished + self.aborted + self.errors


async def one_request(conn: SSEConnection, model: str, prompt: list[int], max_tokens: int, temperature: float,
                      abort_after: int | None, timeout: float) -> str:
    """"finished", "aborted" (closed by us after `abort_after` chunks) or raises HTTPError / TimeoutError."""
    body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                         "seed": random.randrange(2**31) if temperature else None, "stream": True})

    async def stream() -> str:
        status, events = await conn.post_events("/v1/completions", body)
        chunks, done = 0, False
        async for data in events:   # read to the end of the body: the connection is reused
            if status != 200:
                raise HTTPError(f"HTTP {status}: {data[:200]!r}")
            if data == b"[DONE]":
                done = True
                continue
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                await conn.close()   # the client goes away mid-stream
                return "aborted"
        if not done:
            raise HTTPError("stream ended without [DONE]")
        return "finished"

    try:
        return await asyncio.wait_for(stream(), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no complete response within {timeout} s") from None


async def load(url: str, model: str, vocab: int, cfg: LoadConfig, stop_at: float, counts: Counts,
               max_requests: int | None = None) -> None:
    """`cfg.concurrency` streams, each a loop of requests on its own keep-alive connection, until `stop_at`
    (time.monotonic()) or `max_requests` started."""
    rng = random.Random(cfg.seed)
    started = 0

    async def stream(slot: int) -> None:
        nonlocal started
        conn = SSEConnection(url)
        try:
            while time.monotonic() < stop_at and (max_requests is None or started < max_requests):
                started += 1
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.prompt_len))]
                max_tokens = min(rng.randint(*cfg.output_len), cfg.max_model_len - len(prompt))
                abort_after = cfg.abort_after if rng.random() < cfg.abort_share else None
                temperature = 0.0 if rng.random() < 0.5 else cfg.hot_temperature
                try:
                    outcome = await one_request(conn, model, prompt, max_tokens, temperature, abort_after,
                                                cfg.request_timeout)
                except (HTTPError, TimeoutError) as exc:
                    counts.errors += 1
                    counts.last_errors = (counts.last_errors + [f"{type(exc).__name__}: {exc}"])[-5:]
                    await conn.close()
                    await asyncio.sleep(0.5)
                    continue
                if outcome == "finished":
                    counts.finished += 1
                else:
                    counts.aborted += 1
        finally:
            await conn.close()

    await asyncio.gather(*(stream(i) for i in range(cfg.concurrency)))


async def faults(cluster: LocalCluster, every: float, stop_at: float, pause: float = 3.0) -> None:
    """Every `every` s, SIGSTOP one prefill node (round robin) for `pause` s."""
    prefills = [s for s in cluster.services if s.kind == "prefill"]
    i = 0
    while prefills and time.monotonic() + every + pause < stop_at:
        await asyncio.sleep(every)
        s = prefills[i % len(prefills)]
        i += 1
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(pause)
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)


# ---- the run ----------------------------------------------------------------------------------------

@dataclass
class Point:
    t: float   # seconds since the measured load began
    requests: int   # requests done (finished + aborted + failed) by then
    procs: dict[str, ProcSample]


@dataclass
class SoakResult:
    counts: Counts
    points: list[Point]
    idle_before: dict[str, dict[str, float]]
    idle_after: dict[str, dict[str, float]]
    uss_idle_before: dict[str, int]
    uss_idle_after: dict[str, int]
    anon_fresh: dict[str, int] = field(default_factory=dict)   # before any load (the model loaded)
    anon_idle_after: dict[str, int] = field(default_factory=dict)

    def grown_since_start(self, node: str) -> int:
        """Anonymous memory the process gained from its first idle moment to the end (warm-up included: what
        a cache keyed by shapes fills fastest in the first seconds of load)."""
        return self.anon_idle_after.get(node, 0) - self.anon_fresh.get(node, 0)

    def slope(self, node: str, key: str, per: int = 10_000) -> float:
        """Least-squares growth of one series per `per` requests over the measured load."""
        xs = [p.requests for p in self.points if node in p.procs]
        ys = [getattr(p.procs[node], key) for p in self.points if node in p.procs]
        if len(xs) < 2 or max(xs) == min(xs):
            return 0.0
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        return per * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)

    def idle_changes(self) -> dict[str, dict[str, tuple[float, float]]]:
        """{process: {key: (before, after)}} for the idle values that did not come back."""
        out = {}
        for node, before in self.idle_before.items():
            after = self.idle_after.get(node, {})
            diff = {k: (before[k], after.get(k)) for k in before if after.get(k) != before[k]}
            if diff:
                out[node] = diff
        return out


async def soak(cluster: LocalCluster, model: str, vocab: int, seconds: float, cfg: LoadConfig,
               warmup_s: float = 30.0, sample_s: float = 10.0, fault_every: float = 0.0,
               log=print) -> SoakResult:
    """Warm-up load, idle values, `seconds` of measured load sampled every `sample_s`, idle values again."""
    fresh = await wait_idle(cluster)
    warm = Counts()
    await load(cluster.url, model, vocab, cfg, time.monotonic() + warmup_s, warm)
    log(f"warm-up: {warm.finished} finished, {warm.aborted} aborted, {warm.errors} failed {warm.last_errors}")
    before = await wait_idle(cluster)
    counts = Counts()
    points: list[Point] = []
    start = time.monotonic()
    stop_at = start + seconds
    cfg = LoadConfig(**{**asdict(cfg), "seed": cfg.seed + 1})
    traffic = asyncio.create_task(load(cluster.url, model, vocab, cfg, stop_at, counts))
    extra = [asyncio.create_task(faults(cluster, fault_every, stop_at))] if fault_every else []
    try:
        while not traffic.done():
            sample = await asyncio.to_thread(sample_cluster, cluster)
            points.append(Point(time.monotonic() - start, counts.done, sample))
            log(format_point(points[-1], counts))
            await asyncio.wait([traffic], timeout=sample_s)
        points.append(Point(time.monotonic() - start, counts.done, await asyncio.to_thread(sample_cluster, cluster)))
        await traffic
        await asyncio.gather(*extra)
    finally:
        for task in (traffic, *extra):
            task.cancel()
    after = await wait_idle(cluster)
    return SoakResult(counts, points, {n: idle_values(s) for n, s in before.items()},
                      {n: idle_values(s) for n, s in after.items()},
                      {n: s.uss for n, s in before.items()}, {n: s.uss for n, s in after.items()},
                      {n: s.anon for n, s in fresh.items()}, {n: s.anon for n, s in after.items()})


def format_point(p: Point, counts: Counts) -> str:
    procs = "  ".join(f"{n} uss {s.uss / MB:.0f} anon {s.anon / MB:.0f} shm {s.shmem / MB:.0f} fds {s.fds} "
                      f"thr {s.threads}"
                      + (f" kv {s.kv['kv_used']:.0f}+{s.kv['kv_reserved']:.0f}r" if s.kv else "")
                      for n, s in p.procs.items())
    return f"t={p.t:6.0f}s req={p.requests:6d} (err {counts.errors})  {procs}"


def report(result: SoakResult) -> str:
    c = result.counts
    lines = [f"measured load: {c.finished} finished, {c.aborted} aborted by the client, {c.errors} failed"
             + (f" (last: {c.last_errors})" if c.errors else ""),
             "growth per 10k requests (least squares over the measured load) and idle USS before -> after:",
             f"{'process':<12} {'USS MB':>8} {'anon MB':>8} {'PSS MB':>8} {'RSS MB':>8} {'fds':>6} {'threads':>8}   "
             f"{'idle USS MB before -> after':>28}"]
    for node in result.uss_idle_before:
        lines.append(f"{node:<12} {result.slope(node, 'uss') / MB:8.1f} {result.slope(node, 'anon') / MB:8.1f} "
                     f"{result.slope(node, 'pss') / MB:8.1f} "
                     f"{result.slope(node, 'rss') / MB:8.1f} {result.slope(node, 'fds'):6.1f} "
                     f"{result.slope(node, 'threads'):8.1f}   {result.uss_idle_before[node] / MB:12.0f} -> "
                     f"{result.uss_idle_after.get(node, 0) / MB:.0f}")
    lines.append("anonymous memory from before any load to the end (MB): " + ", ".join(
        f"{node} {result.anon_fresh.get(node, 0) / MB:.0f} -> {result.anon_idle_after.get(node, 0) / MB:.0f}"
        for node in result.uss_idle_before))
    changes = result.idle_changes()
    lines.append(f"idle values (fds, sockets, threads, KV blocks used/reserved): "
                 f"{'all back' if not changes else f'NOT back: {changes}'}")
    return "\n".join(lines)


def model_limits(model_dir: str) -> tuple[int, int]:
    """(vocabulary size valid for both the model and its tokenizer: random prompt ids, max model length)."""
    from tokenizers import Tokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size()
    return min(config.get("vocab_size", size), size), int(config.get("max_position_embeddings", 1 << 30))


async def main_async(args) -> int:
    cluster = LocalCluster(model=args.model, num_prefill=args.prefill, num_decode=args.decode, port=0,
                           cluster=f"soak-{os.getpid()}", threads_per_node=args.threads_per_node,
                           node_config={"kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
                                        "device": "cpu"},
                           router_config={"disagg_min_tokens": args.disagg_min_tokens}, log_level="WARNING")
    await asyncio.to_thread(cluster.start)
    try:
        model = Path(cluster.model).name
        print(f"cluster: {args.prefill} prefill + {args.decode} decode, logs in {cluster.work_dir}", flush=True)
        vocab, max_len = model_limits(cluster.model)
        cfg = LoadConfig(concurrency=args.concurrency, abort_share=args.abort_share, max_model_len=max_len,
                         seed=args.seed)
        result = await soak(cluster, model, vocab, args.minutes * 60, cfg, args.warmup_s,
                            args.sample_s, args.fault_every, log=lambda line: print(line, flush=True))
        print(report(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "counts": asdict(result.counts), "idle_before": result.idle_before, "idle_after": result.idle_after,
                "points": [{"t": p.t, "requests": p.requests, "procs": {n: asdict(s) for n, s in p.procs.items()}}
                           for p in result.points]}, indent=1))
        return 0
    finally:
        await asyncio.to_thread(cluster.stop)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny random Llama)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--threads-per-node", type=int, default=None)
    p.add_argument("--disagg-min-tokens", type=int, default=0, help="router: shorter prompts prefill locally")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--abort-share", type=float, default=0.3)
    p.add_argument("--fault-every", type=float, default=0.0, help="SIGSTOP a prefill node for 3 s this often")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every sample here")
    args = p.parse_args()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
