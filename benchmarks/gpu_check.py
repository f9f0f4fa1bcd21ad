"""`make gpu-check`: issue #15's CUDA checks in one run on a machine with one CUDA GPU, one JSON summary.

Stages, each a subprocess with its own time limit inside one budget (default 480 s), each recorded in the JSON
even when it fails or is skipped:
  probe      this interpreter's torch looks for a CUDA device (nvidia-smi where torch is missing or a CPU build;
             CUDA_VISIBLE_DEVICES="" hides every GPU); none: stop at once, exit 3, nothing installed
  install    a venv (.tmp/gpu-check/venv) that reuses this interpreter's CUDA torch (its site-packages through
             a .pth file, which also works when this interpreter is itself a venv; pip keeps torch at that
             version by a constraint) or, without one, pip-installs torch from PyPI (the Linux x86_64 wheel there
             is the CUDA build); then `pip install -e .[dev,cuda]`. Offline (--offline, or no index answers):
             `pip install --no-deps -e .` over what the reused site-packages hold, plus the wheels of --wheels
             DIR; it then checks the imports the later stages need. Skipped when nothing changed since the
             last successful install.
  device     GPU name, memory, capability, driver and CUDA versions (torch; NVML through nvidia-ml-py or
             nvidia-smi)
  parity     the engine's parity tests against transformers (PARITY_TESTS) with PDCLUSTER_DEVICE=cuda, the
             FlashInfer backend against the torch one (bf16), KV between two processes on the GPU (cuda_ipc), the
             quantized-weight kernels (tests/test_quant_cuda.py).
             On cuda the engine's attention is FlashInfer when flashinfer-python imports (the cuda extra): its
             kernels are JIT-compiled on first use (nvcc; minutes) unless prebuilt; where they cannot be built
             the engine runs the torch path and the FlashInfer parity test fails, saying so
  benchmark  benchmarks/offline_throughput.py --dtypes bf16 --device cuda: the engine vs transformers static
             batching on the same GPU; target engine/static >= 3
  kv_ipc     benchmarks/kv_cuda_ipc.py: KV blocks device-to-device between two processes through CUDA IPC,
             every byte compared, GB/s

    python3 benchmarks/gpu_check.py [--out DIR/gpu_check.json] [--budget 480] [--offline] [--wheels DIR]

Exit codes: 0 every stage passed and every target was met; 1 a stage failed or a target was missed; 3 no CUDA
device (nothing installed). (`make gpu-check` prints make's "Error 3" and itself exits 2.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_NO_DEVICE = 0, 1, 3
ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".tmp" / "gpu-check"          # /.tmp/ is git-ignored
TORCH_SPEC = "torch>=2.5,<2.15"             # pyproject's range
ENGINE_VS_STATIC_TARGET = 3.0

# Engine-vs-transformers tests that compare only tokens (or tensors of one engine with each other), so they hold
# on any device; the engine takes PDCLUSTER_DEVICE, the transformers reference stays on the CPU in fp32.
PARITY_TESTS = [
    "tests/test_engine_correctness.py::test_greedy_tokens_match_transformers_with_staggered_arrivals",
    "tests/test_engine_correctness.py::test_chunked_prefill_on_off_gives_same_tokens",
    "tests/test_engine_correctness.py::test_prefix_cache_hits_give_same_tokens",
    "tests/test_engine_correctness.py::test_preemption_when_pool_is_small_gives_same_tokens",
    "tests/test_engine_correctness.py::test_sharded_safetensors_load_the_same_weights",
    "tests/test_engine_correctness.py::test_seeded_sampling_reproducible_across_runs_and_batches",
    "tests/test_sliding_window.py::test_generation_far_past_the_window_uses_bounded_blocks[torch]",
    "tests/test_sliding_window.py::test_freeing_avoids_preemption_and_keeps_prefix_cache",
    "tests/test_sliding_window.py::test_preempted_windowed_sequences_recompute_exactly",
    # the FlashInfer backend (the cuda default when flashinfer-python imports) against the torch one, bf16
    "tests/test_flashinfer_backend.py::test_flashinfer_on_cuda_matches_the_torch_backend",
    # KV between two processes on one GPU through the cuda_ipc channel, picked by kv_backend=auto over nccl
    "tests/test_cuda_ipc_channel.py::test_round_trip_between_processes[cuda]",
    # the quantized kernels (torch._int_mm, _weight_int8pack_mm, tinygemm int4) against the dequantized reference
    "tests/test_quant_cuda.py",
]
STAGE_LIMITS = {"device": 60, "parity": 150, "benchmark": 210, "kv_ipc": 90}
STAGE_KEEP = {"device": 60, "parity": 90, "benchmark": 120, "kv_ipc": 45}   # kept back from install for these
NEEDED_MODULES = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "msgpack", "zmq", "psutil", "pytest",
                  "pdcluster.engine"]

PROBE = r"""
import importlib.util, json, os, shutil, site, subprocess, sys, sysconfig
out = {"python": sys.executable, "python_version": sys.version.split()[0],
       "has_pip": importlib.util.find_spec("pip") is not None}
