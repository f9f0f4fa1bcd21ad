"""Prefix blocks fetched from another engine (`KVConnector.on_fetch`, `LLMEngine.kv_fetch_done`, the holder's
`pin_cached`): a prompt whose prefix another engine computed is admitted with the copied blocks as prefix hits and
computes only the rest, with the same tokens; a holder that lacks blocks, a failed copy and an abort fall back
without wrong output or leaked blocks. The node-to-node transport is tests/test_kv_fetch_cluster.py's."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, make_prompts, run_all

from pdcluster.engine.kv_connector import KVConnector

BLOCK = 16
PROMPT = 100               # 6 full blocks can be fetched ((100 - 1) // 16)


class CopyingConnector(KVConnector):
    """Fetches from `holder` (another engine in this process) by copying pool blocks, after the step that asked
    (`finish`), as a node does when the bytes have landed. `fail`: report nothing arrived."""

    fetches = True

    def __init__(self) -> None:
        self.holder = None
        self.engine = None
        self.pending: list[tuple[str, list[int], list[int]]] = []
        self.fail = False
        self.reserved: list[tuple[str, int]] = []

    def on_fetch(self, request_id, block_ids, block_hashes):
        self.pending.append((request_id, block_ids, block_hashes))

    def on_remote_reserved(self, request_id, block_ids, num_cached_tokens):
        self.reserved.append((request_id, num_cached_tokens))

    def finish(self) -> None:
        for rid, blocks, hashes in self.pending:
            src = self.holder.pin_cached(hashes)
            done = 0 if self.fail else len(src)
            for s, d in zip(src[:done], blocks, strict=False):
                self.engine.kv_pool.block(d).copy_(self.holder.kv_pool.block(s))
            self.holder.unpin(src)
            self.engine.kv_fetch_done(rid, blocks, done)
        self.pending = []


def _pair(make_engine, model, **kw):
    holder = make_engine(model, block_size=BLOCK)
    conn = CopyingConnector()
    engine = make_engine(model, block_size=BLOCK, kv_connector=conn, **kw)
    conn.holder, conn.engine = holder, engine
    return holder, engine, conn


def _run(engine, conn, prompts, fetch_blocks, prefix="r"):
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, GREEDY, fetch_blocks=fetch_blocks)
    results = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests() and not conn.pending and not engine.scheduler.fetching:
            break
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        conn.finish()
    return [results[f"{prefix}{i}"] for i in range(len(prompts))]


def test_fetched_prefix_is_not_recomputed(make_engine, tiny_llama):
    holder, engine, conn = _pair(make_engine, tiny_llama)
    prompts = make_prompts([PROMPT, PROMPT + 20], seed=3)
    cold = run_all(holder, prompts, GREEDY)     # the holder computed both prefixes
    got = _run(engine, conn, prompts, fetch_blocks=PROMPT // BLOCK)
    stats = engine.get_stats()
    assert got == cold
    assert stats.kv_fetched_blocks == 12 and stats.kv_fetch_missed_blocks == 0
    assert holder.get_stats().kv_lent_blocks == 12
    assert stats.num_prefill_tokens == (PROMPT - 6 * BLOCK) + (PROMPT + 20 - 6 * BLOCK)
    assert stats.prefix_cache_hit_tokens == 12 * BLOCK


def test_same_tokens_as_transformers(make_engine, tiny_qwen2):
    from engine_helpers import hf_greedy

    holder, engine, conn = _pair(make_engine, tiny_qwen2)
    prompts = make_prompts([PROMPT], seed=4)
    run_all(holder, prompts, GREEDY)
    got = _run(engine, conn, prompts, fetch_blocks=6)
    assert got == hf_greedy(tiny_qwen2, prompts, GREEDY.max_tokens)
    assert engine.get_stats().kv_fetched_blocks == 6


def test_holder_with_part_of_the_prefix(make_engine, tiny_llama):
    """The holder has 3 of the 6 blocks asked for (another prompt shared them): 3 arrive, the rest is computed."""
    holder, engine, conn = _pair(make_engine, tiny_llama)
    prompt = make_prompts([PROMPT], seed=5)[0]
    run_all(holder, [prompt[:3 * BLOCK + 5]], GREEDY)
    got = _run(engine, conn, [prompt], fetch_blocks=6)
    assert got == run_all(holder, [prompt], GREEDY, prefix="cold")
    stats = engine.get_stats()
    assert stats.kv_fetched_blocks == 3 and stats.kv_fetch_missed_blocks == 3
    assert stats.num_prefill_tokens == PROMPT - 3 * BLOCK


def test_failed_fetch_recomputes(make_engine, tiny_llama):
    holder, engine, conn = _pair(make_engine, tiny_llama)
    conn.fail = True
    prompts = make_prompts([PROMPT], seed=6)
    cold = run_all(holder, prompts, GREEDY)
    assert _run(engine, conn, prompts, fetch_blocks=6) == cold
    stats = engine.get_stats()
    assert stats.kv_fetched_blocks == 0 and stats.kv_fetch_missed_blocks == 6
    assert stats.num_prefill_tokens == PROMPT


def test_local_hits_are_not_fetched_again(make_engine, tiny_llama):
    holder, engine, conn = _pair(make_engine, tiny_llama)
    prompts = make_prompts([PROMPT], seed=7)
    run_all(holder, prompts, GREEDY)
    run_all(engine, prompts, GREEDY, prefix="local")    # this engine has the prefix itself now
    _run(engine, conn, prompts, fetch_blocks=6)
    assert engine.get_stats().kv_fetched_blocks == 0 and holder.get_stats().kv_lent_blocks == 0


def test_abort_while_fetching_leaks_nothing(make_engine, tiny_llama):
    holder, engine, conn = _pair(make_engine, tiny_llama)
    prompts = make_prompts([PROMPT], seed=8)
    run_all(holder, prompts, GREEDY)
    engine.add_request("f", prompts[0], GREEDY, fetch_blocks=6)
    engine.step()
    assert engine.get_stats().num_loading_kv == 1 and conn.pending
    assert not engine.has_unfinished_requests()   # a fetch in flight is the node's to finish: nothing to step
    engine.abort("f")
    conn.finish()                                  # the copy ends after the abort: its blocks are only unpinned
    assert engine.get_stats().num_loading_kv == 0 and not engine.scheduler.requests


def test_remote_prefill_waits_for_the_fetch_then_reserves(make_engine, tiny_llama):
    """A remote_kv request whose prefix another node holds: fetched first, then its blocks reserved with the
    fetched ones counted as cached (the prefill node writes only the rest)."""
    holder, engine, conn = _pair(make_engine, tiny_llama)
    prompts = make_prompts([PROMPT], seed=9)
    run_all(holder, prompts, GREEDY)
    assert engine.add_request("p", prompts[0], GREEDY, remote_kv=True, fetch_blocks=6)
    assert conn.reserved == [] and engine.scheduler.requests["p"].status.value == "waiting"
    engine.step()
    conn.finish()
    engine.step()
    assert conn.reserved == [("p", 6 * BLOCK)]
    engine.remote_kv_failed("p")   # the remote prefill gives up: prefilled here with the fetched prefix
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_prefill_tokens == PROMPT - 6 * BLOCK


def test_remote_prefill_loads_from_its_own_tiers_first(make_engine, tiny_llama):
    """A decode node's own host tier holds the prefix: loaded before the reservation, not written again."""
    conn = CopyingConnector()
    engine = make_engine(tiny_llama, block_size=BLOCK, num_gpu_blocks_override=24, kv_connector=conn,
                         kv_offload_host_bytes="64MiB")
    prompts = make_prompts([PROMPT] * 4, seed=10)
    run_all(engine, prompts, GREEDY)             # prompt 0's blocks leave the pool for the host tier
    assert engine.add_request("p", prompts[0], GREEDY, remote_kv=True)
    assert conn.reserved == []
    for _ in range(200):
        if conn.reserved:
            break
        engine.step()
    assert conn.reserved == [("p", 6 * BLOCK)]
    assert engine.get_stats().kv_tier_loaded_host_blocks >= 1
    engine.abort("p")
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kw", [dict(enable_prefix_caching=False)])
def test_no_fetch_without_prefix_caching(make_engine, tiny_llama, kw):
    _, engine, conn = _pair(make_engine, tiny_llama, **kw)
    run_all(engine, make_prompts([PROMPT], seed=11), GREEDY)
    assert engine.scheduler.fetch is None and not conn.pending


