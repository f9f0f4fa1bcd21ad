"""Live migration of running streams (issue #34): the pause a moved stream sees, against its inter-token latency,
with and without the pre-copy, in the same run; and a rolling restart of every decode node under a steady load.

    .venv/bin/python benchmarks/migration.py [--workloads long,many] [--backends shm,tcp] [--rounds 2]
    .venv/bin/python benchmarks/migration.py --roll [--rate 1.5] [--before 30]

A cluster of 2 decode nodes (`pdcluster up`'s LocalCluster: real etcd, router, node processes; no prefill node)
serving the default model (SmolLM2-135M-Instruct) with the KV moved over `--backends`. Every stream starts on
decode-0 (decode-1 cordoned); once each has `--warm` tokens, decode-1 takes work and decode-0 drains with migration
(`pdcluster drain --migrate`): every stream moves to decode-1 with its KV. Workloads: `long`, one stream of a
`--long-prompt`-token prompt (8k: the issue's long context); `many`, `--streams` streams of `--many-prompt` tokens.
Side "pre-copy": the router's default (`migration_precopy`: the KV is copied while the stream decodes on, then the
node hands it back at a block boundary and the new node copies only the blocks filled since); side "stop-and-copy"
(`migration_precopy: false`): handed back first, every block copied in the pause. Rounds alternate the sides' order.

Per stream, from the client's chunk arrival times: ITL p50 before the drain, the pause (the longest gap after it:
the switch), the longest gap before the drain (the stream's own hiccups: a step with a prompt in it, text held back
by the detokenizer until a character is whole), and the total (drain asked -> first token after the switch); and the
switch as the router sees it (its Generate to the new node -> that node's first token, mean over the streams:
`pdcluster_router_backend_first_token_seconds`), which leaves out the router's and the client's own delays (on a
2-core machine the nodes' copies and steps starve the router, whose chunks then come late).
Printed per side: pause p50 / max, the pause over the ITL, the total, tokens the new node computed again
(`pdcluster_router_resumed_recomputed_tokens`), and whether every output equals the undisturbed one (temperature 0:
token for token).

`--roll`: a steady Poisson load (`--rate` req/s, `--roll-prompt` / `--roll-output` tokens) on both decode nodes; after
`--before` s each node in turn drains with migration, exits, is started again and rejoins (the ansible rolling upgrade's
order). Printed: requests failed, tokens recomputed, TPOT p50 / p99 of requests that ran before the roll against those
that ran during it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CLUSTER = "bench-migrate"
RECOMPUTED = "pdcluster_router_resumed_recomputed_tokens_total"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def make_cluster(args, work: Path, backend: str, precopy: bool):
    from pdcluster.cli.supervisor import LocalCluster

    node = {"kv_cache_memory": args.pool, "max_num_seqs": max(args.streams, 8) + 8, "block_size": 16,
            "kv_backend": backend, "dtype": args.dtype, "max_model_len": 8192}
    return LocalCluster(model=args.model, num_prefill=0, num_decode=2, port=0, cluster=CLUSTER, node_config=node,
                        work_dir=work, lease_ttl=2, log_level=args.log_level,
                        router_config={"routing_policy": "least_loaded", "migration_precopy": precopy,
                                       "request_timeout": 1800.0})


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


async def move_streams(args, cluster, jobs: list[list[int]]) -> dict:
    from cluster_helpers import client, complete, router_metrics, wait_until_async

    from pdcluster.cli.admin import drain_node, set_state

    served = cluster.node_config.get("served_model_name") or Path(cluster.model).name
    api = client(cluster, timeout=1800)
    for node_id, other in (("decode-1", "decode-0"), ("decode-0", "decode-1")):   # both warm, as nodes in service are
        await set_state([cluster.etcd], CLUSTER, other, "cordoned")
        await set_state([cluster.etcd], CLUSTER, node_id, "active")
        await wait_until_async(lambda n=node_id: (cluster.health() or {}).get("decode_nodes") == [n], 30, node_id)
        await complete(api, served, jobs[0][:64], 16)
    progress = [0] * len(jobs)
    tasks = [asyncio.create_task(complete(api, served, p, args.output, progress=progress, slot=i))
             for i, p in enumerate(jobs)]
    while min(progress) < args.warm:
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.02)
    await set_state([cluster.etcd], CLUSTER, "decode-1", "active")
    await wait_until_async(lambda: len((cluster.health() or {}).get("decode_nodes", [])) == 2, 30, "both listed")
    first = 'pdcluster_router_backend_first_token_seconds_{}{{node="decode-1"}}'
    before = router_metrics(cluster)
    asked = time.monotonic()
    drain = asyncio.create_task(drain_node([cluster.etcd], CLUSTER, "decode-0", timeout=600, migrate=True))
    outs = await asyncio.gather(*tasks)
    await drain
    await api.close()
    after = router_metrics(cluster)
    moved = after.get(first.format("count"), 0) - before.get(first.format("count"), 0)
    switch = (after.get(first.format("sum"), 0) - before.get(first.format("sum"), 0)) / max(moved, 1)
    streams = []
    for out in outs:
        times = out.chunk_times
        before = [b - a for a, b in zip(times, times[1:], strict=False) if b <= asked]
        gaps = [(b - a, b) for a, b in zip(times, times[1:], strict=False) if b > asked]
        pause, resumed = max(gaps) if gaps else (0.0, asked)
        streams.append({"itl": statistics.median(before) if before else float("nan"), "pause": pause,
                        "gap_before": max(before, default=float("nan")), "total": resumed - asked})
    return {"streams": streams, "texts": [o.text for o in outs], "switch": switch,
            "recomputed": after.get(RECOMPUTED, 0.0)}


def run_move(args, workload: str, backend: str, precopy: bool, seed: int) -> dict:
    n, length = (1, args.long_prompt) if workload == "long" else (args.streams, args.many_prompt)
    with tempfile.TemporaryDirectory(prefix="bench-migrate-", dir=args.work) as work:
        with make_cluster(args, Path(work), backend, precopy) as cluster:
            from pdcluster.engine.config import ModelConfig

            vocab = ModelConfig.from_pretrained(cluster.model).vocab_size
            return asyncio.run(move_streams(args, cluster, prompts(n, length, seed, vocab)))


def summarize(res: dict) -> dict:
    s = res["streams"]
    pauses = [x["pause"] for x in s]
    itl = statistics.median(x["itl"] for x in s)
    return {"pause_p50_ms": pct(pauses, .5) * 1e3, "pause_max_ms": max(pauses) * 1e3, "itl_p50_ms": itl * 1e3,
            "gap_before_p50_ms": pct([x["gap_before"] for x in s], .5) * 1e3, "switch_ms": res["switch"] * 1e3,
            "pause_over_itl": pct(pauses, .5) / itl, "total_p50_ms": pct([x["total"] for x in s], .5) * 1e3,
            "recomputed": res["recomputed"]}


def cell(rows: list[dict], key: str, fmt: str = ".0f") -> str:
    """median [min-max] of one figure over rounds"""
    vals = [x[key] for x in rows]
    return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"


def moves(args) -> dict:
    sides = {"pre-copy": True, "stop-and-copy": False}
    table: dict[tuple[str, str, str], list[dict]] = {}
    same = True
    for r in range(args.rounds):
        for workload in args.workloads.split(","):
            for backend in args.backends.split(","):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                texts = []
                for side in order:
                    res = run_move(args, workload, backend, sides[side], args.seed + r)
                    texts.append(res["texts"])
                    row = summarize(res)
                    table.setdefault((workload, backend, side), []).append(row)
                    print(f"round {r} {workload:4} {backend:3} {side:13}: pause p50 {row['pause_p50_ms']:7.1f} ms "
                          f"(max {row['pause_max_ms']:7.1f}), ITL p50 {row['itl_p50_ms']:6.1f} ms, longest gap "
                          f"before {row['gap_before_p50_ms']:6.1f} ms, pause/ITL {row['pause_over_itl']:5.2f}, total "
                          f"p50 {row['total_p50_ms']:7.0f} ms, switch {row['switch_ms']:6.1f} ms, recomputed "
                          f"{row['recomputed']:.0f}", flush=True)
                same = same and texts[0] == texts[1]
    print(f"\noutputs identical with and without the pre-copy: {same}")
    print(f"{'workload':8} {'kv':4} {'side':13} {'pause p50 ms':>16} {'pause max ms':>16} {'ITL p50 ms':>14} "
          f"{'gap before ms':>16} {'pause/ITL':>14} {'total p50 ms':>16} {'switch ms':>16} {'recomputed':>10}")
    for (workload, backend, side), rows in table.items():
        print(f"{workload:8} {backend:4} {side:13} {cell(rows, 'pause_p50_ms'):>16} {cell(rows, 'pause_max_ms'):>16} "
              f"{cell(rows, 'itl_p50_ms'):>14} {cell(rows, 'gap_before_p50_ms'):>16} "
              f"{cell(rows, 'pause_over_itl', '.2f'):>14} "
              f"{cell(rows, 'total_p50_ms'):>16} {cell(rows, 'switch_ms'):>16} "
              f"{max(x['recomputed'] for x in rows):10.0f}")
    return {"rows": {"/".join(k): v for k, v in table.items()}, "identical": same}


async def steady_load(args, cluster, stop: asyncio.Event, results: list) -> None:
    """Poisson arrivals at `args.rate` until `stop`; each request's (start, end, TPOT or the error)."""
    from cluster_helpers import client, complete

    from pdcluster.engine.config import ModelConfig

    served = cluster.node_config.get("served_model_name") or Path(cluster.model).name
    vocab = ModelConfig.from_pretrained(cluster.model).vocab_size
    api = client(cluster, timeout=600)
    rng = random.Random(args.seed)
    tasks = []

    async def one(p: list[int]) -> None:
        start = time.monotonic()
        try:
            out = await complete(api, served, p, args.roll_output)
            t = out.chunk_times
            tpot = (t[-1] - t[0]) / max(1, out.usage - 1) if len(t) > 1 else float("nan")
            results.append({"start": start, "end": out.ended, "tpot": tpot, "ok": out.usage == args.roll_output})
        except Exception as exc:   # a failed request is the figure that matters
            results.append({"start": start, "end": time.monotonic(), "error": repr(exc)})

    while not stop.is_set():
        tasks.append(asyncio.create_task(one([rng.randrange(100, vocab) for _ in range(args.roll_prompt)])))
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    await api.close()