paths = sysconfig.get_paths()
out["site_dirs"] = list(dict.fromkeys(site.getsitepackages() + [paths["purelib"], paths["platlib"]]))
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if out["cuda_available"]:
        out["device_count"] = torch.cuda.device_count()
        out["gpu"] = torch.cuda.get_device_name(0)
except Exception as e:
    out.update(torch=None, torch_error=f"{type(e).__name__}: {e}"[:300], cuda_available=False)
# nvidia-smi only where torch cannot tell (missing, or a CPU build); CUDA_VISIBLE_DEVICES="" or -1 hides every GPU.
hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
smi = shutil.which("nvidia-smi")
if smi and not hidden and not out.get("torch_cuda"):
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi_gpus"] = [line for line in r.stdout.splitlines() if line.startswith("GPU ")]
    except Exception as e:
        out["nvidia_smi_error"] = repr(e)[:200]
print(json.dumps(out))
"""

DEVICE_INFO = r"""
import json, shutil, subprocess, torch
def attempt(fn):
    try:
        return fn()
    except Exception as e:
        return f"unavailable ({type(e).__name__})"
p = torch.cuda.get_device_properties(0)
out = {"gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
       "multiprocessors": p.multi_processor_count, "device_count": torch.cuda.device_count(),
       "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
       "nccl": attempt(lambda: ".".join(map(str, torch.cuda.nccl.version())))}
def nvml():
    import pynvml
    pynvml.nvmlInit()
    v = pynvml.nvmlSystemGetDriverVersion()
    return {"driver": v.decode() if isinstance(v, bytes) else v,
            "driver_cuda": pynvml.nvmlSystemGetCudaDriverVersion_v2(), "nvml": "nvidia-ml-py"}
got = attempt(nvml)
if isinstance(got, dict):
    out.update(got)
else:
    out["nvml"] = got
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        out["driver"] = r.stdout.strip().splitlines()[0] if r.stdout.strip() else None
for name in ("flashinfer", "transformers"):
    out[name] = attempt(lambda: __import__(name).__version__)
