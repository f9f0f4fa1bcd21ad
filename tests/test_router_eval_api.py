"""The router's evaluation and utility surface against fake decode nodes (real uvicorn, httpx and the openai
client): /tokenize, /detokenize, /version, echo, max_tokens 0, logit_bias and prompt_logprobs on the wire, and
bad input as 400s. The engine side (real prompt logprobs through a cluster) is tests/test_lm_eval.py."""

from __future__ import annotations

import json

import pytest
from router_fakes import make_tokenizer_dir, wait_until
from router_helpers import SCRIPT_TEXT, Env, expected

from pdcluster.control.records import NodeInfo

pytestmark = pytest.mark.slow  # real sockets and a server thread


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=256))
    yield e
    e.close()


@pytest.fixture(autouse=True)
def _stop_nodes(env):
    yield
    assert wait_until(lambda: env.http.get("/health").json()["in_flight"] == 0, timeout=5)
    for n in env.nodes:
        n.stop()
    env.nodes.clear()
    env.source.set_nodes([])


def test_tokenize_detokenize_round_trip(env: Env) -> None:
    text = "The lazy dog jumps over the quick brown fox."
    r = env.http.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    ids = env.tokenizer.encode(text)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 256
    assert r["token_strs"] == [env.tokenizer.token_text(t) for t in ids]
    assert env.http.post("/detokenize", json={"model": "tiny", "tokens": ids}).json() == \
        {"prompt": env.tokenizer.decode(ids, skip_special_tokens=False)}
    bare = env.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()   # model optional
    assert env.http.post("/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"] == text
    assert bare["token_strs"] is None


def test_tokenize_messages_uses_the_chat_template(env: Env) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    r = env.http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert r["tokens"] == env.tokenizer.apply_chat_template(messages)
    bare = env.http.post("/tokenize", json={"model": "tiny", "messages": messages,
                                            "add_generation_prompt": False}).json()
    assert bare["tokens"] == env.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert bare["count"] < r["count"]


def test_version(env: Env) -> None:
    import importlib.metadata

    assert env.http.get("/version").json() == {"version": importlib.metadata.version("pdcluster")}


BAD = [
    ("/tokenize", {"model": "tiny"}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": 5}, "prompt"),
    ("/detokenize", {"model": "tiny", "tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": "abc"}, "tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "prompt_logprobs": -1, "echo": True, "logprobs": 5},
     "prompt_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"1": "a"}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"3": -100.5}}, "logit_bias"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=range(len(BAD)))
def test_bad_input_is_a_400_naming_the_field(env: Env, path: str, body, param) -> None:
    r = env.http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_model_on_tokenize_is_404(env: Env) -> None:
    r = env.http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_echo_prepends_the_prompt(env: Env) -> None:
    env.use_nodes("ok")
    out = env.client.completions.create(model="tiny", prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    generated = expected(env, 3)   # the tokens' text after the prompt (its leading space kept)
    assert out.choices[0].text == "Hello world" + generated and out.usage.completion_tokens == 3
    chunks = list(env.client.completions.create(model="tiny", prompt="Hello world", max_tokens=3, echo=True,
                                                stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hello world" + generated
    assert chunks[0].choices[0].text == "Hello world"


def test_echo_with_max_tokens_0_returns_only_the_prompt(env: Env) -> None:
    (node,) = env.use_nodes("ok")
    out = env.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=0, echo=True)
    assert out.choices[0].text == env.tokenizer.decode([5, 6, 7], skip_special_tokens=False)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 0
    assert node.generates[0].sampling["max_tokens"] == 1   # one token is run and dropped, as vLLM does
    chunks = list(env.client.completions.create(model="tiny", prompt="Hi", max_tokens=0, echo=True, stream=True))
    assert [c.choices[0].text for c in chunks] == ["Hi"] and chunks[0].choices[0].finish_reason == "length"


def test_logit_bias_and_prompt_logprobs_reach_the_decode_node_which_prefills_such_prompts(env: Env) -> None:
    (node,) = env.use_nodes("ok")
    env.source.add(NodeInfo(node_id="p0", role="prefill", model="tiny"))
    assert wait_until(lambda: env.http.get("/health").json()["prefill_nodes"] == ["p0"], timeout=5)
    long = "Hello world " * 30   # past disagg_min_tokens: normally prefilled remotely
    env.client.completions.create(model="tiny", prompt=long, max_tokens=1, logit_bias={"7": 5, "9": -100})
    env.client.completions.create(model="tiny", prompt=long, max_tokens=1, echo=True, logprobs=2)
    env.client.completions.create(model="tiny", prompt=long, max_tokens=1, extra_body={"prompt_logprobs": 1})
    first, echoed, asked = node.generates
    assert first.sampling["logit_bias"] == {"7": 5.0, "9": -100.0} and first.prefill_node == "p0"
    assert echoed.sampling["prompt_logprobs"] == 2 and echoed.prefill_node is None
    assert asked.sampling["prompt_logprobs"] == 1 and asked.prefill_node is None
    assert first.sampling["prompt_logprobs"] is None


def test_echo_without_engine_prompt_logprobs_gives_nulls_not_an_error(env: Env) -> None:
    """The fake node sends no prompt logprobs: the prompt tokens are listed with null logprobs (never NaN)."""
    env.use_nodes("ok")
    out = env.client.completions.create(model="tiny", prompt="Hello world", max_tokens=2, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    n_prompt = len(env.tokenizer.encode("Hello world"))
    assert len(lp.tokens) == n_prompt + 2 and lp.token_logprobs[:n_prompt] == [None] * n_prompt
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == sum(len(t) for t in lp.tokens[:n_prompt])
    assert SCRIPT_TEXT.startswith(out.choices[0].text[len("Hello world"):].strip()[:5])
