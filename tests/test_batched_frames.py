"""Batched token frames: a decode node sends one `TokenBatch` per engine step per router; the router fans the
items out to their streams with each item's `Tokens` semantics (order, logprobs, stop strings, aborts, pos gaps)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import msgpack
import pytest
from router_fakes import make_tokenizer_dir, wait_until
from router_helpers import SCRIPT_TEXT, Env, expected

from pdcluster.control.protocol import PROTOCOL_VERSION, ProtocolError, TokenBatch, Tokens, decode, encode
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.decode_node.request import DecodeRequest, State


def test_token_batch_round_trips_and_leaves_defaults_off_the_wire() -> None:
    batch = TokenBatch(items=[Tokens(rid="a.1", ids=[5, 6], pos=3),
                              Tokens(rid="b.1", ids=[7], logprobs=[[-0.5, [[7, -0.5]]]], finish="length", pos=0,
                                     num_prompt_tokens=9, prefill_path="local")])
    assert decode(encode(batch)) == batch
    body = msgpack.unpackb(encode(batch))
    assert body["items"][0] == {"rid": "a.1", "ids": [5, 6], "pos": 3}


@pytest.mark.parametrize("item", [
    "not a map", {"rid": "a", "ids": [True]}, {"rid": "a", "ids": [1], "pos": -2}, {"rid": "a", "ids": [1], "x": 1},
    {"ids": [1]}, {"rid": 5, "ids": [1]},
])
def test_token_batch_items_are_checked_like_tokens(item) -> None:
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "t": "token_batch",
                           "items": [{"rid": "ok", "ids": [1]}, item]}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="token_batch|tokens"):
        decode(frame)


def test_step_tokens_numbers_positions_and_sends_a_held_backlog_first() -> None:
    req = DecodeRequest(rid="r.1", owner=b"r", prompt_ids=[1, 2, 3], params=SamplingParams(), deadline=0.0,
                        prefill_node="", state=State.ENGINE)
    out = SimpleNamespace(new_token_ids=[10], logprobs=[(-0.1, [(10, -0.1)])], finished=False, finish_reason=None,
                          num_cached_tokens=2, prompt_logprobs=None)
    first = req.tokens(out)
    assert (first.ids, first.pos, first.num_prompt_tokens, first.num_cached_tokens) == ([10], 0, 3, 2)
    assert first.logprobs == [[-0.1, [[10, -0.1]]]]
    req.hold(first)   # the router could not take it: held
    out2 = SimpleNamespace(new_token_ids=[11, 12], logprobs=[(-0.2, []), (-0.3, [])], finished=True,
                           finish_reason="length", num_cached_tokens=2)
    merged = req.tokens(out2)
    assert merged.ids == [10, 11, 12] and merged.pos == 0 and merged.finish == "length"
    assert [lp[0] for lp in merged.logprobs] == [-0.1, -0.2, -0.3] and req.backlog is None and req.sent == 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=256))
    yield e
    e.close()


@pytest.fixture(autouse=True)
def _released(request):
    yield
    if "env" in request.fixturenames:
        e = request.getfixturevalue("env")
        assert wait_until(lambda: e.http.get("/health").json()["in_flight"] == 0, timeout=5)
        assert wait_until(lambda: not e.app.state.router.decode.queues, timeout=5)


async def _stream(url: str, body: dict, stop_after: int = 0) -> list[dict]:
    """The chunks of one streamed completion; with stop_after, disconnect after that many chunks."""
    chunks = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json={"model": "tiny", "stream": True, **body}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if stop_after and len(chunks) == stop_after:
                        break
    return chunks


def _run_all(url: str, bodies: list[dict], stop_after: list[int] | None = None) -> list[list[dict]]:
    async def go():
        return await asyncio.gather(*(_stream(url, b, (stop_after or [0] * len(bodies))[i])
                                      for i, b in enumerate(bodies)))
    return asyncio.run(go())


@pytest.mark.slow
def test_concurrent_streams_from_shared_batches_keep_order_and_logprobs(env: Env) -> None:
    (node,) = env.use_nodes("ok", batch=True, delay=0.02)
    bodies = [{"prompt": "Hello", "max_tokens": 6 + i % 3, "logprobs": 2} for i in range(8)]
    results = _run_all(env.server.url, bodies)
    assert max(len(b.items) for b in node.batches) >= 2   # the streams really shared frames
    for body, chunks in zip(bodies, results, strict=True):
        n = body["max_tokens"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected(env, n)
        lps = [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"]["token_logprobs"]]
        assert lps == [-0.25 * (1 + k % 3) for k in range(n)]
        tops = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["top_logprobs"]]
        assert tops[0] == {env.tokenizer.token_text(env.script[0]): -0.25,
                           env.tokenizer.token_text(env.script[0] + 1): -0.5}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _rid_of(env: Env, node, prompt: str) -> str:
    ids = env.tokenizer.encode(prompt)
    return next(g.rid for g in node.generates if g.prompt_ids == ids)


@pytest.mark.slow
def test_stop_string_in_one_item_aborts_only_that_request(env: Env) -> None:
    (node,) = env.use_nodes("ok", batch=True, delay=0.02)
    stopped, full = _run_all(env.server.url, [{"prompt": "Hello", "max_tokens": 40, "stop": ["brown f"]},
                                              {"prompt": "Hello world", "max_tokens": 40}])
    assert "".join(c["choices"][0]["text"] for c in stopped) == " The quick "
    assert stopped[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in full) == " " + SCRIPT_TEXT
    assert full[-1]["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: [a.rid for a in node.aborts] == [_rid_of(env, node, "Hello")])


@pytest.mark.slow
def test_client_leaving_aborts_its_request_and_the_batch_goes_on_for_the_others(env: Env) -> None:
    (node,) = env.use_nodes("ok", batch=True, delay=0.03)
    gone, stays = _run_all(env.server.url, [{"prompt": "Hello", "max_tokens": 200},
                                            {"prompt": "Hello world", "max_tokens": 9}], stop_after=[2, 0])
    assert len(gone) == 2
    assert "".join(c["choices"][0]["text"] for c in stays) == expected(env, 9)
    assert stays[-1]["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: [a.rid for a in node.aborts] == [_rid_of(env, node, "Hello")])


@pytest.mark.slow
def test_a_pos_gap_in_one_item_migrates_that_request_alone(env: Env) -> None:
    idle = {"running": 0, "free_blocks": 1000, "total_blocks": 1000}
    gappy, = env.use_nodes("ok", batch=True, delay=0.02, load=idle, gap_prompt=env.tokenizer.encode("Hello"))
    other, = env.use_nodes("ok", batch=True, delay=0.02, load={**idle, "running": 50})
    env.source.set_nodes([gappy.info, other.info])   # both; the busy one gets only what the gap moves
    assert wait_until(lambda: len(env.http.get("/health").json()["decode_nodes"]) == 2)
    assert wait_until(lambda: all(n.load for n in env.app.state.router.cluster.candidates("decode")))
    moved, stays = _run_all(env.server.url, [{"prompt": "Hello", "max_tokens": 8},
                                             {"prompt": "Hello world", "max_tokens": 8}])
    assert "".join(c["choices"][0]["text"] for c in moved) == expected(env, 8)
    assert "".join(c["choices"][0]["text"] for c in stays) == expected(env, 8)
    assert len(gappy.generates) == 2   # both started on the idle node, shared its frames
    (resumed,) = other.generates       # only the request that lost a token moved
    assert resumed.prompt_ids == env.tokenizer.encode("Hello") and resumed.resume_ids == env.script[:1]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_real_decode_node_sends_one_frame_per_step_for_all_requests_of_a_router(etcd, cluster, tiny_llama):
    """Three requests from one router on a real decode node: their tokens come as `TokenBatch` frames (one
    per engine step), each request's items in order with consecutive `pos`, logprobs per token, and the
    same greedy tokens as a request run alone."""
    from node_helpers import PROMPT, WAIT, assert_idle, node_config, serving

    from pdcluster.control.protocol import Generate, Progress
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.control.transport import DealerClient
    from pdcluster.decode_node.node import DecodeNode

    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1).to_dict()
    node = DecodeNode(node_config("decode", tiny_llama, etcd, cluster))
    router = DealerClient()
    try:
        async with serving(node):
            router.connect(node.control.address)
            got: dict[str, list[Tokens]] = {}

            async def run(rids: list[str]) -> int:
                for rid in rids:
                    assert router.send(Generate(rid=rid, prompt_ids=PROMPT, sampling=sampling, prefill_node=None,
                                                timeout_s=60, router="router-b"))
                batches = 0
                while not all(got.get(r) and got[r][-1].finish for r in rids):
                    msg = await router.recv(timeout=WAIT)
                    assert msg is not None, got
                    if isinstance(msg, Progress):
                        continue
                    items = msg.items if isinstance(msg, TokenBatch) else [msg]
                    batches += isinstance(msg, TokenBatch)
                    assert len({i.rid for i in items}) == len(items)   # one item per request per step
                    for item in items:
                        got.setdefault(item.rid, []).append(item)
                return batches

            assert await run(["alone"]) == 0   # a single request: plain Tokens
            assert await run(["a", "b", "c"]) >= 1
            for rid in ("alone", "a", "b", "c"):
                items = got[rid]
                assert [i.pos for i in items] == [sum(len(x.ids) for x in items[:k]) for k in range(len(items))]
                assert items[-1].finish == "length" and sum(len(i.ids) for i in items) == 6
                assert all(len(i.logprobs) == len(i.ids) for i in items)
                assert [t for i in items for t in i.ids] == [t for i in got["alone"] for t in i.ids]
            await assert_idle(node)
    finally:
        router.close()
