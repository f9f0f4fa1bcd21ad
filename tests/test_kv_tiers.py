"""KV tiers below the pool (engine/kv_tiers.py): prefix blocks evicted from a small pool come back from host
memory or disk instead of being recomputed, with the same tokens; unreadable files, a full disk and aborted loads
fall back without wrong output or leaked blocks."""

from __future__ import annotations

import os
import subprocess
import threading
import zlib

import pytest
from engine_helpers import GREEDY, make_prompts, run_all

from pdcluster.control.block_hash import block_hashes
from pdcluster.engine.kv_tiers import HEADER, SUFFIX

BLOCK = 16
POOL_BLOCKS = 24          # 384 tokens: four 100-token prompts do not fit together
PROMPT = 100              # 6 full blocks the tiers can serve ((100 - 1) // 16)


def _engine(make_engine, model, **kw):
    return make_engine(model, block_size=BLOCK, num_gpu_blocks_override=POOL_BLOCKS, **kw)


def _evict_then_rerun(engine, prompts):
    """Run prompt 0, then the others (pushing prompt 0's blocks out of the pool), then prompt 0 again. Returns
    (first tokens, rerun tokens, prompt tokens the rerun computed)."""
    first = run_all(engine, prompts[:1], GREEDY, prefix="first")[0]
    run_all(engine, prompts[1:], GREEDY, prefix="other")
    assert len(engine.scheduler.block_manager.match_prefix(_probe(engine, prompts[0]))) < PROMPT // BLOCK, \
        "the pool still holds the whole prefix: nothing to load"
    before = engine.get_stats().num_prefill_tokens
    again = run_all(engine, prompts[:1], GREEDY, prefix="again")[0]
    return first, again, engine.get_stats().num_prefill_tokens - before


def _probe(engine, prompt):
    from pdcluster.engine.sequence import Sequence

    return Sequence("probe", prompt, GREEDY, [], 10_000, 0)


def _prompts(seed=0):
    return make_prompts([PROMPT, PROMPT, PROMPT, PROMPT], seed=seed)


def test_evicted_prefix_comes_back_from_host_memory(make_engine, tiny_llama):
    engine = _engine(make_engine, tiny_llama, kv_offload_host_bytes="64MiB")
    first, again, computed = _evict_then_rerun(engine, _prompts())
    stats = engine.get_stats()
    assert again == first
    assert stats.kv_tier_loaded_host_blocks >= 4 and stats.kv_tier_failed_loads == 0
    assert computed == PROMPT - 6 * BLOCK            # only the tail after the six loaded blocks
    assert stats.kv_tier_stored_blocks >= 4 * 6 and stats.kv_tier_host_blocks == stats.kv_tier_stored_blocks


def test_same_tokens_as_without_tiers_and_as_transformers(make_engine, tiny_qwen2):
    from engine_helpers import hf_greedy

    prompts = _prompts(seed=1)
    plain = run_all(_engine(make_engine, tiny_qwen2), prompts + prompts[:1], GREEDY)
    engine = _engine(make_engine, tiny_qwen2, kv_offload_host_bytes="64MiB")
    first, again, _ = _evict_then_rerun(engine, prompts)
    assert first == again == plain[0] == hf_greedy(tiny_qwen2, prompts[:1], GREEDY.max_tokens)[0]
    assert engine.get_stats().kv_tier_loaded_host_blocks > 0


def test_host_overflow_goes_to_disk_and_comes_back(make_engine, tiny_llama, tmp_path):
    engine = _engine(make_engine, tiny_llama, kv_offload_host_bytes=1,   # every block moves on to disk
                     kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="64MiB")
    first, again, computed = _evict_then_rerun(engine, _prompts())
    stats = engine.get_stats()
    assert again == first and computed == PROMPT - 6 * BLOCK
    assert stats.kv_tier_loaded_disk_blocks >= 4 and stats.kv_tier_loaded_host_blocks == 0
    files = list(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) == stats.kv_tier_disk_blocks == stats.kv_tier_disk_writes
    block_bytes = engine.kv_pool.block_bytes
    assert all(f.stat().st_size == HEADER.size + block_bytes for f in files)


def _disk_engine(make_engine, model, path, **kw):
    return _engine(make_engine, model, kv_offload_host_bytes=1, kv_offload_disk_path=str(path),
                   kv_offload_disk_bytes="64MiB", **kw)


def test_disk_tier_is_bounded(make_engine, tiny_llama, tmp_path):
    engine = _disk_engine(make_engine, tiny_llama, tmp_path)
    engine.tiers.disk.capacity = cap = 5 * (HEADER.size + engine.kv_pool.block_bytes)
    run_all(engine, _prompts(), GREEDY)
    used = sum(f.stat().st_size for f in tmp_path.glob(f"*{SUFFIX}"))
    assert 0 < used <= cap and engine.tiers.stats.disk_evictions > 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "other-layout"])
