"""Tensor parallelism on this machine: TP = N vs TP = 1 in the same run, and the collectives' share of a
decode step.

Model: the offline benchmark's random Llama (hidden 1024, 8 layers, 16 heads / 8 KV heads, vocab 32000).
For each dtype:
  throughput   the same requests through `LLM(tensor_parallel_size=1)` (all torch threads) and
               `LLM(tensor_parallel_size=N)` (threads / N per rank: on CPU the ranks share the cores)
  decode step  --batch sequences decoding together under TP = N: mean step time, rank 0's time inside
               collectives per step (waits for the slower rank included), and a pure all-reduce of one
               layer's [batch, hidden] activations between N fresh processes, through gloo and through
               the shared-memory collectives the engine uses on CPU (engine/shm_collectives.py), times
               the step's 2 x layers + 1 all-reduces (+ 1 logits gather, timed too): the share of the step.

    .venv/bin/python benchmarks/tensor_parallel.py --quick        # ~3 min on 2 cores
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
from offline_throughput import DTYPES, MODEL, engine_generate, make_model, make_requests  # noqa: E402


def allreduce_us(rank: int, size: int, port: int, shm_args: tuple, shape: tuple[int, ...], dtype: torch.dtype,
                 iters: int, out) -> None:
    """Rank `rank`'s timings: gloo all-reduce, gloo logits all-gather, shared-memory all-reduce and gather."""
    from pdcluster.engine.shm_collectives import ShmCollectives

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=size)
    shm = ShmCollectives.attach(*shm_args[:2], rank, shm_args[3])
    x = torch.randn(shape).to(dtype)
    gathered = torch.empty((size * shape[0], MODEL["vocab_size"] // size), dtype=dtype)
    logits = torch.randn(shape[0], MODEL["vocab_size"] // size).to(dtype)

    def timed(fn, n: int) -> float:
        for _ in range(10):
            fn()
        torch.distributed.barrier()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    result = (timed(lambda: torch.distributed.all_reduce(x), iters),
              timed(lambda: torch.distributed.all_gather_into_tensor(gathered, logits), iters // 4 or 1),
              timed(lambda: shm.all_reduce(x, 60.0), iters),
              timed(lambda: shm.gather(logits, 60.0), iters // 4 or 1))
    if rank == 0:
        out.put(result)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def pure_collectives(size: int, batch: int, dtype: torch.dtype, iters: int = 200) -> tuple[float, ...]:
    """(gloo all-reduce µs of [batch, hidden], gloo logits all-gather µs, the same two through shared memory)
    between `size` fresh processes."""
    import socket

    from pdcluster.engine.shm_collectives import ShmCollectives
    from pdcluster.engine.tp_executor import SHM_SLOT_BYTES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm = ShmCollectives.create(size, SHM_SLOT_BYTES)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        procs = [ctx.Process(target=allreduce_us, args=(r, size, port, shm.attach_args(r),
                                                       (batch, MODEL["hidden_size"]), dtype, iters, out))
                 for r in range(size)]
        for p in procs:
            p.start()
        result = out.get(timeout=300)
        for p in procs:
            p.join(60)
    finally:
        shm.unlink()
        shm.close()
    return result


def decode_step(llm, batch: int, steps: int) -> tuple[float, float]:
    """(mean decode step s, rank 0's collective s per step) with `batch` sequences decoding together."""
    from pdcluster.engine import SamplingParams

    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"d{i}", [5 + i % 300] * 32, SamplingParams(temperature=0, max_tokens=steps + 64,
                                                                        ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    group = engine.runner.tp
    before, t = group.collective_seconds, time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t
    collective = group.collective_seconds - before
    engine.abort_all()
    return elapsed / steps, collective / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="24 requests of 16..64 tokens, 10 decode steps")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.steps = 24, 10
    lens = (16, 64) if args.quick else (16, 256)
    from pdcluster.engine import LLM

    threads = torch.get_num_threads()
    results = []
    with tempfile.TemporaryDirectory(prefix="pdcluster-tp-bench-") as tmp:
        model_dir = make_model(tmp)
        reqs = make_requests(args.num_requests, lens, lens, MODEL["vocab_size"], 0)
        warm = make_requests(8, lens, lens, MODEL["vocab_size"], 1)
        for name in args.dtypes.split(","):
            row = {"dtype": name}
            for tp in (1, args.tensor_parallel_size):
                torch.set_num_threads(threads)
                llm = LLM(model=model_dir, dtype=DTYPES[name], kv_cache_memory=1 << 30, max_num_seqs=128,
                          tensor_parallel_size=tp)
                engine_generate(llm, warm)
                elapsed, _ = engine_generate(llm, reqs)
                row[f"tp{tp}_tok_s"] = round(sum(r.max_tokens for r in reqs) / elapsed, 1)
                if tp > 1:
                    step_s, coll_s = decode_step(llm, args.batch, args.steps)
                    row["decode_step_ms"] = round(step_s * 1e3, 2)
                    row["rank0_collective_ms"] = round(coll_s * 1e3, 2)
                    row["rank0_collective_share"] = round(coll_s / step_s, 3)
                llm.engine.shutdown()
                del llm
            torch.set_num_threads(threads)
            timings = pure_collectives(args.tensor_parallel_size, args.batch, DTYPES[name])
            per_step = 2 * MODEL["num_hidden_layers"] + 1   # all-reduces per step, then one logits gather
            for label, (reduce_us, gather_us) in (("gloo", timings[:2]), ("shm", timings[2:])):
                pure_ms = (per_step * reduce_us + gather_us) / 1e3
                row.update({f"{label}_allreduce_us": round(reduce_us, 1), f"{label}_gather_us": round(gather_us, 1),
                            f"{label}_pure_share": round(pure_ms / row["decode_step_ms"], 3)})
            row.update(
                       tp_vs_tp1=round(row[f"tp{args.tensor_parallel_size}_tok_s"] / row["tp1_tok_s"], 2))
            results.append(row)
            print(row, flush=True)
    n = args.tensor_parallel_size
    print(f"\ntorch threads {threads}; TP={n}: {max(1, threads // n)} thread(s) per rank")
    print(f"{'dtype':6} {'TP1 tok/s':>10} {f'TP{n} tok/s':>10} {'ratio':>6} {'step ms':>8} {'coll ms (r0)':>12} "
          f"{'share':>6} {'gloo/shm allreduce us':>22} {'gloo/shm pure share':>20}")
    for r in results:
        print(f"{r['dtype']:6} {r['tp1_tok_s']:>10} {r[f'tp{n}_tok_s']:>10} {r['tp_vs_tp1']:>6} "
              f"{r['decode_step_ms']:>8} {r['rank0_collective_ms']:>12} {r['rank0_collective_share']:>6} "
              f"{str(r['gloo_allreduce_us']) + ' / ' + str(r['shm_allreduce_us']):>22} "
              f"{str(r['gloo_pure_share']) + ' / ' + str(r['shm_pure_share']):>20}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
