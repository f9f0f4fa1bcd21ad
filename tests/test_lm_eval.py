"""Evaluation through the cluster: a real 1P1D cluster (etcd, router, prefill and decode processes) on a tiny
random checkpoint with a real tokenizer, the official `openai` client and `lm-eval`'s `local-completions`.

Echo + logprobs (what lm-eval's log-likelihood sends: max_tokens 0 or 1 with echo) return the prompt's logprobs
equal to the offline engine's; logit_bias steers the cluster's sampler; and lm-eval scores a small local task
(a JSON-lines file and task YAML written here: one multiple-choice task, one generate-until task) through the
router exactly as it scores the offline engine wrapped in a minimal lm-eval `TemplateLM` ("directly")."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from cluster_helpers import client, wait_idle

from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.sampling_params import SamplingParams

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]  # a whole cluster of processes, and the harness

MODEL_NAME = "tiny-eval"
TOL = 2e-3   # fp32 engines on both sides; the JSON round trip is exact


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("eval") / MODEL_NAME), "llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    c = LocalCluster(model=model_dir, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=1,
                     port=0, cluster="lm-eval", lease_ttl=2, threads_per_node=1,
                     node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 16, "device": "cpu"},
                     router_config={"disagg_min_tokens": 0})
    with c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir):
    from pdcluster import LLM

    return LLM(model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=512)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _offline_prompt_logprobs(llm, ids: list[int], top: int) -> list:
    return llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top))[0].prompt_logprobs


def test_echo_logprobs_equal_the_engines_prompt_logprobs(cluster, llm, hf_tokenizer):
    ids = hf_tokenizer("The quick brown fox jumps over the lazy dog and runs away", add_special_tokens=False).input_ids
    want = _offline_prompt_logprobs(llm, ids, 2)

    async def go():
        async with client(cluster) as c:
            only = await c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=2)
            plus = await c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                              temperature=0)
            chunks = [ch async for ch in await c.completions.create(
                model=MODEL_NAME, prompt=ids, max_tokens=2, echo=True, logprobs=1, temperature=0, stream=True)]
            two = await c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, echo=True, temperature=0)
            vllm = await c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1,
                                              extra_body={"prompt_logprobs": 2})
            return only, plus, chunks, two, vllm

    only, plus, chunks, two, vllm = asyncio.run(go())
    lp = only.choices[0].logprobs
    assert only.choices[0].text == hf_tokenizer.decode(ids) and only.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([w[0] for w in want[1:]], abs=TOL)
    for got_top, w in zip(lp.top_logprobs[1:], want[1:], strict=True):
        assert sorted(got_top.values(), reverse=True) == pytest.approx([v for _, v in w[1]], abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    # max_tokens 1: the prompt's entries, then the generated token's (what lm-eval slices off with [ctxlen:-1])
    plp = plus.choices[0].logprobs
    assert len(plp.token_logprobs) == len(ids) + 1
    assert plp.token_logprobs[1:-1] == pytest.approx(lp.token_logprobs[1:], abs=TOL)
    assert plus.choices[0].text.startswith(only.choices[0].text)
    # streamed: the first chunk is the prompt with its logprobs
    first = chunks[0].choices[0]
    assert first.text == only.choices[0].text and first.logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=TOL)
    # (a loaded node may deliver both generated tokens in one chunk: compare the whole text, not chunk by chunk)
    assert "".join(ch.choices[0].text for ch in chunks) == two.choices[0].text
    assert two.choices[0].text.startswith(plus.choices[0].text)
    # vLLM's prompt_logprobs field: per prompt token {id: {logprob, rank, decoded_token}}, the first null
    entries = vllm.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for j in range(1, len(ids)):
        assert entries[j][str(ids[j])]["logprob"] == pytest.approx(want[j][0], abs=TOL)
        ranked = sorted((e["rank"], e["logprob"]) for e in entries[j].values() if e["rank"] is not None)
        assert [r for r, _ in ranked] == [1, 2]
    wait_idle(cluster)


def test_logit_bias_steers_the_clusters_sampler(cluster, llm, hf_tokenizer, model_dir):
    from pdcluster.router.tokenizer import Tokenizer

    token_text = Tokenizer(model_dir).token_text
    ids = hf_tokenizer("Once upon a time", add_special_tokens=False).input_ids
    plain = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    favourite = next(t for t in range(10, 400) if t not in plain.outputs[0].token_ids)
    banned = plain.outputs[0].token_ids[0]
    biased = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={banned: -100}))[0]
    assert biased.outputs[0].token_ids[0] != banned

    async def go():
        async with client(cluster) as c:
            forced = await c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0.9, seed=3,
                                                logit_bias={str(favourite): 100}, extra_body={"ignore_eos": True},
                                                logprobs=0)
            avoid = await c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0,
                                               logit_bias={str(banned): -100}, logprobs=0)
            return forced, avoid

    forced, avoid = asyncio.run(go())
    assert forced.choices[0].logprobs.tokens == [token_text(favourite)] * 4
    assert avoid.choices[0].logprobs.tokens == [token_text(biased.outputs[0].token_ids[0])]
    wait_idle(cluster)


# ---- lm-eval ------------------------------------------------------------------------------------------------

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a dog"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven", " blue"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue", " loud"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " apples"], "answer": 0},
    {"question": "A cat says", "choices": [" woof", " meow", " moo", " quack"], "answer": 1},
    {"question": "The opposite of hot is", "choices": [" cold", " warm"], "answer": 0},
]

MC_TASK = """task: pd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_TASK = """task: pd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _reference_lm(llm, tokenizer):
    """lm-eval's TemplateLM over the offline engine: the same tokenization (the base class), log-likelihoods
    from the engine's prompt logprobs, greedy generation cut at the stop strings."""
    from lm_eval.api.model import TemplateLM

    class OfflineEngine(TemplateLM):
        @property
        def eot_token_id(self) -> int:
            return tokenizer.eos_token_id

        def tok_encode(self, string, **kwargs):
            return tokenizer(string, add_special_tokens=False).input_ids

        def _loglikelihood_tokens(self, requests, **kwargs):
            out = []
            for _, context, continuation in requests:
                entries = _offline_prompt_logprobs(llm, context + continuation, 1)[len(context):]
                greedy = all(math.isclose(lp, top[0][1], abs_tol=1e-6) for lp, top in entries)
                out.append((sum(lp for lp, _ in entries), greedy))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for req in requests:
                context, kwargs = req.args
                ids = self.tok_encode(context)
                done = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=kwargs["max_gen_toks"]))[0]
                text = done.outputs[0].text
                for stop in kwargs["until"]:
                    text = text.split(stop)[0]
                out.append(text)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

    return OfflineEngine()


