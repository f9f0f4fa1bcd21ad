"""SharedWeightPool: engines of one host share one read-only copy of each weight tensor, in this process
(the same storage) and across processes (the same /dev/shm file mapped by both); identical tensors are
stored once; a model that does not fit is refused with the sizes; a write into a shared weight faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

import pdcluster.engine
from pdcluster import SamplingParams, SharedWeightPool
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.weight_pool import POOL_PREFIX, SHM_DIR, WeightPoolFull, sweep_dead_weight_pools

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def pool():
    with SharedWeightPool(size="64MiB", name=f"test-{uuid.uuid4().hex[:8]}") as p:
        yield p
    assert not os.path.exists(p.path), "pool directory left behind"


def engine(model: str, **kw):
    from pdcluster.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=model, num_gpu_blocks_override=32, **kw))


def generate(e, prompt=(1, 2, 3, 4, 5)) -> list[int]:
    e.add_request("r", list(prompt), GREEDY)
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            out = o
    return out.outputs[0].token_ids


def params(e) -> dict:
    return dict(e.runner.model.named_parameters(remove_duplicate=False))


def pool_mappings(pid: int, pool_path: str) -> dict[str, dict[str, int | str]]:
    """The process's mappings of the pool's blobs: path -> {perms, Rss, Pss} (kB) from /proc/<pid>/smaps."""
    out: dict[str, dict] = {}
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:
                path = parts[5] if len(parts) > 5 else ""
                current = out.setdefault(path, {"perms": parts[1], "Rss": 0, "Pss": 0}) \
                    if path.startswith(pool_path + "/blobs/") else None
            elif current is not None and parts[0] in ("Rss:", "Pss:"):
                current[parts[0][:-1]] += int(parts[1])
    return out


def test_two_engines_of_one_model_share_the_same_read_only_storage(tiny_llama, pool):
    assert pdcluster.engine.SharedWeightPool is SharedWeightPool
    first, second = engine(tiny_llama, weight_pool=pool), engine(tiny_llama, weight_pool=pool)
    private = engine(tiny_llama)
    p1, p2 = params(first), params(second)
    assert p1.keys() == p2.keys()
    assert all(p1[k].data_ptr() == p2[k].data_ptr() for k in p1)
    assert not any(p1[k].data_ptr() == t.data_ptr() for k, t in params(private).items())
    assert generate(first) == generate(second) == generate(private)
    distinct = {t.data_ptr(): t.numel() * t.element_size() for t in p1.values()}
    assert pool.used_bytes == sum(distinct.values()) and pool.models() == [os.path.realpath(tiny_llama)]
    maps = pool_mappings(os.getpid(), pool.path)
    assert len(maps) == len(os.listdir(os.path.join(pool.path, "blobs")))
    assert {m["perms"] for m in maps.values()} == {"r--s"}, "shared weights must be mapped read-only"


def test_identical_tensors_are_stored_once(tiny_qwen2, pool):
    e = engine(tiny_qwen2, weight_pool=pool)
    p = params(e)
    assert p["model.embed_tokens.weight"].data_ptr() == p["lm_head.weight"].data_ptr()   # tied
    norms = [p[f"model.layers.{i}.input_layernorm.weight"] for i in range(2)]
    assert norms[0].equal(norms[1]) and norms[0].data_ptr() == norms[1].data_ptr()   # equal content (init: ones)
    distinct = {t.data_ptr(): t.numel() * t.element_size() for t in p.values()}
    assert pool.used_bytes == sum(distinct.values()) < sum(t.numel() * t.element_size() for t in p.values())
    assert len(os.listdir(os.path.join(pool.path, "blobs"))) == len(distinct)


def test_a_second_model_fits_while_there_is_room_and_then_is_refused(tiny_llama, tiny_qwen2, pool):
    engine(tiny_llama, weight_pool=pool)
    llama = pool.used_bytes
    e = engine(tiny_qwen2, weight_pool=pool)
    both = pool.used_bytes
    assert both > llama and len(pool.models()) == 2
    assert generate(e) == generate(engine(tiny_qwen2))
    with SharedWeightPool(size=both - 1, name=f"small-{uuid.uuid4().hex[:8]}") as small:
        engine(tiny_llama, weight_pool=small)
        with pytest.raises(WeightPoolFull) as info:
            engine(tiny_qwen2, weight_pool=small)
        message = str(info.value)
        assert f"needs {(both - llama) / 2**30:.2f} GiB ({both - llama} bytes) more" in message
        assert f"({both - 1 - llama} bytes) free of" in message and small.name in message
        assert small.used_bytes == llama and len(small.models()) == 1, "a refused model left tensors behind"


def test_a_config_names_the_pool_as_name_and_size(tiny_llama):
    name = f"spec-{uuid.uuid4().hex[:8]}"
    first, second = engine(tiny_llama, weight_pool=f"{name}:32MiB"), engine(tiny_llama, weight_pool=f"{name}:32MiB")
    assert first.weight_pool is second.weight_pool and first.weight_pool.size == 32 << 20
    assert params(first)["model.norm.weight"].data_ptr() == params(second)["model.norm.weight"].data_ptr()
    with pytest.raises(ValueError, match="in use with size"):
        SharedWeightPool(size="16MiB", name=name)
    first.weight_pool.close()
    assert not os.path.exists(first.weight_pool.path)
    for bad in ("a/b", ":4GiB", "x:lots", ""):
        with pytest.raises(ValueError, match="weight_pool|byte size"):
            EngineArgs(model="/m", weight_pool=bad)


def test_a_pool_named_without_size_takes_the_size_in_use(tiny_llama, pool):
    e = engine(tiny_llama, weight_pool=pool.name)
    assert e.weight_pool is not pool and e.weight_pool.size == pool.size
    assert params(e)["model.norm.weight"].data_ptr() != 0 and pool.used_bytes > 0
    e.weight_pool.close()
    assert os.path.isdir(pool.path), "the pool's other user is still here"


CHILD = textwrap.dedent("""
    import sys
    from pdcluster import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine
    model, spec, action = sys.argv[1:4]
    e = LLMEngine(EngineArgs(model=model, weight_pool=spec, num_gpu_blocks_override=32))
    if action == "write":
        next(e.runner.model.parameters()).data.add_(1.0)
        print("wrote", flush=True)
        sys.exit(0)
    e.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    print("ready", flush=True)
    sys.stdin.read()
