import msgpack
import pytest

from pdcluster.control.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert p.ignore_eos is False and p.min_tokens == 0 and p.skip_special_tokens is True
    assert not p.greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", "abc"), ("temperature", float("nan")), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("top_k", -2), ("top_k", 2.5), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.01),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", None), ("max_tokens", 1.5),
    ("n", 0), ("n", True),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", "3"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("seed", "x"), ("seed", 1.5),
    ("stop", [1, 2]), ("stop", 3), ("stop", [""]),
    ("stop_token_ids", ["a"]), ("stop_token_ids", [-1]), ("stop_token_ids", 5),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1),
    ("min_tokens", -1),
    # limits: every integer fits msgpack's int64, floats are finite, lists are capped
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("top_k", 1 << 63), ("max_tokens", 10 ** 30),
    ("min_tokens", 1 << 70), ("n", 1 << 64), ("temperature", 10 ** 400), ("top_p", float("inf")),
    ("stop", ["a"] * 65), ("stop", ["a" * 4097]), ("stop_token_ids", [1] * 1025), ("stop_token_ids", [1 << 64]),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_unknown_names_rejected():
    with pytest.raises(ValueError, match="'foo'"):
        SamplingParams(foo=1)
    with pytest.raises(ValueError, match="'foo'"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    with pytest.raises(ValueError):
        SamplingParams.from_dict(["temperature", 0.5])


def test_accepted_edge_values_and_normalisation():
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, stop="###", logprobs=20,
                       presence_penalty=-2, frequency_penalty=2, seed=-7, stop_token_ids=(3, 4))
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.top_k == 0          # -1 and 0 both mean "off"
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert p.greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=2, temperature=0.5).greedy


def test_round_trip_through_msgpack():
    p = SamplingParams(n=2, max_tokens=100, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                       repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=1234,
                       stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, min_tokens=3,
                       logprobs=5, skip_special_tokens=False)
    wire = msgpack.unpackb(msgpack.packb(p.to_dict()))
    q = SamplingParams.from_dict(wire)
    assert q == p
    assert q.to_dict() == p.to_dict()
    assert SamplingParams.from_dict(SamplingParams().to_dict()) == SamplingParams()


def test_to_dict_does_not_alias_lists():
    p = SamplingParams(stop=["a"])
    d = p.to_dict()
    d["stop"].append("b")
    assert p.stop == ["a"]


def test_limits_accept_their_edges():
    from pdcluster.control.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    p = SamplingParams(seed=(1 << 63) - 1, top_k=(1 << 63) - 1, stop=["a" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                       stop_token_ids=[7] * MAX_STOP_TOKEN_IDS)
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict()))) == p
    assert SamplingParams(seed=-(1 << 63)).seed == -(1 << 63)
