"""Multi-turn chat against a cluster with the KV tiers on and off (issue #32), same run, interleaved rounds.

    .venv/bin/python benchmarks/kv_tiers.py [--conversations 8] [--turns 4] [--rounds 2]

A cluster of `--prefill` (1) prefill and 2 decode nodes (`pdcluster up`'s LocalCluster: real etcd, router, node
processes) serving the default model (SmolLM2-135M-Instruct) with a small KV pool per node (`--pool`), so that the
conversations' histories do not all fit; the router sends every prompt to a prefill node (`--disagg-min-tokens 0`,
the default) or, above 0, prompts whose uncached part is shorter to the decode node that holds (or can fetch) the
rest.
Each turn of each conversation is one streamed chat completion (temperature 0, `--output` tokens, ignore_eos) whose
prompt is the whole history: the earlier turns' user messages and answers, then a new user message of `--user-words`
random words. Turns go round-robin over the conversations, one request at a time, so a conversation's prefix has
been pushed out of the pool by the others' by the time its next turn comes. Side "off": the pool only; side "on":
plus `--host` bytes of host tier and `--disk` bytes of disk tier on every node. Rounds alternate which side runs
first. `--compare routing` keeps the tiers on both sides and compares the router's policy instead: "off" routes by
turns (`round_robin`, the spread a load balancer gives), "on" by the per-tier prefix index (`prefix_aware`); with
`--prefill 2` a conversation's next turn then either finds the node that holds its history or not. `--compare all`
turns both off on side "off": no tiers and `least_loaded` routing (the router does not consult the prefix index).

Printed per side: TTFT p50 / p99 by turn (from the request to the first streamed token), prompt tokens computed
(every node), blocks loaded per tier and fetched from another node, output tokens/s; then the ratios off / on, with
the spread over rounds.
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

WORDS = ("cache block prefix token model decode prefill node router tier memory disk host cluster request stream "
         "answer question history chat turn agent tool search result paper table figure number value layer head "
         "batch step kernel latency throughput budget window sample seed").split()


def conversations(n: int, turns: int, words: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(turns)] for _ in range(n)]


async def run_side(url: str, model: str, convs: list[list[str]], output: int) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    histories: list[list[dict]] = [[] for _ in convs]
    ttft: dict[int, list[float]] = {}
    tokens, start = 0, time.perf_counter()
    for turn in range(len(convs[0])):
        for c, conv in enumerate(convs):
            histories[c].append({"role": "user", "content": conv[turn]})
            sent = time.perf_counter()
            first, text = None, ""
            stream = await api.chat.completions.create(
                model=model, messages=histories[c], max_tokens=output, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text += chunk.choices[0].delta.content
            ttft.setdefault(turn, []).append((first or time.perf_counter()) - sent)
            histories[c].append({"role": "assistant", "content": text})
            tokens += output
    return {"ttft": ttft, "output_tok_s": tokens / (time.perf_counter() - start), "answers": histories}


def prefill_metrics(cluster) -> dict:
    """Summed over every node: prompt tokens computed (on prefill nodes and, prefilled locally, decode nodes),
    blocks loaded from the tiers, blocks fetched from another node."""
    from cluster_helpers import all_node_metrics, total

    m = all_node_metrics(cluster)
    return {"prefill_tokens": total(m, "pdcluster_node_prefill_tokens_total"),
            "host_loaded": total(m, 'pdcluster_node_kv_tier_loaded_blocks_total{tier="host"}'),
            "disk_loaded": total(m, 'pdcluster_node_kv_tier_loaded_blocks_total{tier="disk"}'),
            "failed_loads": total(m, "pdcluster_node_kv_tier_failed_loads_total"),
            "fetched": total(m, "pdcluster_node_kv_fetched_blocks_total")}


def one_side(args, on: bool, convs, work: Path) -> dict:
    from pdcluster.cli.supervisor import LocalCluster

    node = {"kv_cache_memory": args.pool, "max_num_seqs": 8, "block_size": 16, "dtype": args.dtype}
    tiers = on or args.compare == "routing"
    policy = "prefix_aware" if on or args.compare == "tiers" else \
        "round_robin" if args.compare == "routing" else "least_loaded"
    if tiers:
        node.update(kv_offload_host_bytes=args.host)
        if args.disk != "0":
            node.update(kv_offload_disk_path=str(work / "kv-tier"), kv_offload_disk_bytes=args.disk)
    cluster = LocalCluster(model=args.model, num_prefill=args.prefill, num_decode=2, port=0, cluster="bench-tiers",
                           node_config=node, work_dir=work,
                           router_config={"disagg_min_tokens": args.disagg_min_tokens, "routing_policy": policy},
                           log_level="WARNING")
    with cluster:
        served = cluster.node_config.get("served_model_name") or Path(cluster.model).name
        result = asyncio.run(run_side(cluster.url, served, convs, args.output))
        result.update(prefill_metrics(cluster))
    return result


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model dir (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-words", type=int, default=120)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--pool", default="48MiB", help="KV pool per node")
    p.add_argument("--host", default="1GiB", help="host tier per node (side on)")
    p.add_argument("--disk", default="2GiB", help="disk tier per node (side on; 0: none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=1, help="prefill nodes (decode nodes: 2)")
    p.add_argument("--disagg-min-tokens", type=int, default=0,
                   help="the router's disagg_min_tokens (both sides): 0 sends every prompt to a prefill node; "
                        "above a turn's new tokens, a decode node holding the history computes the tail itself")
    p.add_argument("--compare", choices=["tiers", "routing", "all"], default="tiers",
                   help="tiers: off = no KV tiers; routing: tiers on both sides, off = round_robin routing; all: "
                        "off = neither tiers nor the prefix index (least_loaded routing)")
    p.add_argument("--dtype", default="auto", help="the nodes' dtype (float32: answers compare token for token; "
                                                   "bf16 rounding differs with each node's thread count)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        convs = conversations(args.conversations, args.turns, args.user_words, args.seed + r)
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            with tempfile.TemporaryDirectory(prefix="bench-tiers-") as work:
                res = one_side(args, side == "on", convs, Path(work))
            rows[side].append(res)
            late = [t for turn, ts in res["ttft"].items() if turn >= 2 for t in ts]
            print(f"round {r} {side:3}: TTFT p50 turn>=3 {statistics.median(late) * 1000:7.0f} ms, prefill tokens "
                  f"{res['prefill_tokens']:7.0f}, loaded host/disk {res['host_loaded']:.0f}/{res['disk_loaded']:.0f}, "
                  f"fetched {res['fetched']:.0f}, {res['output_tok_s']:.1f} out tok/s", flush=True)
        same = all(a == b for a, b in zip(rows["off"][-1]["answers"], rows["on"][-1]["answers"], strict=True))
        print(f"round {r}: answers identical on and off: {same}", flush=True)
    summary = {"args": vars(args), "rounds": {}}
    print(f"\n{'':4} {'side':4} " + " ".join(f"{'turn ' + str(t + 1) + ' p50/p99 ms':>22}" for t in range(args.turns))
          + f" {'prefill tok':>11} {'host/disk blocks':>17} {'out tok/s':>9}")
    for side, results in rows.items():
        for r, res in enumerate(results):
            cells = " ".join(f"{pct(res['ttft'][t], .5) * 1000:10.0f} / {pct(res['ttft'][t], .99) * 1000:9.0f}"
                             for t in range(args.turns))
            print(f"r{r:<3} {side:4} {cells} {res['prefill_tokens']:11.0f} "
                  f"{res['host_loaded']:8.0f}/{res['disk_loaded']:<8.0f} {res['output_tok_s']:9.1f}")
    ratios = []
    for off, on in zip(rows["off"], rows["on"], strict=True):
        late_off = statistics.median([t for turn, ts in off["ttft"].items() if turn >= 2 for t in ts])
        late_on = statistics.median([t for turn, ts in on["ttft"].items() if turn >= 2 for t in ts])
        ratios.append({"ttft_p50_turn3plus_off_over_on": late_off / late_on,
                       "prefill_tokens_saved": 1 - on["prefill_tokens"] / off["prefill_tokens"],
                       "throughput_on_over_off": on["output_tok_s"] / off["output_tok_s"]})
    for key in ratios[0]:
        vals = [x[key] for x in ratios]
        print(f"{key}: median {statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}]")
    summary["ratios"] = ratios
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