""")


def child(model: str, spec: str, action: str = "serve") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": ""}
    return subprocess.Popen([sys.executable, "-c", CHILD, model, spec, action], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_two_processes_map_the_same_pages(tiny_llama):
    spec = f"xproc-{uuid.uuid4().hex[:8]}:64MiB"
    path = os.path.join(SHM_DIR, POOL_PREFIX + spec.split(":")[0])
    procs = [child(tiny_llama, spec) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        blobs = {os.path.join(path, "blobs", b) for b in os.listdir(os.path.join(path, "blobs"))}
        maps = [pool_mappings(p.pid, path) for p in procs]
        assert set(maps[0]) == set(maps[1]) == blobs, "both processes map every blob of the one pool"
        for m in maps:
            rss, pss = sum(v["Rss"] for v in m.values()), sum(v["Pss"] for v in m.values())
            assert rss > 0 and pss < 0.75 * rss, f"weight pages not shared: Pss {pss} kB of Rss {rss} kB"
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            assert p.wait(60) == 0, p.stderr.read()
    assert not os.path.exists(path), "the last process to leave must remove the pool"


@pytest.mark.slow
def test_writing_into_a_shared_weight_faults_instead_of_corrupting(tiny_llama):
    name = f"ro-{uuid.uuid4().hex[:8]}"
    pool = SharedWeightPool(size="64MiB", name=name)
    try:
        mine = engine(tiny_llama, weight_pool=pool)
        before = next(mine.runner.model.parameters()).clone()
        p = child(tiny_llama, f"{name}:64MiB", "write")
        out, err = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGSEGV and "wrote" not in out, (p.returncode, err[-2000:])
        assert next(mine.runner.model.parameters()).equal(before)
    finally:
        pool.close()
    assert not os.path.exists(pool.path)


def test_pools_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{POOL_PREFIX}stale"
    (stale / "users").mkdir(parents=True)
    (stale / "users" / dead.stdout.strip()).touch()
    live = SharedWeightPool(size="1MiB", name="live", directory=str(tmp_path))
    try:
        assert sweep_dead_weight_pools(str(tmp_path)) == [stale.name]
        assert not stale.exists() and os.path.isdir(live.path)
    finally:
        live.close()
    assert not os.path.exists(live.path)


def test_shared_weights_are_cpu_only(tiny_llama, pool):
    import torch

    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.loader import load_model

    with pytest.raises(ValueError, match="CPU-only"):
        load_model(tiny_llama, ModelConfig.from_pretrained(tiny_llama), torch.float32, torch.device("cuda", 0), None,
                   weight_pool=pool)
