"""First-token latency at light load while decode steps run: the P/D first-token path, one request at a time.

`--background` streams (prompts of `--input-len` tokens, `--background-len` output tokens, each started again when it
ends) keep a decode node's steps busy the whole time, so a new request's KV reservation there waits for a step in
flight as it does under real traffic; `--probes` requests (`--input-len` tokens, 2 output tokens) are sent one at a
time, 0.2-0.5 s apart, and their time to first token is measured at the client. Prompts are random token ids (no
prefix-cache hits). Several `--url`s are measured in turn, round by round with the order alternated, and each
server's p10 / p50 / p90 is printed with its ratio to the first URL's.

    # two clusters (this tree and an earlier checkout, each `pdcluster up --prefill 1 --decode 1`), one at a time
    .venv/bin/python benchmarks/first_token.py --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds to the first streamed event of one completion (read to its end)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    start, first = time.perf_counter(), 0.0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if not first and line.startswith(b"data: "):
                first = time.perf_counter() - start
    return first


def measure(args, url: str, seed: int) -> list[float]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        model = json.load(resp)["data"][0]["id"]
    stop = threading.Event()

    def background(i: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        while not stop.is_set():
            stream(url, model, [rnd.randrange(1000, 30000) for _ in range(args.input_len)], args.background_len)

    threads = [threading.Thread(target=background, args=(i,), daemon=True) for i in range(args.background)]
    for t in threads:
        t.start()
        time.sleep(0.4)
    time.sleep(3)
    rnd, ttfts = random.Random(seed), []
    try:
        for _ in range(args.probes):
            ttfts.append(1000 * stream(url, model, [rnd.randrange(1000, 30000) for _ in range(args.input_len)], 2))
            time.sleep(0.2 + 0.3 * rnd.random())
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    return ttfts


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="an OpenAI API base URL (repeat to compare)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probes", type=int, default=30)
    p.add_argument("--background", type=int, default=4, help="streams kept running meanwhile")
    p.add_argument("--background-len", type=int, default=400, help="output tokens of each background stream")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    urls = [u.rstrip("/") for u in args.url]
    results: dict[str, list[float]] = {u: [] for u in urls}
    for rnd in range(args.rounds):
        for url in urls if rnd % 2 == 0 else urls[::-1]:
            ttfts = measure(args, url, args.seed + rnd)
            results[url] += ttfts
            print(f"round {rnd} {url}: TTFT p10 {pct(ttfts, 0.1):.0f} p50 {pct(ttfts, 0.5):.0f} "
                  f"p90 {pct(ttfts, 0.9):.0f} ms", flush=True)
    base = statistics.median(results[urls[0]])
    for url in urls:
        xs = results[url]
        print(f"{url}: TTFT p10 {pct(xs, 0.1):.0f} p50 {pct(xs, 0.5):.0f} p90 {pct(xs, 0.9):.0f} ms "
              f"(p50 {statistics.median(xs) / base:.2f}x the first)")


if __name__ == "__main__":
    main()