print(json.dumps(out))
"""


# ---------------------------------------------------------------- running stages
def run_stage(name: str, cmd: list[str], limit: float, logs: Path, env: dict | None = None) -> dict:
    """Run `cmd` in its own process group (its children die with it), output appended to logs/<name>.log."""
    if limit < 5:
        return {"status": "skipped", "reason": "no time left in the budget"}
    log = logs / f"{name}.log"
    t = time.monotonic()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, status = proc.wait(), "timeout"
    out = {"status": status, "rc": rc, "seconds": round(time.monotonic() - t, 1), "limit_s": round(limit),
           "log": str(log)}
    if status != "ok":
        out["tail"] = log.read_text(errors="replace")[-2000:]
    return out


def last_json(log: str) -> dict | None:
    """The last line of a log that parses as a JSON object (the stage's --json output)."""
    for line in reversed(Path(log).read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def probe(python: str) -> dict:
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:   # a hung driver or a broken interpreter: report, and look no further
        return {"python": python, "cuda_available": False, "cuda_device": False, "probe_error": repr(e)[:300]}
    info["cuda_device"] = bool(info.get("cuda_available") or info.get("nvidia_smi_gpus"))
    return info


# ---------------------------------------------------------------- install
def install(base: dict, venv: Path, logs: Path, limit: float, offline: bool, wheels: str | None) -> dict:
    py = venv / "bin" / "python"
    reuse = bool(base.get("cuda_available"))
    key = hashlib.sha256(((ROOT / "pyproject.toml").read_bytes() + json.dumps(
        [base["python"], base.get("torch"), reuse, offline, wheels]).encode())).hexdigest()
    stamp = venv / ".installed"
    if py.exists() and stamp.exists() and stamp.read_text() == key:
        return {"status": "ok", "reused_venv": True, "reused_torch": reuse, "seconds": 0.0}
    deadline = time.monotonic() + limit
    res: dict = {"reused_venv": False, "reused_torch": reuse, "steps": []}

    def step(name: str, cmd: list[str]) -> bool:
        r = run_stage("install", cmd, deadline - time.monotonic(), logs)
        res["steps"].append({"step": name, **r})
        return r["status"] == "ok"

    shutil.rmtree(venv, ignore_errors=True)
    # Reusing: pip and setuptools come from this interpreter too (a venv's bundled setuptools can be too old to
    # read pyproject.toml, and offline there is no newer one to fetch).
    bare = reuse and base.get("has_pip")
    if not step("venv", [base["python"], "-m", "venv", *(["--without-pip"] if bare else []), str(venv)]):
        return {**res, "status": "failed"}
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--timeout", "20", "--retries", "1"]
    if wheels:
        pip += ["--find-links", str(Path(wheels).resolve())]
    if offline:
        pip += ["--no-index"]
    constraints = venv / "constraints.txt"
    if reuse:
        # This interpreter's site-packages (also when it is itself a venv, which --system-site-packages would
        # not see) after the venv's own; torch stays the version found there.
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        # addsitedir, not plain path lines: the .pth files of those folders must run too
        dirs = base["site_dirs"]
        Path(site, "_gpu_check_base.pth").write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")
        constraints.write_text(f"torch=={base['torch']}\n")
    else:
        if not step("torch", pip + [TORCH_SPEC]):
            res["hint"] = "no CUDA torch here and none could be installed (offline? pass --wheels DIR)"
            return {**res, "status": "failed"}
        constraints.write_text("")
    full = not offline and step("project", pip + ["-c", str(constraints), "-e", ".[dev,cuda]"])
    res["dependencies"] = "all (.[dev,cuda])" if full else "those already there (--no-deps)"
    if not full:
        # Offline: the project itself, over what the reused site-packages (and --wheels) already hold.
        if wheels:
            step("wheels", pip + ["--no-index", "--no-deps"] + [str(w) for w in sorted(Path(wheels).glob("*.whl"))])
        if not step("project-no-deps", pip + ["--no-deps", "--no-build-isolation", "-e", "."]):
            return {**res, "status": "failed"}
    check = ("import importlib, json, torch\nmissing = []\nfor m in %r:\n    try:\n        importlib.import_module(m)\n"
             "    except Exception as e:\n        missing.append(f'{m}: {type(e).__name__}: {e}')\n"
             "print(json.dumps({'missing': missing, 'torch': torch.__version__, 'torch_cuda': torch.version.cuda,"
             " 'cuda_available': torch.cuda.is_available()}))" % NEEDED_MODULES)
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    try:
        res["venv"] = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        res["venv"] = {"missing": [f"venv python failed: {r.stderr[-500:]}"], "cuda_available": False}
    ok = not res["venv"]["missing"] and res["venv"]["cuda_available"]
    if ok:
        stamp.write_text(key)
    elif res["venv"]["missing"]:
        res["reason"] = "the venv lacks " + ", ".join(m.split(":")[0] for m in res["venv"]["missing"])
    else:
        res["reason"] = f"torch {res['venv'].get('torch')} in the venv sees no CUDA device"
    return {**res, "status": "ok" if ok else "failed"}


# ---------------------------------------------------------------- stages after install
def parity_stage(py: str, logs: Path, limit: float) -> dict:
    xml = logs / "parity.xml"
    r = run_stage("parity", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *PARITY_TESTS],
                  limit, logs, env={"PDCLUSTER_DEVICE": "cuda"})
    if xml.exists():
        cases = ET.parse(xml).getroot().iter("testcase")
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        failed = []
        for c in cases:
            kind = next((x.tag for x in c if x.tag in ("failure", "error", "skipped")), "passed")
            counts["skipped" if kind == "skipped" else "failed" if kind in ("failure", "error") else "passed"] += 1
            if kind in ("failure", "error"):
                failed.append(f"{c.get('classname')}::{c.get('name')}")
        r.update(counts, failed_tests=failed)
    return r


def benchmark_stage(py: str, logs: Path, limit: float) -> tuple[dict, dict]:
    r = run_stage("benchmark", [py, "benchmarks/offline_throughput.py", "--dtypes", "bf16", "--device", "cuda",
                                "--json"], limit, logs)
    target: dict = {"target": f"engine_vs_static >= {ENGINE_VS_STATIC_TARGET}", "met": False}
    data = last_json(r["log"]) if "log" in r else None
    if data:
        bf16 = data["results"][0]
        r["figures"] = {k: bf16.get(k) for k in ("engine_tok_s", "hf_static_tok_s", "hf_one_tok_s", "engine_vs_static",
                                                  "engine_decode_ms", "hf_decode_ms", "matmul_gflops",
                                                  "engine_mfu_vs_matmul", "greedy_identical")}
        r["workload"] = {k: data.get(k) for k in ("requests", "prompt_tokens", "output_tokens", "device",
                                                   "device_name")}
        ratio = bf16.get("engine_vs_static")
        target.update(value=ratio, met=ratio is not None and ratio >= ENGINE_VS_STATIC_TARGET)
    return r, target


def kv_stage(py: str, logs: Path, limit: float) -> dict:
    r = run_stage("kv_ipc", [py, "benchmarks/kv_cuda_ipc.py", "--json"], limit, logs)
    data = last_json(r["log"]) if "log" in r else None
    if data:
        r.update(bytes_equal=data.get("bytes_equal"), open_ms=data.get("open_ms"), writes=data.get("writes"),
                 error=data.get("error"))
    return r


# ---------------------------------------------------------------- report
def table(summary: dict) -> str:
    rows = [("stage", "status", "seconds", "result")]
    for name, s in summary["stages"].items():
        rows.append((name, s.get("status", "-"), str(s.get("seconds", "-")), _headline(name, s, summary)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:{widths[0]}}  {r[1]:{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows)


def _headline(name: str, s: dict, summary: dict) -> str:
    if s.get("status") == "skipped":
        return s.get("reason", "")
    if name == "probe":
        return s.get("gpu") or ", ".join(s.get("nvidia_smi_gpus") or []) or "no CUDA device"
    if name == "install":
        return ("venv reused" if s.get("reused_venv") else s.get("dependencies", "")) + \
            (", torch reused" if s.get("reused_torch") else "") + (f"; {s['reason']}" if s.get("reason") else "")
    if name == "device":
        return f"{s.get('gpu')} {s.get('memory_gib')} GiB, driver {s.get('driver')}, torch {s.get('torch')} " \
               f"(CUDA {s.get('torch_cuda')})" if s.get("gpu") else ""
    if name == "parity":
        return f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('skipped', 0)} skipped"
    if name == "benchmark" and s.get("figures"):
        f, t = s["figures"], summary["targets"]["benchmark"]
        return f"engine {f['engine_tok_s']} tok/s vs static {f['hf_static_tok_s']} = {f['engine_vs_static']}x " \
               f"(target >= {ENGINE_VS_STATIC_TARGET}: {'met' if t['met'] else 'MISSED'})"
    if name == "kv_ipc" and s.get("writes"):
        best = {w["method"]: w["gb_s"] for w in s["writes"] if w["blocks"] == max(x["blocks"] for x in s["writes"])}
        return f"bytes equal: {s.get('bytes_equal')}; GB/s " + ", ".join(f"{k} {v}" for k, v in best.items())
    return s.get("reason", "")


def write(summary: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(WORK / "gpu_check.json"), help="the JSON summary; logs go beside it")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole check")
    p.add_argument("--venv", default=str(WORK / "venv"))
    p.add_argument("--offline", action="store_true", help="no package index: reuse what is installed (+ --wheels)")
    p.add_argument("--wheels", help="a folder of wheels to install from (for machines without an index)")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget
    out = Path(args.out).resolve()
    logs = out.parent / "gpu_check_logs"
    shutil.rmtree(logs, ignore_errors=True)   # a rerun's logs and parity.xml are its own
    logs.mkdir(parents=True)
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "budget_s": args.budget,
                     "stages": {}, "targets": {}}
    t0 = time.monotonic()

    base = probe(sys.executable)
    summary["stages"]["probe"] = {"status": "ok" if base["cuda_device"] else "no_cuda_device", **base}
    summary["cuda_device"] = base["cuda_device"]
    if not base["cuda_device"]:
        summary.update(exit_code=EXIT_NO_DEVICE, seconds=round(time.monotonic() - t0, 1))
        write(summary, out)
        why = base.get("torch_error") or (f"torch {base.get('torch')} sees none" if base.get("torch") else "")
        print(f"gpu-check: no CUDA device ({why or 'no torch'}; nvidia-smi lists no GPU); nothing installed. "
              f"Summary: {out}. Exit {EXIT_NO_DEVICE}.", file=sys.stderr)
        return EXIT_NO_DEVICE

    keep = sum(STAGE_KEEP.values())
    t = time.monotonic()
    inst = install(base, Path(args.venv), logs, deadline - time.monotonic() - keep, args.offline, args.wheels)
    inst["seconds"] = round(time.monotonic() - t, 1)
    summary["stages"]["install"] = inst
    py = str(Path(args.venv) / "bin" / "python")
    later = ["device", "parity", "benchmark", "kv_ipc"]
    for i, name in enumerate(later):
        if inst["status"] != "ok":
            summary["stages"][name] = {"status": "skipped", "reason": "install failed"}
            continue
        left = deadline - time.monotonic() - sum(STAGE_KEEP[n] for n in later[i + 1:])
        limit = min(STAGE_LIMITS[name], left)
        if name == "device":
            r = run_stage("device", [py, "-c", DEVICE_INFO], limit, logs)
            if "log" in r:
                r.update(last_json(r["log"]) or {})
        elif name == "parity":
            r = parity_stage(py, logs, limit)
        elif name == "benchmark":
            r, summary["targets"]["benchmark"] = benchmark_stage(py, logs, limit)
        else:
            r = kv_stage(py, logs, limit)
        summary["stages"][name] = r
    summary.setdefault("targets", {}).setdefault("benchmark", {"target": f"engine_vs_static >= "
                                                               f"{ENGINE_VS_STATIC_TARGET}", "met": False})
    failed = [n for n, s in summary["stages"].items() if s["status"] not in ("ok", "skipped")]
    skipped = [n for n, s in summary["stages"].items() if s["status"] == "skipped"]
    missed = [n for n, t in summary["targets"].items() if not t["met"]]
    code = EXIT_OK if not failed and not skipped and not missed else EXIT_FAILED
    summary.update(failed_stages=failed, skipped_stages=skipped, missed_targets=missed, exit_code=code,
                   seconds=round(time.monotonic() - t0, 1))
    write(summary, out)
    print(table(summary))
    verdict = "all stages passed, targets met" if code == EXIT_OK else \
        f"FAILED (stages failed: {failed or '-'}, skipped: {skipped or '-'}, targets missed: {missed or '-'})"
    print(f"gpu-check: {verdict}; {summary['seconds']} s. Summary: {out}; logs: {logs}. Exit {code}.")
    return code


if __name__ == "__main__":
    sys.exit(main())
