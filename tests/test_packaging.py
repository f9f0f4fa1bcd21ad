"""The installable shape: one top-level package, a torch-free public API and router."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("engine", "kv_transfer", "router", "prefill_node", "decode_node")


def run_python(code: str, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_wheel_holds_only_the_pdcluster_package_and_installs_without_the_old_names(tmp_path):
    # Build from a copy: setuptools' build/ folder in the checkout may hold modules deleted since.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("pdcluster-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"pdcluster"}
    for room in ROOMS:
        assert f"pdcluster/{room}/__init__.py" in names
    for source in ("paged_decode.c", "paged_prefill.c", "paged_simd.h"):   # compiled on first use, must ship
        assert f"pdcluster/engine/attention/{source}" in names

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    probe = ("import importlib.util, pdcluster, pdcluster.engine.llm_engine, pdcluster.router.app\n"
             f"missing = [m for m in {ROOMS!r} if importlib.util.find_spec(m) is None]\n"
             f"assert missing == list({ROOMS!r}), missing\n"
             "print(pdcluster.__file__)")
    out = run_python(probe, cwd=tmp_path, pythonpath=str(site))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(site / "pdcluster" / "__init__.py")


@pytest.mark.slow
def test_public_api_and_router_import_without_torch(tmp_path):
    probe = ("import sys\n"
             "from pdcluster import LLM, SamplingParams, EngineArgs, AsyncEngineArgs, AsyncLLMEngine\n"
             "import pdcluster.router.app, pdcluster.router.server, pdcluster.control.cluster_view\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    out = run_python(probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_router_tokenizes_and_answers_without_importing_torch(tmp_path, tiny_llama):
    probe = ("import sys\n"
             "from fastapi.testclient import TestClient\n"
             "from pdcluster.router.app import create_app\n"
             "from pdcluster.router.cluster import StaticNodeSource\n"
             "from pdcluster.router.settings import RouterSettings\n"
             f"app = create_app(RouterSettings(model={tiny_llama!r}, served_model_name='m'), StaticNodeSource())\n"
             "with TestClient(app) as http:\n"
             "    r = http.post('/v1/chat/completions', json={'model': 'm', 'max_tokens': 4,\n"
             "                  'messages': [{'role': 'user', 'content': 'hello'}]})\n"
             "assert r.status_code == 503 and r.json()['error'], r.text\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    out = run_python(probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
