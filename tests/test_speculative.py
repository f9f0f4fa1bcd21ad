"""Speculative decoding in the engine: proposers (n-gram, draft model), verification of several drafts in one
step, and outputs equal to the same engine without speculation for every architecture, attention backend,
sampling setting and stop rule; blocks of rejected drafts go back, the prefix cache holds accepted tokens only;
the sampled distribution is the target's (a chi-square test that a biased verifier fails)."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import jsonschema
import pytest
from engine_helpers import make_prompts, run_all, run_outputs, run_staggered

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.speculative.config import SpeculativeConfig
from pdcluster.engine.speculative.ngram import NgramProposer
from pdcluster.engine.testing import make_tiny_model

ARCHS = ["llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
# "fixed": every step drafts what it can, so tests of the verification do not depend on measured step costs
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "draft_policy": "fixed"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def draft(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "draft_policy": "fixed"}


def repetitive_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (an n-gram proposer finds matches) and without, of several lengths."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, 400) for _ in range(7)]
    return [motif * 4 + motif[:3], make_prompts([37], seed=seed)[0], motif * 12, [9] * 21,
            make_prompts([3], seed=seed + 1)[0] * 5, make_prompts([90], seed=seed + 2)[0]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec")
    out = {arch: make_tiny_model(str(root / arch), arch) for arch in ARCHS}
    # drafters that are not the target: one layer of the same family (so the same tokenizer)
    for arch in ARCHS:
        out[f"drafter-{arch}"] = make_tiny_model(str(root / f"drafter-{arch}"), arch, num_hidden_layers=1)
    return out


# ---- configuration ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, words", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config.lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size"),
    ("{not json", "not a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "greedy"}, "speculative_config.draft_policy"),
])
def test_bad_configs_are_refused_naming_the_key(value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SpeculativeConfig.parse(value)


def test_configs_parse_from_dicts_and_text_with_vllm_defaults():
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    spec = SpeculativeConfig.parse(text)
    assert spec == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}) \
        == SpeculativeConfig("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse(spec.to_json()) == spec
    fixed = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "draft_policy": "fixed"})
    assert fixed.draft_policy == "fixed" and spec.draft_policy == "goodput" and fixed.to_json() != spec.to_json()
    assert SpeculativeConfig.parse(fixed.to_json()) == fixed and "goodput" not in spec.to_json()
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    with pytest.raises(ValueError, match="StreamingLLM"):
        EngineArgs(model="/m", speculative_config=text, streaming_window=64)


def test_a_node_record_carries_the_config_as_text_and_refuses_anything_else():
    """Peers compare the canonical text only (never parse it); a record whose field is not a string is dropped."""
    from pdcluster.control.records import NodeInfo

    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    info = NodeInfo(node_id="d0", role="decode", speculative=spec.to_json())
    assert NodeInfo.from_json(info.to_json()).speculative == spec.to_json()
    body = json.loads(info.to_json())
    for bad in (5, ["x"], {"method": "ngram"}, None):
        with pytest.raises(ValueError, match="speculative must be a string"):
            NodeInfo.from_json(json.dumps({**body, "speculative": bad}))
    assert NodeInfo.from_json(json.dumps({k: v for k, v in body.items() if k != "speculative"})).speculative == ""


def test_ngram_lookup_prefers_the_longest_suffix_and_a_full_continuation():
    p = NgramProposer(1, 3)
    assert p.lookup([1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]            # 3-gram [1, 2, 3]
    assert p.lookup([7] * 8, 3) == [7, 7, 7]                           # not the latest match (one token after it)
    assert p.lookup([7] * 5, 3) == [7, 7]                              # the earliest then: the most that follow
    assert p.lookup([1, 2, 3, 9, 2, 3, 8, 2, 3], 1) == [8]             # the latest of several matches
    assert p.lookup([1, 2, 3, 4], 3) == []                             # no earlier occurrence
    assert p.lookup([5], 3) == [] and NgramProposer(2, 2).lookup([4, 1, 4], 2) == []


# ---- the scheduler's side --------------------------------------------------------------------------------

def _step(sched, *new: list[int]):
    """Add requests with these prompts, run one step (every scheduled sequence samples 100), return them."""
    from pdcluster.engine.sequence import Sequence

    seqs = [Sequence(f"r{len(sched.requests)}-{i}", p, SamplingParams(max_tokens=20, ignore_eos=True), [2], 512, 0)
            for i, p in enumerate(new)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    sampled = [q for q, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
               if q.num_computed_tokens + n == q.num_tokens]
    sched.update_from_output(batch, sampled, [[100]] * len(sampled), [[None]] * len(sampled))
    return seqs


def test_drafts_fit_the_budget_are_given_up_before_preemption_and_rejections_free_their_blocks():
    from pdcluster.engine.scheduler import Scheduler

    sched = Scheduler(6, 4, max_num_seqs=4, max_num_batched_tokens=3, enable_chunked_prefill=True)
    a, = _step(sched, [5, 6, 7])                         # 4 tokens: one full block
    assert sched.drafting() == [a] and len(a.block_table) == 1
    sched.set_drafts(a, [8, 9, 10, 11])
    batch = sched.schedule()                             # budget 3: the last token and two drafts
    assert batch.num_new_tokens == [3] and a.spec_token_ids == [8, 9]
    # the sampler drew 8, then 12 instead of 9: one draft kept, and the token after it
    sched.update_from_output(batch, [a], [[8, 12]], [[None, None]])
    assert a.output_token_ids == [100, 8, 12] and a.num_computed_tokens == 5 and a.spec_token_ids == []
    assert len(a.block_table) == 2 and sched.spec.num_draft_tokens == 2 and sched.spec.accepted_per_position == [1, 0]
    assert (a.spec_acceptance.accepted, a.spec_acceptance.rejected) == (1, 1)   # the draft policy's record
    # the rejected draft's block is freed: 6 tokens need 2 blocks, none for the rejected position's
    assert sched.block_manager.num_free_blocks == 4
    # Two more requests take the rest of the pool; drafts that need a block nobody has are dropped, nobody is
    # preempted for them.
    sched.max_num_batched_tokens = 16
    b, c = _step(sched, list(range(20, 27)), list(range(40, 47)))   # 8 tokens each: 2 blocks each
    assert sched.block_manager.num_free_blocks == 0 and a.num_tokens == 7
    sched.set_drafts(b, [1, 2])                          # would need a third block
    batch = sched.schedule()
    assert b in batch.seqs and b.spec_token_ids == [] and sched.num_preemptions == 0
    assert not sched.reserve_draft_slots(c, 3)


def test_the_draft_policy_drafts_less_where_rows_cost_and_outputs_stay_exact(make_engine, tmp_path):
    """Through the engine: greedy output equals no speculation whatever the policy's cost model, and a step cost
    that grows with rows cuts the drafts against rows that cost nothing (the n-gram proposer keeps offering to
    continue the prompts' patterns; this random model rarely does)."""
    from pdcluster.engine.speculative.policy import StepCost

    class Fixed(StepCost):
        def __init__(self, per_row: float) -> None:
            super().__init__()
            self.line = (1.0, per_row)

        def add(self, rows: int, seconds: float) -> None:
            pass

    model = make_tiny_model(str(tmp_path / "m"), "llama")
    prompts = [[5, 6, 7, 8] * 8, [30, 31, 32] * 12, list(range(40, 50)) * 4]
    want = run_all(make_engine(model), prompts, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    drafted = {}
    for per_row in (0.0, 0.2):
        engine = make_engine(model, speculative_config=spec)
        engine.draft_policy.cost = Fixed(per_row)
        assert run_all(engine, prompts, GREEDY) == want
        drafted[per_row] = engine.get_stats().spec_num_draft_tokens
    assert 0 < drafted[0.2] < drafted[0.0], drafted


# ---- greedy: the same tokens as without speculation ------------------------------------------------------

def _greedy(make_engine, model, prompts, **kw):
    engine = make_engine(model, max_num_batched_tokens=64, **kw)
    got = run_staggered(engine, prompts, GREEDY)
    return [got[str(i)] for i in range(len(prompts))], engine.get_stats()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_the_target_alone_for_every_architecture(arch, models, make_engine):
    """Staggered arrivals and chunked prompts; n-gram, the target drafting for itself (nearly every draft
    passes), and another model drafting (most are rejected)."""
    prompts = repetitive_prompts()
    want, _ = _greedy(make_engine, models[arch], prompts)
    for spec in (NGRAM, draft(models[arch]), draft(models[f"drafter-{arch}"], 3)):
        got, stats = _greedy(make_engine, models[arch], prompts, speculative_config=spec)
        assert got == want, spec
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_drafts > 0
        assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
        if spec["method"] == "draft_model" and spec["model"] == models[arch]:
            assert stats.spec_acceptance_rate > 0.9, stats
        # fewer engine steps than tokens: drafts passed
        if stats.spec_num_accepted_tokens:
            assert stats.num_steps < sum(len(t) for t in got) + len(prompts) * 4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equal_on_both_cpu_backends_with_prefix_hits_preemption_and_int8(backend, models, make_engine):
    """A pool too small for the batch (preemption, drafts given up first), prompts sharing prefixes (blocks with
    rejected drafts' slots are shared later), int8 KV; outputs equal the same engine without speculation."""
    base = repetitive_prompts(1)
    prompts = base + [base[0][:30] + [5, 6, 7], base[2][:50]]
    kw = dict(attention_backend=backend, num_gpu_blocks_override=20, block_size=8, max_num_seqs=8)
    for kv in ("auto", "int8"):
        want, plain = _greedy(make_engine, models["llama"], prompts, kv_cache_dtype=kv, **kw)
        for spec in (NGRAM, draft(models["llama"])):
            got, stats = _greedy(make_engine, models["llama"], prompts, kv_cache_dtype=kv, speculative_config=spec,
                                 **kw)
            assert got == want, (kv, spec)
            assert stats.spec_num_accepted_tokens > 0
        assert plain.num_preemptions > 0 and plain.prefix_cache_hit_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(models, make_engine):
    """A request whose prompt is an earlier speculative request's prompt and output reuses the blocks that
    request computed (rejected drafts wrote into their slots before the right tokens did) and answers like a
    cold engine without speculation."""
    model = models["llama"]
    engine = make_engine(model, speculative_config=draft(models["drafter-llama"], 4), block_size=4)
    first = repetitive_prompts(2)[2]
    out = run_all(engine, [first], GREEDY, prefix="a")[0]
    assert engine.get_stats().spec_num_draft_tokens > engine.get_stats().spec_num_accepted_tokens   # rejections
    follow = first + out[:37]
    hits_before = engine.get_stats().prefix_cache_hit_tokens
    got = run_all(engine, [follow], GREEDY, prefix="b")[0]
    assert engine.get_stats().prefix_cache_hit_tokens - hits_before >= len(first)
    cold = make_engine(model, enable_prefix_caching=False)
    assert got == run_all(cold, [follow], GREEDY)[0]


def test_npu_and_flashinfer_paths_verify_drafts_like_the_cpu_backend(models, make_engine):
    from flashinfer_emulator import emulated_flashinfer
    from npu_emulator import emulated_torch_npu

    prompts = repetitive_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float16", num_gpu_blocks_override=48, max_num_batched_tokens=64)
    with emulated_torch_npu(npu_on_cpu=True):
        want = run_all(make_engine(models["llama"], device="npu", attention_backend="cpu", **kw), prompts, params)
        engine = make_engine(models["llama"], device="npu", speculative_config=NGRAM, **kw)
        assert run_all(engine, prompts, params) == want
        assert engine.get_stats().spec_num_accepted_tokens > 0
    kw = dict(num_gpu_blocks_override=48, max_num_batched_tokens=64)
    want = run_all(make_engine(models["llama"], attention_backend="torch", **kw), prompts, params)
    with emulated_flashinfer(float32=True):
        engine = make_engine(models["llama"], attention_backend="flashinfer", speculative_config=NGRAM, **kw)
        assert run_all(engine, prompts, params) == want
        assert engine.get_stats().spec_num_accepted_tokens > 0


# ---- sampling, stops, logprobs, grammars ----------------------------------------------------------------

def _outputs(engine, prompts, params):
    return [out.outputs[0] for out in run_outputs(engine, prompts, params)]


def _mixed_params(n: int, eos: int) -> list[SamplingParams]:
    params = []
    for i in range(n):
        params.append(SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_p=0.9 if i % 3 == 0 else 1.0, top_k=[0, 20, 5][i % 3],
            min_p=0.05 if i % 5 == 1 else 0.0, seed=100 + i, max_tokens=[5, 17, 30, 8][i % 4],
            min_tokens=3 if i % 4 == 1 else 0, repetition_penalty=1.2 if i % 2 else 1.0,
            frequency_penalty=0.4 if i % 3 == 1 else 0.0, presence_penalty=0.3 if i % 4 == 2 else 0.0,
            logprobs=2 if i % 2 == 0 else None, stop_token_ids=[7, 11] if i % 5 == 3 else [],
            ignore_eos=i % 6 == 0, logit_bias={eos: 2.0} if i % 7 == 4 else None))
    return params


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_stops_penalties_and_logprobs_equal_the_target_alone(method, models, make_engine):
    """Each scored row draws with its own position's seeded number after the drafts before it: the kept tokens,
    their logprobs, stop reasons and lengths are those of the engine without speculation."""
    model = models["qwen3"]
    spec = NGRAM if method == "ngram" else draft(model)
    prompts = (repetitive_prompts(4) * 4)[:20]
    eos = make_engine(model).model_config.eos_token_ids[0]
    params = _mixed_params(len(prompts), eos)
    want = _outputs(make_engine(model), prompts, params)
    engine = make_engine(model, speculative_config=spec)
    got = _outputs(engine, prompts, params)
    for g, w, sp in zip(got, want, params, strict=True):
        assert (g.token_ids, g.finish_reason, g.stop_reason) == (w.token_ids, w.finish_reason, w.stop_reason), sp
        assert len(g.token_ids) <= sp.max_tokens
        if sp.logprobs is not None:
            for (a, top_a), (b, top_b) in zip(g.logprobs, w.logprobs, strict=True):
                assert a == pytest.approx(b, abs=1e-4)
                assert [t for t, _ in top_a] == [t for t, _ in top_b]
    assert engine.get_stats().spec_num_accepted_tokens > 0


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square test of homogeneity (categories with few counts pooled)."""
    from scipy.stats import chi2_contingency

    total = a + b
    keep = [t for t, n in total.items() if n >= 10]
    rows = [[a[t] for t in keep] + [sum(a.values()) - sum(a[t] for t in keep)],
            [b[t] for t in keep] + [sum(b.values()) - sum(b[t] for t in keep)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return float(chi2_contingency(rows)[1])


@pytest.mark.slow
def test_unseeded_sampling_has_the_target_distribution(models, make_engine, monkeypatch):
    """Unseeded requests (the sampler's own random numbers): the tokens at the positions drafts were scored for
    follow the same distribution with and without speculation; a verifier that keeps every draft does not."""
    model = models["llama"]
    prompt = repetitive_prompts(5)[0]
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True)
    n = 800

    def positions(engine) -> list[Counter]:
        outs = run_all(engine, [prompt] * n, params)
        return [Counter(o[j] for o in outs) for j in range(1, 4)]

    base = positions(make_engine(model, seed=1, max_num_seqs=64))
    spec_engine = make_engine(model, seed=2, max_num_seqs=64, speculative_config=draft(model, 3))
    spec = positions(spec_engine)
    assert spec_engine.get_stats().spec_num_accepted_tokens > n // 5   # drafts are greedy: passed ~1 in 6 at T=1
    for j in range(3):
        assert _chi_square_p(base[j], spec[j]) > 1e-3, (j, base[j], spec[j])

    from pdcluster.engine import model_runner

    def keep_every_draft(seqs, tokens, logprobs):
        token_lists, logprob_lists, row = [], [], 0
        for s in seqs:
            k = len(s.spec_token_ids)
            token_lists.append(list(s.spec_token_ids) + [tokens[row + k]])
            logprob_lists.append(logprobs[row:row + k + 1])
            row += k + 1
        return token_lists, logprob_lists

    monkeypatch.setattr(model_runner, "verify", keep_every_draft)
    biased = positions(make_engine(model, seed=3, max_num_seqs=64, speculative_config=draft(model, 3)))
    assert min(_chi_square_p(base[j], biased[j]) for j in range(3)) < 1e-6


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_structured_output_drafts_are_checked_and_masked_like_sampled_tokens(method, models, make_engine):
    """Drafts past what the grammar allows are cut; each scored row is masked by the grammar after the drafts
    before it; outputs equal the engine without speculation and stay valid (seeded sampling and greedy)."""
    model = models["llama"]
    spec = NGRAM if method == "ngram" else draft(model)
    prompts = make_prompts([6] * 8, seed=9)
    specs = [{"json": SCHEMA}, {"regex": "(ab|cd){3,6}x"}, {"choice": ["alpha beta", "gamma"]},
             {"grammar": 'root ::= "<" [xyz]+ ">"'}]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=60,
                             structured_outputs=specs[i % 4]) for i in range(8)]
    want = _outputs(make_engine(model), prompts, params)
    engine = make_engine(model, speculative_config=spec)
    got = _outputs(engine, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    tok = engine.tokenizer
    for i, g in enumerate(got):
        text = tok.decode(g.token_ids, skip_special_tokens=True)
        if g.finish_reason != "stop":
            continue
        if i % 4 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif i % 4 == 1:
            assert re.fullmatch("(ab|cd){3,6}x", text), text
        elif i % 4 == 2:
            assert text in ("alpha beta", "gamma")
        else:
            assert re.fullmatch("<[xyz]+>", text), text
    assert engine.get_stats().spec_num_draft_tokens > 0


def test_no_drafts_once_disable_by_batch_size_sequences_run(models, make_engine):
    prompts = repetitive_prompts(7)[:4]
    want = run_all(make_engine(models["llama"]), prompts, GREEDY)
    never = make_engine(models["llama"], speculative_config={**NGRAM, "disable_by_batch_size": 1})
    assert run_all(never, prompts, GREEDY) == want and never.get_stats().spec_num_drafts == 0
    alone = make_engine(models["llama"], speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert run_all(alone, prompts[2:3], GREEDY) == want[2:3] and alone.get_stats().spec_num_drafts > 0


def test_a_step_emits_its_accepted_tokens_in_one_output(models, make_engine):
    """Outputs carry every token a step appended (streams see them in order, logprobs aligned)."""
    model = models["llama"]
    engine = make_engine(model, speculative_config=draft(model, 4))
    engine.add_request("a", repetitive_prompts()[0], SamplingParams(temperature=0, max_tokens=30, logprobs=1,
                                                                     ignore_eos=True))
    streamed, sizes = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_token_ids
            sizes.append(len(out.new_token_ids))
            assert len(out.logprobs) == len(out.new_token_ids)
            if out.finished:
                assert out.outputs[0].token_ids == streamed and len(streamed) == 30
    assert max(sizes) > 1


def test_acceptance_reaches_prometheus_the_monitor_and_status(models, make_engine):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pdcluster.cli.admin import _spec
    from pdcluster.monitor import NPUMonitor, figures_from_metrics
    from pdcluster.node.service import spec_decode_families

    model = models["llama"]
    engine = make_engine(model, speculative_config=draft(model, 3))
    run_all(engine, repetitive_prompts()[:3], GREEDY)
    stats = engine.get_stats()
    assert stats.spec_method == "draft_model" and stats.spec_num_drafts > 0
    assert stats.spec_mean_accepted_length == pytest.approx(1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts)

    class Stats:
        def collect(self):
            yield from spec_decode_families(stats)

    registry = CollectorRegistry()
    registry.register(Stats())
    values, labels = {}, {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            values.setdefault(s.name, s.value)
            labels.setdefault(s.name, s.labels)
    assert labels["pdcluster_node_spec_decode_accepted_tokens_total"] == {"method": "draft_model"}
    assert values["pdcluster_node_spec_decode_draft_tokens_total"] == stats.spec_num_draft_tokens
    from_node = figures_from_metrics(values, labels)
    local = NPUMonitor(engine).get_utilization()
    for figures in (from_node, local):
        assert figures["spec_method"] == "draft_model"
        assert figures["spec_acceptance_rate"] == pytest.approx(stats.spec_acceptance_rate)
        assert figures["spec_mean_accepted_length"] == pytest.approx(stats.spec_mean_accepted_length)
    assert _spec(local) == f"draft_model {stats.spec_acceptance_rate:.0%} x{stats.spec_mean_accepted_length:.2f}"
    plain = make_engine(model).get_stats()
    assert plain.spec_method == "" and list(spec_decode_families(plain)) == []
    assert _spec(figures_from_metrics({}, {})) == "-"


@pytest.mark.slow
def test_tensor_parallel_target_with_a_rank0_drafter(models, make_engine):
    """TP = 2 over gloo: the drafts travel to the other rank with the step inputs; the drafter runs on rank 0."""
    model = make_tiny_model(str(models["llama"]) + "-tp", "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    prompts = repetitive_prompts(6)
    kw = dict(max_num_batched_tokens=48, num_gpu_blocks_override=40, block_size=8, max_num_seqs=6)
    want = run_all(make_engine(model, **kw), prompts, GREEDY)
    for spec in (NGRAM, draft(model, 3)):
        engine = make_engine(model, tensor_parallel_size=2, speculative_config=spec, **kw)
        assert run_all(engine, prompts, GREEDY) == want, spec
        assert engine.get_stats().spec_num_accepted_tokens > 0
        engine.shutdown()   # one tensor-parallel engine per process at a time
