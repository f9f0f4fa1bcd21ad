"""`make gpu-check` (benchmarks/gpu_check.py) on a machine without a GPU: it stops at once with exit 3 and a JSON
that says so, installing nothing; its summary logic over canned stage outputs; the KV IPC check's plumbing and
byte comparison over shared host memory (benchmarks/kv_cuda_ipc.py --device cpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import kv_cuda_ipc  # noqa: E402


def test_no_cuda_device_stops_before_installing_with_exit_3(tmp_path):
    out, venv = tmp_path / "gpu_check.json", tmp_path / "venv"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}      # no GPU here, and none seen on a GPU box either
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out),
                        "--venv", str(venv)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == gpu_check.EXIT_NO_DEVICE == 3, r.stderr
    assert "no CUDA device" in r.stderr and "Exit 3" in r.stderr
    summary = json.loads(out.read_text())
    assert summary["cuda_device"] is False and summary["exit_code"] == 3
    assert summary["stages"]["probe"]["status"] == "no_cuda_device"
    assert summary["stages"]["probe"]["python"] == sys.executable
    assert list(summary["stages"]) == ["probe"]
    assert not venv.exists()


def _fake_stages(monkeypatch, ratio: float, bytes_equal: bool = True, failed_test: bool = False) -> None:
    """probe finds a GPU, install succeeds, and every stage's subprocess is replaced by a canned log."""
    monkeypatch.setattr(gpu_check, "probe", lambda py: {"python": py, "cuda_available": True, "cuda_device": True,
                                                         "gpu": "Fake GPU"})
    monkeypatch.setattr(gpu_check, "install", lambda *a, **k: {"status": "ok", "reused_venv": True})
    outputs = {
        "device": {"gpu": "Fake GPU", "memory_gib": 80.0, "driver": "1.2", "torch": "2.x", "torch_cuda": "13.0"},
        "benchmark": {"requests": 128, "prompt_tokens": 1, "output_tokens": 2, "device": "cuda:0",
                      "device_name": "Fake GPU",
                      "results": [{"dtype": "bf16", "engine_tok_s": 100.0 * ratio, "hf_static_tok_s": 100.0,
                                   "engine_vs_static": ratio}]},
        "kv_ipc": {"bytes_equal": bytes_equal, "open_ms": 1.0,
                   "writes": [{"method": "contiguous", "blocks": 16, "gb_s": 900.0, "bytes_equal": bytes_equal}]},
    }

    def run_stage(name, cmd, limit, logs, env=None):
        log = logs / f"{name}.log"
        ok = True
        if name == "parity":
            assert env == {"PDCLUSTER_DEVICE": "cuda"} and cmd[-len(gpu_check.PARITY_TESTS):] == gpu_check.PARITY_TESTS
            fail = '<failure message="x"/>' if failed_test else ""
            (logs / "parity.xml").write_text(
                f'<testsuites><testsuite><testcase classname="tests.t" name="a"/>'
                f'<testcase classname="tests.t" name="b">{fail}</testcase></testsuite></testsuites>')
            ok = not failed_test
        else:
            log.write_text("progress\n" + json.dumps(outputs[name]) + "\n")
            ok = name != "kv_ipc" or bytes_equal
        return {"status": "ok" if ok else "failed", "rc": 0 if ok else 1, "seconds": 0.1, "log": str(log)}

    monkeypatch.setattr(gpu_check, "run_stage", run_stage)


def test_summary_over_passing_stages_exits_0(tmp_path, monkeypatch, capsys):
    _fake_stages(monkeypatch, ratio=5.0)
    out = tmp_path / "s.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["exit_code"] == 0 and s["failed_stages"] == [] and s["missed_targets"] == []
    assert s["stages"]["device"]["gpu"] == "Fake GPU"
    assert s["stages"]["parity"]["passed"] == 2 and s["stages"]["parity"]["failed"] == 0
    assert s["stages"]["benchmark"]["figures"]["engine_vs_static"] == 5.0
    assert s["targets"]["benchmark"] == {"target": "engine_vs_static >= 3.0", "met": True, "value": 5.0}
    assert s["stages"]["kv_ipc"]["bytes_equal"] is True
    printed = capsys.readouterr().out
    assert "500.0 tok/s vs static 100.0 = 5.0x (target >= 3.0: met)" in printed and "Exit 0" in printed


def test_summary_names_failed_tests_missed_target_and_byte_mismatch(tmp_path, monkeypatch, capsys):
    _fake_stages(monkeypatch, ratio=2.0, bytes_equal=False, failed_test=True)
    out = tmp_path / "s.json"
    assert gpu_check.main(["--out", str(out)]) == gpu_check.EXIT_FAILED == 1
    s = json.loads(out.read_text())
    assert s["failed_stages"] == ["parity", "kv_ipc"] and s["missed_targets"] == ["benchmark"]
    assert s["stages"]["parity"]["failed_tests"] == ["tests.t::b"]
    assert s["targets"]["benchmark"]["met"] is False and s["stages"]["kv_ipc"]["bytes_equal"] is False
    assert "MISSED" in capsys.readouterr().out


@pytest.mark.slow   # spawns a process that imports torch
def test_kv_ipc_plumbing_moves_every_byte_over_shared_host_memory():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_cuda_ipc.py"), "--device", "cpu",
                        "--sizes", "2,3", "--repeats", "1", "--json"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["bytes_equal"] is True and res["untouched_blocks_zero"] is True
    assert [(w["method"], w["blocks"]) for w in res["writes"]] == [(m, n) for n in (2, 3) for m in kv_cuda_ipc.METHODS]
    assert all(w["bytes_equal"] for w in res["writes"])


@pytest.mark.slow
def test_kv_ipc_check_sees_one_changed_element():
    res = kv_cuda_ipc.run([2], repeats=1, device="cpu", tamper=True)
    assert res["bytes_equal"] is False
    assert [w["bytes_equal"] for w in res["writes"]] == [True, True, False]   # the per_block write was changed
