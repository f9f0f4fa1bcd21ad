"""The router's per-token path without HTTP: SSE chunk bytes, TokenBatch item checks."""

from __future__ import annotations

import msgpack
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from router_fakes import make_tokenizer_dir

from pdcluster.control.protocol import PROTOCOL_VERSION, ProtocolError, TokenBatch, Tokens, decode, encode
from pdcluster.router.generation import ChoiceDelta
from pdcluster.router.responses import ChunkWriter
from pdcluster.router.tokenizer import ServedModel
from pdcluster.router.validation import Prepared


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ServedModel:
    return ServedModel.load('odd "name" \\ 模型', make_tokenizer_dir(str(tmp_path_factory.mktemp("tok"))))


def _writer(model: ServedModel, chat: bool, include_usage: bool, n: int = 2) -> ChunkWriter:
    prep = Prepared(model=model, prompt_ids=[1, 2], sampling=[{}] * n, stop=[], skip_special_tokens=True,
                    stream=True, include_usage=include_usage)
    return ChunkWriter(prep, n, chat, want_logprobs=False)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@given(text=st.text(max_size=20), index=st.integers(0, 1))
def test_text_chunk_from_its_template_is_the_generic_chunk(model, chat, include_usage, text, index) -> None:
    out = _writer(model, chat, include_usage)
    fast = out.delta(ChoiceDelta(index, text))
    assert fast == out.chunk([out._choice(ChoiceDelta(index, text))])
    body = orjson.loads(fast[len(b"data: "):])
    assert fast.endswith(b"\n\n") and body["model"] == model.name
    choice = body["choices"][0]
    assert choice["index"] == index and choice["finish_reason"] is None
    assert (choice["delta"]["content"] if chat else choice["text"]) == text
    assert ("usage" in body) == include_usage


def test_last_chunk_still_carries_its_finish_reason(model) -> None:
    out = _writer(model, chat=True, include_usage=False)
    body = orjson.loads(out.delta(ChoiceDelta(0, "", finish_reason="length"))[len(b"data: "):])
    assert body["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def _batch_frame(items: list) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": TokenBatch.TYPE, "items": items}, use_bin_type=True)


def test_token_batch_items_round_trip_in_order() -> None:
    items = [Tokens(rid="a.1", ids=[5], pos=0, num_prompt_tokens=3, prefill_path="local"),
             Tokens(rid="b.1", ids=[6, 7], pos=4), Tokens(rid="a.1", ids=[8], pos=1, finish="length"),
             Tokens(rid="c.1", ids=[9], pos=2, logprobs=[[-0.5, [[9, -0.5]]]])]
    assert decode(encode(TokenBatch(items=items))).items == items


@pytest.mark.parametrize("item", [
    {"rid": "a", "ids": [1.0], "pos": 0}, {"rid": "a", "ids": [True], "pos": 0}, {"rid": "a", "ids": 7, "pos": 0},
    {"rid": "a", "ids": [1], "pos": -2}, {"rid": 3, "ids": [1], "pos": 0}, {"rid": "a", "ids": [1], "pos": "0"},
    {"rid": "a", "ids": [1, "x"], "pos": 0}, {"rid": "a", "ids": [1], "bogus": 0}, ["a", [1], 0],
    {"rid": "a", "ids": [1, 2], "pos": 0, "logprobs": [[-0.1, []]]}])
def test_token_batch_refuses_what_a_tokens_frame_refuses(item) -> None:
    with pytest.raises(ProtocolError):
        decode(_batch_frame([{"rid": "ok", "ids": [1], "pos": 0}, item]))


def test_appended_tokens_keep_logprobs_aligned_with_ids() -> None:
    lp = [-0.5, [[7, -0.5]]]
    msg = Tokens(rid="a.1", ids=[1], pos=0, num_prompt_tokens=4)
    msg.append(Tokens(rid="a.1", ids=[2, 3], pos=1, logprobs=[lp, lp]))
    msg.append(Tokens(rid="a.1", ids=[4], pos=3, finish="length"))
    assert msg == Tokens(rid="a.1", ids=[1, 2, 3, 4], pos=0, num_prompt_tokens=4, logprobs=[None, lp, lp, None],
                         finish="length")
    assert decode(encode(msg)) == msg   # what a merged backlog sends is a valid frame