def test_prefetch_holds_a_running_requests_blocks_for_its_next_attempt(make_engine, tiny_llama):
    """A live migration's pre-copy (`LLMEngine.prefetch`): the blocks come over while nothing runs, stay held through
    a pool that fills up with other prompts (no eviction), and the request that follows is admitted with all of them
    as prefix hits: same tokens, only its last token computed. Releasing the hold (`abort`) leaks nothing."""
    holder, engine, conn = _pair(make_engine, tiny_llama, num_gpu_blocks_override=24)
    prompt = make_prompts([6 * BLOCK + 1], seed=12)[0]   # 6 full blocks, the last token to compute
    cold = run_all(holder, [prompt], GREEDY)
    assert engine.prefetch("m#pre", prompt, 6) == (0, True)
    assert not engine.has_unfinished_requests() and engine.get_stats().num_loading_kv == 1
    conn.finish()
    assert engine.get_stats().kv_fetched_blocks == 6 and engine.get_stats().num_free_blocks == 24 - 6
    run_all(engine, make_prompts([100, 100, 100], seed=13), GREEDY, prefix="fill")   # the pool churns
    assert _run(engine, conn, [prompt], fetch_blocks=0, prefix="m") == cold
    stats = engine.get_stats()
    assert stats.num_prefill_tokens - 3 * 100 == 1 and holder.get_stats().kv_lent_blocks == 6
    engine.abort("m#pre")
    assert engine.get_stats().num_free_blocks == 24 and not engine.scheduler.requests


def test_prefetch_of_blocks_already_here_holds_them_without_a_fetch(make_engine, tiny_llama):
    holder, engine, conn = _pair(make_engine, tiny_llama)
    prompt = make_prompts([PROMPT], seed=14)[0]
    run_all(engine, [prompt], GREEDY)
    assert engine.prefetch("m#pre", prompt, 6) == (6, False) and not conn.pending
    assert engine.scheduler.held["m#pre"].block_table and engine.get_stats().kv_fetched_blocks == 0
    engine.abort("m#pre")
    assert not engine.scheduler.held and not engine.scheduler.requests


def test_prefetch_released_while_copying_or_failed_leaks_nothing(make_engine, tiny_llama):
    holder, engine, conn = _pair(make_engine, tiny_llama, num_gpu_blocks_override=24)
    prompt = make_prompts([PROMPT], seed=15)[0]
    run_all(holder, [prompt], GREEDY)
    engine.prefetch("a#pre", prompt, 6)
    engine.abort("a#pre")          # released before the copy ended: its blocks stay pinned until it does
    assert engine.get_stats().num_free_blocks == 24 - 6
    conn.finish()
    assert engine.get_stats().num_free_blocks == 24
    conn.fail = True
    engine.prefetch("b#pre", prompt, 6)
    conn.finish()                  # nothing landed: nothing held
    assert engine.scheduler.held["b#pre"].block_table == [] and engine.get_stats().num_free_blocks == 24
    engine.abort("b#pre")
    assert not engine.scheduler.requests