async def rolling(args, cluster) -> dict:
    from cluster_helpers import router_metrics, wait_until_async

    from pdcluster.cli.admin import drain_node, set_state

    stop = asyncio.Event()
    results: list[dict] = []
    load = asyncio.create_task(steady_load(args, cluster, stop, results))
    await asyncio.sleep(args.before)
    roll_start = time.monotonic()
    for node_id in ("decode-0", "decode-1"):
        await drain_node([cluster.etcd], CLUSTER, node_id, timeout=600, migrate=True)
        service = cluster.service(node_id)
        service.proc.wait(60)
        end = time.monotonic() + 120
        while not service.alive:   # the supervisor starts it again (pdcluster up does the same)
            cluster.supervise()
            assert time.monotonic() < end
            await asyncio.sleep(0.2)
        await set_state([cluster.etcd], CLUSTER, node_id, "active")   # a drain leaves it cordoned: uncordon
        await wait_until_async(lambda: len((cluster.health() or {}).get("decode_nodes", [])) == 2, 120,
                               f"{node_id} back")
    roll_end = time.monotonic()
    await asyncio.sleep(args.after)
    stop.set()
    await load
    before = [r["tpot"] for r in results if "tpot" in r and r["end"] < roll_start]
    during = [r["tpot"] for r in results if "tpot" in r and r["start"] < roll_end and r["end"] > roll_start]
    return {"requests": len(results), "failed": sum(1 for r in results if "error" in r or not r.get("ok")),
            "errors": [r["error"] for r in results if "error" in r][:5],
            "recomputed": router_metrics(cluster).get(RECOMPUTED, 0.0), "roll_s": roll_end - roll_start,
            "before": len(before), "during": len(during),
            "tpot_before_ms": (pct(before, .5) * 1e3, pct(before, .99) * 1e3),
            "tpot_during_ms": (pct(during, .5) * 1e3, pct(during, .99) * 1e3),
            "handbacks": router_metrics(cluster).get("pdcluster_router_migrations_total", 0.0)}


