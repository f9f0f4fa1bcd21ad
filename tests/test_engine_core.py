"""Engine core units: the scheduler applying a step's results, the one allocation path of the block manager,
the stable block hash shared with the router, the KV-connector hooks, and torch-free imports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from engine_helpers import hf_greedy, make_prompts, run_all
from lifecycle_helpers import assert_move

from pdcluster.control.block_hash import block_hashes, cached_prefix_blocks
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.kv_connector import KVConnector
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.sequence import Sequence, SequenceStatus

EOS = 2


def _seq(rid: str, tokens: list[int], max_tokens: int = 4, hold_blocks: bool = False) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), [EOS], 512, 0, hold_blocks)


def _scheduler(num_blocks: int = 8, block_size: int = 4, budget: int = 64, prefix: bool = True) -> Scheduler:
    return Scheduler(num_blocks, block_size, max_num_seqs=8, max_num_batched_tokens=budget,
                     enable_chunked_prefill=True, enable_prefix_caching=prefix)


# ---- scheduler ----------------------------------------------------------------------------------

def test_update_from_output_advances_publishes_appends_and_finishes():
    sched = _scheduler()
    a, b = _seq("a", list(range(10, 19)), max_tokens=2), _seq("b", list(range(30, 35)), max_tokens=1, hold_blocks=True)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [9, 5] and sched.running == [a, b]
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    got = sched.update_from_output(batch, [a, b], [[7], [8]], [[None], [None]])
    assert got == [a, b] and a.num_computed_tokens == 9 and b.num_computed_tokens == 5
    assert a.output_token_ids == [7] and a.status is SequenceStatus.RUNNING
    # b stopped (max_tokens=1) and holds its blocks; its one full block is in the prefix cache.
    assert b.status is SequenceStatus.FINISHED and b.block_table and sched.running == [a] and "b" in sched.requests
    bm = sched.block_manager
    assert bm.hash_to_block == {**{h: a.block_table[i] for i, h in enumerate(block_hashes(a.token_ids[:8], 4))},
                                block_hashes(b.prompt_token_ids, 4)[0]: b.block_table[0]}
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.num_new_tokens == [1]
    sched.update_from_output(batch, [a], [[9]], [[None]])
    assert a.status is SequenceStatus.FINISHED and "a" not in sched.requests and not a.block_table
    sched.abort("b")
    assert not sched.requests and sched.block_manager.num_free_blocks == 8 and not any(sched.block_manager.ref_counts)


def test_a_chunk_that_samples_nothing_still_advances():
    sched = _scheduler(budget=4)
    a = _seq("a", list(range(10)))
    sched.add(a)
    batch = sched.schedule()
    assert batch.num_new_tokens == [4]
    assert sched.update_from_output(batch, [], [], []) == [] and a.num_computed_tokens == 4 and not a.output_token_ids
    assert a.num_cached_blocks == 1
    sched.abort("a")


@pytest.mark.parametrize("prompt_len, chunks", [(30, [30]), (32, [32]), (33, [29, 4])])
def test_decodes_ride_along_a_prompts_last_chunk(prompt_len, chunks):
    """Budget 32 with 3 sequences decoding: a prompt is one step where its rest after a 29-token chunk (32 - 3)
    would be no more than those 3 decode rows; a longer one is chunked as before (the step's prompt tokens
    stay within the budget)."""
    sched = _scheduler(num_blocks=32, budget=32)
    decoding = [_seq(f"d{i}", [50 + i], max_tokens=20) for i in range(3)]
    for seq in decoding:
        sched.add(seq)
    batch = sched.schedule()
    sched.update_from_output(batch, batch.seqs, [[1]] * 3, [[None]] * 3)
    sched.add(p := _seq("p", list(range(10, 10 + prompt_len)), max_tokens=2))
    got = []
    while p.num_computed_tokens < prompt_len:
        batch = sched.schedule()
        assert batch.num_new_tokens[:3] == [1, 1, 1] and batch.seqs[3] is p
        assert sum(batch.num_new_tokens) - 3 <= 32
        got.append(batch.num_new_tokens[3])
        # a prompt's chunk samples nothing until its last
        sampled = batch.seqs if p.num_computed_tokens + got[-1] == prompt_len else batch.seqs[:3]
        sched.update_from_output(batch, sampled, [[1]] * len(sampled), [[None]] * len(sampled))
    assert got == chunks


def test_preemption_frees_the_newest_and_recomputes_it_later():
    sched = _scheduler(num_blocks=4, budget=64)
    a, b = _seq("a", list(range(8)), max_tokens=8), _seq("b", list(range(40, 48)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.update_from_output(batch, batch.seqs, [[1], [1]], [[None], [None]])   # 2 full blocks each, all 4 in use
    batch = sched.schedule()            # both need a third block: b (newest) is preempted
    assert batch.seqs == [a] and sched.num_preemptions == 1 and list(sched.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    sched.abort("a")
    sched.abort("b")
    assert sched.block_manager.num_free_blocks == 4


# ---- request status: the moves and the remote-KV path ---------------------------------------------

S = SequenceStatus
ALLOWED = {(S.WAITING, S.RUNNING), (S.WAITING, S.WAITING_FOR_REMOTE_KV), (S.WAITING, S.FINISHED),
           (S.RUNNING, S.WAITING), (S.RUNNING, S.FINISHED),
           (S.WAITING_FOR_REMOTE_KV, S.RUNNING), (S.WAITING_FOR_REMOTE_KV, S.WAITING),
           (S.WAITING_FOR_REMOTE_KV, S.FINISHED),
           (S.WAITING, S.WAITING_FOR_GRAMMAR), (S.WAITING_FOR_GRAMMAR, S.WAITING), (S.WAITING_FOR_GRAMMAR, S.FINISHED),
           (S.WAITING, S.LOADING_KV), (S.LOADING_KV, S.WAITING), (S.LOADING_KV, S.FINISHED)}


@pytest.mark.parametrize("src", list(S))
@pytest.mark.parametrize("dst", list(S))
def test_sequence_status_moves_follow_the_table(src, dst):
    seq = _seq("a", [1, 2, 3])
    assert_move(seq, seq.move_to, src, dst, (src, dst) in ALLOWED, attr="status")


def _remote(sched: Scheduler, rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    seq = _seq(rid, tokens, max_tokens)
    assert sched.add_remote(seq)
    return seq


def test_remote_kv_waits_unscheduled_then_landed_runs_from_the_first_token():
    sched = _scheduler()
    seq = _remote(sched, "r", list(range(10, 20)))
    assert seq.status is S.WAITING_FOR_REMOTE_KV and len(seq.block_table) == 3
    assert sched.num_reserved_blocks() == 3 and sched.block_manager.num_free_blocks == 5
    assert not sched.has_work() and not sched.schedule().seqs       # never scheduled while waiting
    assert sched.remote_kv_landed("r", 7) is seq
    assert seq.status is S.RUNNING and seq.output_token_ids == [7] and seq.num_computed_tokens == 10
    assert sched.running == [seq] and sched.num_reserved_blocks() == 0
    assert sched.block_manager.cached_hashes(10)                     # the prompt's full blocks are published
    batch = sched.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [1]       # decodes the first token
    sched.abort("r")
    assert sched.block_manager.num_free_blocks == 8


def test_remote_kv_landed_refuses_unknown_and_not_waiting_requests():
    sched = _scheduler()
    with pytest.raises(ValueError, match="'nope' is not waiting for remote KV"):
        sched.remote_kv_landed("nope", 7)
    local = _seq("local", [1, 2, 3])
    sched.add(local)
    with pytest.raises(ValueError, match="not waiting for remote KV .waiting."):
        sched.remote_kv_landed("local", 7)
    sched.update_from_output(sched.schedule(), [local], [[5]], [[None]])
    with pytest.raises(ValueError, match="not waiting for remote KV .running."):
        sched.remote_kv_landed("local", 7)
    r = _remote(sched, "r", [4, 5, 6])
    sched.remote_kv_landed("r", 7)
    with pytest.raises(ValueError, match="not waiting for remote KV .running."):
        sched.remote_kv_landed("r", 7)                               # landed once only
    assert r.output_token_ids == [7]
    sched.abort("local")
    sched.abort("r")
    assert sched.block_manager.num_free_blocks == 8


def test_remote_kv_failed_frees_the_blocks_and_queues_a_local_prefill_with_prefix_hits():
    sched = _scheduler(num_blocks=8)
    warm = _seq("warm", list(range(10, 19)), max_tokens=1)           # caches the prompt's 2 full blocks
    sched.add(warm)
    sched.update_from_output(sched.schedule(), [warm], [[3]], [[None]])
    seq = _remote(sched, "r", list(range(10, 22)))
    assert seq.num_cached_tokens == 8 and len(seq.block_table) == 3 and sched.block_manager.num_free_blocks == 5
    sched.remote_kv_failed("r")
    assert seq.status is S.WAITING and not seq.block_table and seq.num_computed_tokens == 0
    assert list(sched.waiting) == [seq] and sched.num_reserved_blocks() == 0 and not sched.waiting_for_kv
    assert sched.block_manager.num_free_blocks == 8
    with pytest.raises(ValueError, match="not waiting for remote KV .waiting."):
        sched.remote_kv_failed("r")             # failed once only: refused, nothing changes
    assert seq.status is S.WAITING and list(sched.waiting) == [seq]
    batch = sched.schedule()                    # a local prefill after the 2 cached blocks
    assert batch.seqs == [seq] and batch.num_new_tokens == [4] and seq.num_cached_tokens == 8
    sched.update_from_output(batch, [seq], [[9]], [[None]])
    assert seq.output_token_ids == [9]
    sched.abort("r")
    assert sched.block_manager.num_free_blocks == 8 and not any(sched.block_manager.ref_counts)


def test_remote_kv_failed_unknown_is_a_no_op_and_running_is_refused():
    sched = _scheduler()
    sched.remote_kv_failed("nope")
    seq = _remote(sched, "r", [1, 2, 3])
    sched.remote_kv_landed("r", 7)
    with pytest.raises(ValueError, match="not waiting for remote KV .running."):
        sched.remote_kv_failed("r")
    assert seq.status is S.RUNNING and seq.block_table
    sched.abort("r")


def test_add_remote_refused_changes_nothing():
    sched = _scheduler(num_blocks=2)
    seq = _seq("big", list(range(12)))
    assert not sched.add_remote(seq)
    assert seq.status is S.WAITING and not seq.block_table and "big" not in sched.requests
    assert sched.block_manager.num_free_blocks == 2 and sched.block_manager.prefix_query_tokens == 0


@pytest.mark.parametrize("status", ["waiting", "running", "waiting_for_remote_kv", "finished_holding",
                                    "failed_remote"])   # preempted: test_preemption_frees_the_newest_...
def test_abort_in_every_status_frees_every_block(status):
    sched = _scheduler(num_blocks=8)
    other = _seq("other", list(range(40, 47)), max_tokens=8)         # shares no blocks, stays
    sched.add(other)
    sched.update_from_output(sched.schedule(), [other], [[1]], [[None]])
    free = sched.block_manager.num_free_blocks
    seq = _seq("x", list(range(10, 19)), max_tokens=1 if status == "finished_holding" else 4,
               hold_blocks=status == "finished_holding")
    if status in ("waiting_for_remote_kv", "failed_remote"):
        assert sched.add_remote(seq)
        if status == "failed_remote":
            sched.remote_kv_failed("x")
    else:
        sched.add(seq)
        if status != "waiting":
            batch = sched.schedule()
            sched.update_from_output(batch, batch.seqs, [[5]] * len(batch), [[None]] * len(batch))
    want = {"waiting": S.WAITING, "running": S.RUNNING, "waiting_for_remote_kv": S.WAITING_FOR_REMOTE_KV,
            "finished_holding": S.FINISHED, "failed_remote": S.WAITING}[status]
    assert seq.status is want and "x" in sched.requests
    sched.abort("x")
    assert seq.status is S.FINISHED and not seq.block_table and "x" not in sched.requests
    assert seq not in sched.running and seq not in sched.waiting and "x" not in sched.waiting_for_kv
    assert sched.block_manager.num_free_blocks == free
    sched.abort("x")                                                  # idempotent
    sched.abort("other")
    assert sched.block_manager.num_free_blocks == 8 and not any(sched.block_manager.ref_counts)


# ---- block manager ------------------------------------------------------------------------------

def test_one_allocation_path_prefix_hits_refcounts_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate(a, 5) and len(a.block_table) == 3
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    h = block_hashes([1, 2, 3, 4], 2)
    assert a.num_cached_blocks == 2 and bm.cached_hashes(10) == h[::-1]
    b = _seq("b", [1, 2, 3, 4, 9])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert not bm.allocate(b, 7, hits) and not b.block_table          # 2 fresh needed, 1 free: nothing changes
    assert bm.allocate(b, 5, hits) and b.block_table[:2] == hits and bm.ref_counts[hits[0]] == 2
    assert b.num_cached_blocks == 2 and bm.num_free_blocks == 0
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.match_prefix(_seq("c", [1, 2, 3, 4, 7])) == hits   # cached while free
    c = _seq("c", [8] * 6)
    assert bm.allocate(c, 6)     # two never-hashed blocks, then evicts the LRU cached one: the tail block
    assert hits[1] in c.block_table and hits[0] not in c.block_table
    assert bm.match_prefix(_seq("d", [1, 2, 3, 4, 7])) == hits[:1] and bm.cached_hashes(10) == h[:1]
    assert not bm.allocate(_seq("e", [1] * 3), 3)
    bm.free(c)
    c.block_table = [hits[0], hits[0]]
    with pytest.raises(RuntimeError):
        bm.free(c)


# ---- stable block hash --------------------------------------------------------------------------

def test_sequence_hashes_are_the_routers_block_hashes_and_grow_with_outputs():
    tokens = make_prompts([45], seed=1)[0]
    seq = _seq("a", tokens)
    assert seq.block_hashes(16) == block_hashes(tokens, 16) and len(block_hashes(tokens, 16)) == 2
    for t in range(3):
        seq.append_token(100 + t)
    assert seq.block_hashes(16) == block_hashes(seq.token_ids, 16) and len(seq.block_hashes(16)) == 3
    # Stable across processes (Python's hash is salted per process).
    code = ("from pdcluster.control.block_hash import block_hashes; "
            f"print(block_hashes({tokens}, 16))")
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == str(block_hashes(tokens, 16)), out.stderr


def test_sequence_hashes_follow_tokens_dropped_by_streaming_llm():
    seq = _seq("a", list(range(3, 51)))                 # 3 blocks of 16
    assert len(seq.block_hashes(16)) == 3
    seq.drop_tokens(16, 16)                              # the second block goes; the third moves down
    assert seq.num_tokens == 32 and seq.num_evicted_tokens == 16
    assert seq.block_hashes(16) == block_hashes(seq.token_ids, 16) and len(seq.block_hashes(16)) == 2


def test_cached_hashes_reported_by_the_engine_predict_the_next_requests_hits(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, block_size=16)
    prompt = make_prompts([70], seed=90)[0]
    run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    reported = engine.cached_block_hashes()
    seed = engine.hash_seed
    assert set(block_hashes(prompt, 16, seed)) <= set(reported)   # 4 full prompt blocks (+ one with outputs, maybe)
    assert not set(block_hashes(prompt, 16)) & set(reported)       # the bare token chain is not what it caches
    later = prompt[:50] + [7] * 30
    predicted = cached_prefix_blocks(block_hashes(later, 16, seed), frozenset(reported))
    assert predicted == 3
    before = engine.get_stats().prefix_cache_hit_tokens
    run_all(engine, [later], SamplingParams(temperature=0, max_tokens=1), "later")
    assert engine.get_stats().prefix_cache_hit_tokens - before == predicted * 16
    assert engine.cached_block_hashes(2) == engine.cached_block_hashes()[:2]


def test_hash_seed_covers_model_dtype_block_size_and_salt(tiny_llama, tiny_qwen2, tmp_path):
    """Block hashes are safe to share across engines: equal seeds exactly for the same checkpoint content (also
    copied elsewhere), dtypes, block size and salt."""
    import shutil

    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    def seed(model=tiny_llama, **kw):
        engine = LLMEngine(EngineArgs(model=model, num_gpu_blocks_override=8, **{"dtype": "float32", **kw}))
        engine.shutdown()
        return engine.hash_seed

    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    base = seed()
    assert seed(str(copy)) == base == seed()
    others = [seed(tiny_qwen2), seed(dtype="bfloat16"), seed(kv_cache_dtype="int8"), seed(block_size=32),
              seed(prefix_cache_salt="tenant-a"), seed(prefix_cache_salt="tenant-b")]
    assert len({base, *others}) == 1 + len(others)
    weights = copy / "model.safetensors"          # a fine-tune: same config and sizes, other bytes
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    assert seed(str(copy)) != base


# ---- KV connector -------------------------------------------------------------------------------

class Recorder(KVConnector):
    def __init__(self, layerwise: bool = True) -> None:
        self.layerwise = layerwise
        self.events: list = []

    def on_step_start(self, prompts):
        self.events.append(("start", [(p.request_id, list(p.block_ids), p.num_prompt_tokens) for p in prompts]))

    def on_layer_done(self, layer):
        self.events.append(("layer", layer))

    def on_prompt_done(self, request_id, block_ids):
        self.events.append(("done", request_id, list(block_ids)))


def test_kv_connector_hooks_carry_the_block_tables_of_prompts_finishing_in_the_step(tiny_llama):
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    rec = Recorder()
    engine = LLMEngine(EngineArgs(model=tiny_llama, block_size=16, num_gpu_blocks_override=64,
                                  max_num_batched_tokens=32),
                       kv_connector=rec)
    layers = engine.model_config.num_layers
    prompts = make_prompts([40, 10], seed=5)
    engine.add_request("long", prompts[0], SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    engine.add_request("short", prompts[1], SamplingParams(temperature=0, max_tokens=2), hold_blocks=True)
    outs = {}
    steps = []
    while engine.has_unfinished_requests():
        rec.events = []
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps.append(rec.events)
    # Step 1: 32 tokens of "long" only (a chunk): no prompt finishes, so no layer hook (the step may run compiled).
    assert steps[0] == [("start", [])]
    # Step 2: the last chunk of "long" and all of "short": both listed with their block tables, done after.
    table_long, table_short = outs["long"][-1].block_ids, outs["short"][0].block_ids
    assert steps[1] == [("start", [("long", table_long, 40), ("short", table_short, 10)])] \
        + [("layer", i) for i in range(layers)] + [("done", "long", table_long), ("done", "short", table_short)]
    # Step 3: "short" decodes: no prompt in it.
    assert steps[2] == [("start", [])]
    assert len(table_long) == 3 and len(table_short) == 1
    want = hf_greedy(tiny_llama, prompts, max_new_tokens=2)
    assert outs["long"][-1].outputs[0].token_ids == want[0][:1] and outs["short"][-1].outputs[0].token_ids == want[1]
    engine.abort("long")
    engine.abort("short")
    assert engine.get_stats().num_free_blocks == 64


def test_a_connector_that_is_not_layerwise_gets_no_layer_hook(tiny_llama):
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    rec = Recorder(layerwise=False)
    engine = LLMEngine(EngineArgs(model=tiny_llama, num_gpu_blocks_override=64), kv_connector=rec)
    engine.add_request("r", make_prompts([10], seed=6)[0], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert [e[0] for e in rec.events] == ["start", "done", "start"]


def test_engine_thread_and_async_engine_import_without_torch():
    code = ("import sys, pdcluster.engine.async_engine, pdcluster.engine.engine_thread; "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