def _evaluate(model, tasks_dir: str, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=["pd_mc", "pd_gen"], task_manager=TaskManager(
        include_path=tasks_dir), log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        fewshot_random_seed=0, **kwargs)


def test_lm_eval_scores_through_the_router_equal_the_engines(cluster, llm, hf_tokenizer, model_dir, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "pd_mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "pd_gen.yaml").write_text(GEN_TASK.format(data=data))

    via_router = _evaluate("local-completions", str(tmp_path), model_args=(
        f"model={MODEL_NAME},base_url={cluster.url}/v1/completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"))
    direct = _evaluate(_reference_lm(llm, hf_tokenizer), str(tmp_path))

    for task, metric in (("pd_mc", "acc,none"), ("pd_gen", "exact_match,none")):
        assert via_router["results"][task][metric] == direct["results"][task][metric], task
    router_mc = {s["doc_id"]: s for s in via_router["samples"]["pd_mc"]}
    direct_mc = {s["doc_id"]: s for s in direct["samples"]["pd_mc"]}
    assert sorted(router_mc) == list(range(len(DOCS)))
    for doc_id, sample in direct_mc.items():
        got = [r[0][0] for r in router_mc[doc_id]["resps"]]
        want = [r[0][0] for r in sample["resps"]]
        assert got == pytest.approx(want, abs=TOL), doc_id
        assert all(math.isfinite(v) and v < 0 for v in got)
    router_gen = {s["doc_id"]: s["filtered_resps"] for s in via_router["samples"]["pd_gen"]}
    assert router_gen == {s["doc_id"]: s["filtered_resps"] for s in direct["samples"]["pd_gen"]}
    texts = [r[0] if isinstance(r, list) else r for r in router_gen.values()]
    assert all(isinstance(t, str) for t in texts) and any(t.strip() for t in texts)   # something was generated
    wait_idle(cluster)
