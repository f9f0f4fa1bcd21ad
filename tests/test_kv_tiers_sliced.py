"""KV tiers of a pool sliced per tensor-parallel rank (engine/rank_tiers.py): at TP = 2 with `kv_pool_per_rank`
each rank stores and loads its own slice of the same blocks, rank 0's tiers deciding for both. Prefixes pushed
out of the pool come back from host memory and from disk with the tokens of TP = 1 without tiers, only the tail
recomputed; a damaged or deleted file on rank 1 alone ends the load at that block for both ranks; no block stays
pinned; each rank's files are its own (own directory, a layout key naming its slice)."""

from __future__ import annotations

import time
import zlib

import pytest
from engine_helpers import GREEDY, make_prompts, run_all

from pdcluster.control.block_hash import block_hashes
from pdcluster.engine.kv_tiers import HEADER, SUFFIX, layout_key

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
POOL_BLOCKS = 24          # per rank; 384 tokens: four 100-token prompts do not fit together
PROMPT = 100              # 6 full blocks the tiers can serve ((100 - 1) // 16)
ARGS = dict(dtype="float32", device="cpu", block_size=BLOCK, num_gpu_blocks_override=POOL_BLOCKS)
RANKS = ("rank0-of-2", "rank1-of-2")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("gqa")), "llama", num_attention_heads=8,
                           num_key_value_heads=4, hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts([PROMPT] * 4, seed=3)


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[list[int]]:
    """TP = 1, no tiers."""
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, **ARGS))
    try:
        return run_all(engine, prompts, GREEDY)
    finally:
        engine.shutdown()


def _sliced(make_engine, model, **tiers):
    engine = make_engine(model, tensor_parallel_size=2, kv_pool_per_rank=True, **ARGS, **tiers)
    assert engine.rank_sliced_pool
    return engine


def _settle(engine, until=lambda: True, timeout: float = 20.0) -> None:
    """Step until no copy is in flight on any rank and `until()` (the ranks hear the moves rank 0's index made
    at the next step)."""
    deadline = time.monotonic() + timeout
    while engine.tiers.busy or not until():
        assert time.monotonic() < deadline, "the tiers did not settle"
        engine.step()
        time.sleep(0.005)


def _evict_then_rerun(engine, prompts, damage=lambda: None):
    """Run prompt 0, then the others (pushing prompt 0's blocks out of the pool), `damage()`, then prompt 0 again.
    Returns (first and other outputs, rerun output, stats before the rerun, stats after)."""
    from pdcluster.engine.sequence import Sequence

    outputs = run_all(engine, prompts[:1], GREEDY, prefix="first") + run_all(engine, prompts[1:], GREEDY,
                                                                             prefix="other")
    probe = Sequence("probe", prompts[0], GREEDY, [], 10_000, 0)
    assert len(engine.scheduler.block_manager.match_prefix(probe)) < PROMPT // BLOCK, "nothing to load"
    _settle(engine)
    damage()
    before = engine.get_stats()
    again = run_all(engine, prompts[:1], GREEDY, prefix="again")[0]
    _settle(engine)
    return outputs, again, before, engine.get_stats()


def _no_block_held(engine) -> None:
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_loading_kv == 0
    assert all(c == 0 for c in engine.scheduler.block_manager.ref_counts), "a block stays pinned"


def _files(path, rank: int) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in (path / RANKS[rank]).glob(f"*{SUFFIX}")}


def _mirrored(path) -> bool:
    """Rank 1's files are rank 0's blocks (same names), every one complete."""
    names = [set(_files(path, r)) for r in (0, 1)]
    return bool(names[0]) and names[0] == names[1]


def test_evicted_prefix_comes_back_from_every_ranks_host_memory(make_engine, model, prompts, reference):
    engine = _sliced(make_engine, model, kv_offload_host_bytes="64MiB")
    assert engine.tiers.host.capacity == (64 << 20) // 2   # the knob divided by the slices
    outputs, again, before, after = _evict_then_rerun(engine, prompts)
    assert outputs == reference and again == reference[0]
    assert after.num_prefill_tokens - before.num_prefill_tokens == PROMPT - 6 * BLOCK   # only the tail after six
    assert after.kv_tier_loaded_host_blocks - before.kv_tier_loaded_host_blocks == 6
    assert after.kv_tier_failed_loads == 0 and after.kv_tier_stored_blocks >= 4 * 6
    _no_block_held(engine)