def roll(args) -> dict:
    from pdcluster.cli.supervisor import LocalCluster

    node = {"kv_cache_memory": args.pool, "max_num_seqs": 32, "block_size": 16, "dtype": args.dtype,
            "kv_backend": args.backends.split(",")[0], "drain_migrate": True}
    with tempfile.TemporaryDirectory(prefix="bench-roll-") as work:
        cluster = LocalCluster(model=args.model, num_prefill=0, num_decode=2, port=0, cluster=CLUSTER,
                               node_config=node, work_dir=Path(work), lease_ttl=2, log_level="WARNING",
                               router_config={"routing_policy": "least_loaded"})
        with cluster:
            res = asyncio.run(rolling(args, cluster))
    print(f"rolling restart of 2 decode nodes at {args.rate} req/s ({args.roll_prompt} in / {args.roll_output} out), "
          f"{res['roll_s']:.0f} s: {res['requests']} requests, {res['failed']} failed, {res['recomputed']:.0f} tokens "
          f"recomputed, {res['handbacks']:.0f} streams moved; TPOT p50/p99 before {res['tpot_before_ms'][0]:.0f}/"
          f"{res['tpot_before_ms'][1]:.0f} ms ({res['before']} requests), during {res['tpot_during_ms'][0]:.0f}/"
          f"{res['tpot_during_ms'][1]:.0f} ms ({res['during']}); p99 ratio "
          f"{res['tpot_during_ms'][1] / res['tpot_before_ms'][1]:.2f}")
    if res["errors"]:
        print("errors:", res["errors"])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model dir (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--workloads", default="long,many")
    p.add_argument("--backends", default="shm,tcp", help="kv_backend of the nodes")
    p.add_argument("--long-prompt", type=int, default=7900, help="(SmolLM2's context is 8192)")
    p.add_argument("--many-prompt", type=int, default=512)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output", type=int, default=160, help="tokens per stream")
    p.add_argument("--warm", type=int, default=24, help="tokens every stream has before the drain")
    p.add_argument("--pool", default="1536MiB", help="KV pool per node")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--roll", action="store_true", help="the rolling restart instead")
    p.add_argument("--rate", type=float, default=1.5)
    p.add_argument("--roll-prompt", type=int, default=256)
    p.add_argument("--roll-output", type=int, default=96)
    p.add_argument("--before", type=float, default=30.0, help="seconds of load before the roll")
    p.add_argument("--after", type=float, default=5.0, help="seconds of load after it")
    p.add_argument("--log-level", default="WARNING", help="of the cluster's services (their logs: --work)")
    p.add_argument("--work", help="where the clusters' work dirs (logs) go; default: a temporary dir")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = roll(args) if args.roll else moves(args)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