def test_unreadable_disk_block_is_recomputed(make_engine, tiny_llama, tmp_path, damage):
    prompts = _prompts()
    engine = _disk_engine(make_engine, tiny_llama, tmp_path)
    first = run_all(engine, prompts[:1], GREEDY, prefix="first")[0]
    run_all(engine, prompts[1:], GREEDY, prefix="other")
    third = tmp_path / f"{block_hashes(prompts[0], BLOCK, engine.hash_seed)[2]:016x}{SUFFIX}"
    data = bytearray(third.read_bytes())
    if damage == "flip":
        data[HEADER.size + 100] ^= 0x40
        third.write_bytes(bytes(data))
    elif damage == "truncate":
        third.write_bytes(bytes(data[:len(data) // 2]))
    elif damage == "other-layout":   # a valid file of the same hash written under another layout key
        magic, version, h, key, size, crc = HEADER.unpack_from(data)
        third.write_bytes(HEADER.pack(magic, version, h, key ^ 1, size, crc) + bytes(data[HEADER.size:]))
    else:
        third.unlink()
    before = engine.get_stats()
    again = run_all(engine, prompts[:1], GREEDY, prefix="again")[0]
    after = engine.get_stats()
    assert again == first
    assert after.kv_tier_failed_loads - before.kv_tier_failed_loads == 1
    assert after.kv_tier_loaded_disk_blocks - before.kv_tier_loaded_disk_blocks == 2
    assert after.num_prefill_tokens - before.num_prefill_tokens == PROMPT - 2 * BLOCK   # from the bad block on
    written = third.read_bytes()   # deleted, then written again from the recomputed block
    assert len(written) == HEADER.size + engine.kv_pool.block_bytes
    assert zlib.crc32(written[HEADER.size:]) == HEADER.unpack_from(written)[-1]


def test_blocks_of_another_model_never_match(make_engine, tiny_llama, tiny_qwen2, tmp_path):
    """The same tokens hash differently under another model (the engine's hash seed), so another model's files
    in the directory are never even looked at; a file under another layout key is refused when read (above)."""
    prompts = _prompts()
    run_all(_disk_engine(make_engine, tiny_llama, tmp_path), prompts, GREEDY)
    cold = run_all(_engine(make_engine, tiny_qwen2), prompts[:1], GREEDY)
    engine = _disk_engine(make_engine, tiny_qwen2, tmp_path)   # indexes llama's files
    assert engine.get_stats().kv_tier_disk_blocks > 0
    assert run_all(engine, prompts[:1], GREEDY) == cold
    stats = engine.get_stats()
    assert stats.kv_tier_failed_loads == 0 and stats.kv_tier_loaded_disk_blocks == 0


def test_restarted_engine_reuses_its_disk_tier(make_engine, tiny_llama, tmp_path):
    prompts = _prompts()
    first = run_all(_disk_engine(make_engine, tiny_llama, tmp_path), prompts[:1], GREEDY)
    engine = _disk_engine(make_engine, tiny_llama, tmp_path)
    assert run_all(engine, prompts[:1], GREEDY) == first
    assert engine.get_stats().kv_tier_loaded_disk_blocks == PROMPT // BLOCK


def test_disk_full_turns_the_disk_tier_off(make_engine, tiny_llama, tmp_path, caplog):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        prompts = _prompts()
        plain = run_all(_engine(make_engine, tiny_llama), prompts, GREEDY)
        engine = _disk_engine(make_engine, tiny_llama, mount)
        assert run_all(engine, prompts, GREEDY) == plain
        stats = engine.get_stats()
        assert stats.kv_tier_disk_disabled and stats.kv_tier_disk_blocks == 0
        assert "turned off" in caplog.text
        assert engine.tiers.disk is None
        assert run_all(engine, prompts[:1], GREEDY, prefix="after") == plain[:1]   # serving goes on
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_missing_directory_turns_the_disk_tier_off(make_engine, tiny_llama, tmp_path):
    path = tmp_path / "tier"
    engine = _disk_engine(make_engine, tiny_llama, path)
    os.rmdir(path)   # every write now fails with ENOENT
    prompts = _prompts()
    assert run_all(engine, prompts, GREEDY) == run_all(_engine(make_engine, tiny_llama), prompts, GREEDY)
    assert engine.get_stats().kv_tier_disk_disabled


def test_abort_while_loading_leaks_nothing(make_engine, tiny_llama):
    prompts = _prompts()
    engine = _engine(make_engine, tiny_llama, kv_offload_host_bytes="64MiB")
    run_all(engine, prompts, GREEDY)
    gate, load = threading.Event(), engine.tiers._load
    engine.tiers._load = lambda job: (gate.wait(10), load(job))   # the copy is under way while we abort
    engine.add_request("again", prompts[0], GREEDY)
    engine.step()
    assert engine.get_stats().num_loading_kv == 1 and "again" in engine.scheduler.loading
    engine.abort("again")
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_loading_kv == 0 and not engine.scheduler.loading


def test_loads_and_ordinary_requests_share_steps(make_engine, tiny_llama):
    """A batch where some prompts load from the host tier while others prefill and decode."""
    prompts = _prompts() + make_prompts([40, 70], seed=9)
    plain = run_all(_engine(make_engine, tiny_llama), prompts, GREEDY)
    engine = _engine(make_engine, tiny_llama, kv_offload_host_bytes="64MiB")
    assert run_all(engine, prompts[:4], GREEDY, prefix="a") == plain[:4]
    assert run_all(engine, prompts[::-1], GREEDY, prefix="b") == plain[::-1]
    assert engine.get_stats().kv_tier_loaded_host_blocks > 0


@pytest.mark.parametrize("kw,match", [
    (dict(kv_offload_disk_path="/tmp/x"), "needs both"),
    (dict(kv_offload_disk_bytes="1GiB"), "needs both"),
    (dict(kv_offload_host_bytes=-1), "must be >= 0"),
])
def test_bad_tier_settings_are_refused(tiny_llama, kw, match):
    from pdcluster.engine.args import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(model=tiny_llama, **kw)


def test_tiers_refuse_a_pool_without_prefix_caching(tiny_llama):
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLMEngine(EngineArgs(model=tiny_llama, num_gpu_blocks_override=32, enable_prefix_caching=False,
                             kv_offload_host_bytes="1MiB"))


def _reality(engine) -> list[set[int]]:
    """The hashes each tier holds right now: pool (published blocks), host, disk."""
    tiers = engine.tiers
    return [set(engine.scheduler.block_manager.hash_to_block), set(tiers.host.entries),
            set(tiers.disk.sizes) if tiers.disk is not None else set()]


def _indexed(index) -> list[set[int]]:
    return [{h for h, held in index.tiers.items() if held >> t & 1} for t in range(3)]


def test_kv_events_rebuild_every_tier_exactly(make_engine, tiny_llama, tmp_path):
    """A router-side index fed only with the engine's events (a snapshot first, then deltas) holds exactly what
    each tier holds, through publishing, pool evictions, host -> disk moves, disk evictions and loads."""
    from pdcluster.router.prefix_index import PrefixIndex

    engine = _engine(make_engine, tiny_llama, kv_offload_host_bytes=4 * 49152,
                     kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="64MiB")
    engine.tiers.disk.capacity = 20 * (HEADER.size + engine.kv_pool.block_bytes)
    index, seq = PrefixIndex(), 0

    def sync():
        nonlocal seq
        while engine.tiers.busy:   # let the tiers' copies land
            engine.step()
        events, snapshot = engine.kv_events()
        seq += 1
        index.apply(seq, events, snapshot)

    sync()
    prompts = _prompts() + make_prompts([PROMPT] * 3, seed=5)
    for round_, batch in enumerate([prompts[:4], prompts[1:5], prompts[2:6], prompts[6:]]):
        run_all(engine, batch, GREEDY, prefix=f"r{round_}-")
        sync()
        assert _indexed(index) == _reality(engine), f"round {round_}"
    stats = engine.tiers.stats
    assert stats.disk_evictions > 0 and stats.host_evictions > 0 and stats.loaded_host_blocks > 0
    assert not index.stale and index.counts == [len(t) for t in _reality(engine)]


def test_kv_events_overflow_turns_into_a_snapshot(make_engine, tiny_llama):
    from pdcluster.engine.kv_events import KVEventLog
    from pdcluster.router.prefix_index import PrefixIndex

    engine = _engine(make_engine, tiny_llama, kv_offload_host_bytes="64MiB")
    events, snapshot = engine.kv_events()
    assert snapshot and events == []                   # the first call: nothing held yet
    engine.scheduler.block_manager.events = engine.tiers.events = KVEventLog(limit=5)
    run_all(engine, _prompts(), GREEDY)
    while engine.tiers.busy:
        engine.step()
    events, snapshot = engine.kv_events()
    assert snapshot, "more than 5 events waited: the reader gets a snapshot"
    index = PrefixIndex()
    index.apply(1, events, snapshot)
    assert _indexed(index)[:2] == _reality(engine)[:2]
    assert engine.kv_events() == ([], False)         # nothing happened since