def test_evicted_prefix_comes_back_from_every_ranks_disk(make_engine, model, prompts, reference, tmp_path):
    engine = _sliced(make_engine, model, kv_offload_host_bytes=1,   # every block moves on to disk
                     kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="64MiB")
    outputs, again, before, after = _evict_then_rerun(engine, prompts, lambda: _settle(
        engine, lambda: _mirrored(tmp_path)))
    assert outputs == reference and again == reference[0]
    assert after.num_prefill_tokens - before.num_prefill_tokens == PROMPT - 6 * BLOCK
    assert after.kv_tier_loaded_disk_blocks - before.kv_tier_loaded_disk_blocks == 6
    assert after.kv_tier_loaded_host_blocks == after.kv_tier_failed_loads == 0
    _no_block_held(engine)
    _settle(engine, lambda: _mirrored(tmp_path))
    # each rank's own directory, nothing beside; the same blocks, each file its rank's slice under its own key
    assert sorted(p.name for p in tmp_path.iterdir()) == list(RANKS)
    files = [_files(tmp_path, r) for r in (0, 1)]
    assert set(files[0]) == set(files[1]) and len(files[0]) == after.kv_tier_disk_blocks == after.kv_tier_disk_writes
    for rank in (0, 1):
        key = layout_key(engine.hash_seed, engine.kv_pool, (rank, 2))
        for data in files[rank].values():
            assert len(data) == HEADER.size + engine.kv_pool.block_bytes
            assert HEADER.unpack_from(data)[3] == key
    assert layout_key(engine.hash_seed, engine.kv_pool, (0, 2)) != layout_key(engine.hash_seed, engine.kv_pool,
                                                                                (1, 2))
    name = next(iter(files[0]))
    assert files[0][name][HEADER.size:] != files[1][name][HEADER.size:]   # the two halves of the block's heads


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_bad_file_on_one_rank_ends_the_load_there_for_every_rank(make_engine, model, prompts, reference, tmp_path,
                                                                    damage):
    engine = _sliced(make_engine, model, kv_offload_host_bytes=1, kv_offload_disk_path=str(tmp_path),
                     kv_offload_disk_bytes="64MiB")
    third = tmp_path / RANKS[1] / f"{block_hashes(prompts[0], BLOCK, engine.hash_seed)[2]:016x}{SUFFIX}"
    intact = tmp_path / RANKS[0] / third.name

    def spoil():
        _settle(engine, lambda: _mirrored(tmp_path))
        if damage == "flip":
            data = bytearray(third.read_bytes())
            data[HEADER.size + 100] ^= 0x40
            third.write_bytes(bytes(data))
        else:
            third.unlink()

    outputs, again, before, after = _evict_then_rerun(engine, prompts, spoil)
    assert outputs == reference and again == reference[0]   # recomputed, never read wrong
    assert after.kv_tier_failed_loads - before.kv_tier_failed_loads == 1
    assert after.num_prefill_tokens - before.num_prefill_tokens == PROMPT - 2 * BLOCK   # from the bad block on
    _no_block_held(engine)
    # the block left both ranks' tiers, then came back from its recomputation: both files whole again
    _settle(engine, lambda: third.exists() and intact.exists())
    for f, rank in ((intact, 0), (third, 1)):
        data = f.read_bytes()
        assert len(data) == HEADER.size + engine.kv_pool.block_bytes
        assert zlib.crc32(data[HEADER.size:]) == HEADER.unpack_from(data)[-1]
        assert HEADER.unpack_from(data)[3] == layout_key(engine.hash_seed, engine.kv_pool, (rank, 2))


def test_files_only_another_rank_holds_are_deleted_at_start(make_engine, model, tmp_path):
    """An earlier run that stopped between the ranks' writes leaves rank 1 a file rank 0 does not index: rank 1
    deletes it at start (no rank's directory outgrows its budget over restarts); files rank 0 indexes stay."""
    kept, stray = f"{1:016x}{SUFFIX}", f"{2:016x}{SUFFIX}"
    for rank in (0, 1):
        (tmp_path / RANKS[rank]).mkdir()
        (tmp_path / RANKS[rank] / kept).write_bytes(b"an earlier run's block")
    (tmp_path / RANKS[1] / stray).write_bytes(b"rank 1 only")
    engine = _sliced(make_engine, model, kv_offload_host_bytes=1, kv_offload_disk_path=str(tmp_path),
                     kv_offload_disk_bytes="64MiB")
    assert engine.tiers.disk is not None and set(engine.tiers.disk.sizes) == {1}
    assert set(_files(tmp_path, 0)) == set(_files(tmp_path, 1)) == {kept}
