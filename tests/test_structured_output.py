"""Structured output (vLLM's `structured_outputs`, xgrammar): the request field's shape, the grammar and its
bitmask on a tiny tokenizer (model vocabulary wider than the tokenizer's), and the engine generating valid JSON /
regex / choice output at temperature 0.8 for many seeds, composed with penalties and logprobs, after a resume
(migration), and failing an invalid schema with the field named."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from engine_helpers import make_prompts, run_outputs

from pdcluster.control.sampling_params import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "colour", "n"], "additionalProperties": False}


# ---- the request field ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"json_object": True},
                                  {"regex": "[a-c]{3}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "x"'}])
def test_structured_outputs_shapes_are_accepted_and_survive_the_wire(spec):
    p = SamplingParams(structured_outputs=spec)
    assert SamplingParams.from_dict(p.to_dict()).structured_outputs == spec


@pytest.mark.parametrize("spec, words", [
    ({}, "exactly one"), ({"json": SCHEMA, "regex": "a"}, "exactly one"), ({"yaml": "x"}, "unknown key"),
    ({"json": 3}, "structured_outputs.json"), ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"), ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json_object": "yes"}, "json_object"), ([1], "must be an object"), ({"grammar": "x" * 70000}, "too long")])
def test_structured_outputs_bad_shapes_are_refused_naming_the_field(spec, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(structured_outputs=spec)


# ---- grammar and bitmask on the tiny tokenizer ---------------------------------------------------

@pytest.fixture(scope="module")
def compiler():
    from pdcluster.engine.structured_output import GrammarCompiler
    from pdcluster.engine.testing import build_tokenizer

    tok = build_tokenizer(400)
    c = GrammarCompiler(tok, 512, [tok.eos_token_id])   # model logits 512 wide, tokenizer 400 tokens
    yield tok, c
    c.shutdown()


def test_bitmask_allows_only_the_grammar_and_never_the_padding(compiler):
    from pdcluster.engine.structured_output import BitmaskBuffer, Grammar

    tok, c = compiler
    g = Grammar(c.submit({"choice": ["abc", "abd"]}))
    logits = torch.zeros(3, 512)
    BitmaskBuffer(512).apply(logits, [None, g, None])
    allowed = (logits[1] > -torch.inf).nonzero().flatten().tolist()
    assert allowed and max(allowed) < 400
    assert all("abc".startswith(tok.decode([t])) or "abd".startswith(tok.decode([t])) for t in allowed)
    assert bool((logits[[0, 2]] == 0).all())   # rows without a grammar untouched
    # walk "abc" greedily through the matcher: EOS becomes the only choice, then the matcher terminates
    for t in tok.encode("abc"):
        g.accept(t)
    logits = torch.zeros(1, 512)
    BitmaskBuffer(512).apply(logits, [g])
    assert (logits[0] > -torch.inf).nonzero().flatten().tolist() == [tok.eos_token_id]
    g.accept(tok.eos_token_id)
    assert g.terminated


def test_grammar_after_the_thinking_end_holds_only_the_answer(compiler):
    """With `after` (a reasoning model's </think> ids), the grammar masks nothing and matches nothing until the
    output has contained those ids, in order and adjacent; from the next token on it holds."""
    from pdcluster.engine.structured_output import BitmaskBuffer, Grammar

    tok, c = compiler
    gate = [301, 302]
    g = Grammar(c.submit({"choice": ["abc"], "after": gate}), after=gate)
    mask = BitmaskBuffer(512)
    for token in [301, 7, 302, 302, 9]:   # the pieces apart or out of order do not open it
        logits = torch.zeros(1, 512)
        mask.apply(logits, [g])
        assert g.open and bool((logits == 0).all())   # free: off-grammar tokens are accepted without complaint
        g.accept(token)
    g.accept(301)
    g.accept(302)
    assert not g.open
    logits = torch.zeros(1, 512)
    mask.apply(logits, [g])
    allowed = (logits[0] > -torch.inf).nonzero().flatten().tolist()
    assert allowed and all("abc".startswith(tok.decode([t])) for t in allowed)
    for t in tok.encode("abc") + [tok.eos_token_id]:
        g.accept(t)
    assert g.terminated


def test_engine_grammar_after_a_resumed_thinking_part(make_engine, tiny_llama):
    """A request whose output so far is free text ending in the gate (a migrated reasoning model's thinking):
    everything after it is valid JSON; the same schema without the gate would have refused that free text."""
    engine = make_engine(tiny_llama)
    prompt = make_prompts([11], seed=4)[0]
    thinking = [40, 41, 42, 43, 44]   # free tokens, the last two the gate
    spec = {"json": SCHEMA, "after": thinking[-2:]}
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=120, structured_outputs=spec)
    out = run_outputs(engine, [prompt + thinking], [params], resumed_output_ids=thinking)[0]
    assert out.finish_reason == "stop" and out.error is None
    jsonschema.validate(json.loads(engine.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)),
                        SCHEMA)
    failed = run_outputs(engine, [prompt + thinking], [SamplingParams(**{**params.to_dict(), "structured_outputs":
                                                                   {"json": SCHEMA}})],
                  resumed_output_ids=thinking)[0]
    assert failed.error is not None   # the free text does not follow the grammar


def test_a_token_off_the_grammar_is_refused(compiler):
    from pdcluster.engine.structured_output import Grammar

    tok, c = compiler
    g = Grammar(c.submit({"regex": "a+"}))
    g.accept(tok.encode("a")[0])   # may be held until the compile is done, then replayed
    g.matcher_now()
    with pytest.raises(ValueError, match="does not follow"):
        g.accept(tok.encode("z")[0])


@pytest.mark.parametrize("spec", [{"json": '{"type": "object", "properties": 5}'}, {"regex": "(a"},
                                  {"grammar": "root ::= "}])
def test_an_invalid_grammar_fails_its_compile_naming_the_field(compiler, spec):
    _, c = compiler
    with pytest.raises(ValueError, match=f"structured_outputs.{next(iter(spec))}"):
        c.submit(spec).result(30)


# ---- the engine -----------------------------------------------------------------------------------

def _text(engine, out) -> str:
    return engine.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_engine_json_schema_is_valid_for_many_seeds_with_penalties_and_logprobs(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    n = 24
    prompts = make_prompts([5 + i % 7 for i in range(n)], seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50 if i % 2 else 0, seed=i, max_tokens=120,
                             repetition_penalty=1.1 if i % 3 == 0 else 1.0, presence_penalty=0.5 if i % 4 == 0 else 0.0,
                             logprobs=3 if i % 5 == 0 else None, structured_outputs={"json": SCHEMA})
              for i in range(n)]
    outs = run_outputs(engine, prompts, params)
    assert engine.get_stats().num_waiting_for_grammar == 0
    for out, sp in zip(outs, params, strict=True):
        assert out.finish_reason == "stop", _text(engine, out)
        jsonschema.validate(json.loads(_text(engine, out)), SCHEMA)
        if sp.logprobs is not None:   # of the masked distribution: every alternative is allowed, so finite
            for sampled, top in out.outputs[0].logprobs:
                assert sampled > -float("inf") and all(lp > -float("inf") for _, lp in top[:1])
    # seeded: the same outputs again, in a different batch
    again = run_outputs(engine, prompts[:3], params[:3])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:3]]


def test_engine_regex_choice_json_object_and_grammar(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    specs = [{"regex": "[a-d]{2,5}-[0-9]{2}"}, {"choice": ["alpha", "beta", "gamma delta"]}, {"json_object": True},
             {"grammar": 'root ::= "<" [xyz]+ ">"'}]
    prompts = make_prompts([9] * 16, seed=5)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=200, structured_outputs=specs[i % 4])
              for i in range(16)]
    for i, out in enumerate(run_outputs(engine, prompts, params)):
        text = _text(engine, out)
        kind = i % 4
        if kind == 2 and out.finish_reason == "length":   # a random model may nest JSON past max_tokens
            continue
        assert out.finish_reason == "stop", (specs[kind], text)
        if kind == 0:
            assert re.fullmatch("[a-d]{2,5}-[0-9]{2}", text), text
        elif kind == 1:
            assert text in ("alpha", "beta", "gamma delta")
        elif kind == 2:
            assert isinstance(json.loads(text), dict)
        else:
            assert re.fullmatch("<[xyz]+>", text), text


def test_engine_resumed_request_rebuilds_the_matcher(make_engine, tiny_llama):
    """A migrated request: its outputs so far are the tail of the prompt; the grammar accepts them first."""
    engine = make_engine(tiny_llama)
    prompt = make_prompts([11], seed=9)[0]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=120, structured_outputs={"json": SCHEMA})
    whole = run_outputs(engine, [prompt], [params])[0].outputs[0].token_ids
    cut = len(whole) // 2
    rest = SamplingParams(**{**params.to_dict(), "max_tokens": 120 - cut})
    out = run_outputs(engine, [prompt + whole[:cut]], [rest], resumed_output_ids=whole[:cut])[0]
    text = engine.tokenizer.decode(whole[:cut] + out.outputs[0].token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_engine_fails_an_invalid_schema_with_the_field_named(make_engine, tiny_llama):
    engine = make_engine(tiny_llama)
    out = run_outputs(engine, [[5, 6, 7]], [SamplingParams(structured_outputs={"json": '{"type": "nonsense"}'})])[0]
    assert out.finished and out.finish_reason == "abort"
    assert out.error is not None and "structured_outputs.json" in out.error


def test_after_is_checked_and_carried():
    ok = SamplingParams(structured_outputs={"regex": "a+", "after": [5, 6]})
    assert SamplingParams.from_dict(ok.to_dict()).structured_outputs == {"regex": "a+", "after": [5, 6]}
    for bad in ([], [-1], list(range(17)), "x"):
        with pytest.raises(ValueError, match="structured_outputs.after"):
            SamplingParams(structured_outputs={"regex": "a+", "after": bad})


# ---- the router's mapping of the request fields ---------------------------------------------------

class _Req:
    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"structured_outputs": {"regex": "a+", "json": None}}, {"regex": "a+"}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
])
def test_router_maps_every_field_to_structured_outputs(fields, expected):
    from pdcluster.router.structured_output import structured_outputs_of

    assert structured_outputs_of(_Req(**fields)) == expected


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"lark": "x"}}, "structured_outputs"),
    ({"guided_json": "[1,"}, "guided_json"), ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_grammar": "just text"}, "guided_grammar"),
])
def test_router_refuses_bad_fields_naming_them(fields, param):
    from pdcluster.router.errors import APIError
    from pdcluster.router.structured_output import structured_outputs_of

    with pytest.raises(APIError) as info:
        structured_outputs_of(_Req(**fields))
    assert info.value.status == 400 and info.value.param == param
