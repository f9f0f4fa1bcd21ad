"""Wire protocol: every message round-trips; every malformed frame is a ProtocolError, never a crash."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdcluster.control.protocol import (
    MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    FetchKV,
    Generate,
    Handback,
    KVFetched,
    Load,
    LoraAdapter,
    LoraDone,
    MoveAway,
    Ping,
    Pong,
    PreCopied,
    PreCopy,
    Prefill,
    PrefillDestination,
    PrefillDone,
    Progress,
    ProtocolError,
    Reject,
    TokenBatch,
    Tokens,
    decode,
    encode,
)

SAMPLES = [
    Generate(rid="r1", prompt_ids=[1, 2, 3], sampling={"temperature": 0.0, "max_tokens": 8, "stop": ["\n"]},
             prefill_node="prefill-a", timeout_s=30.0, router="router-1", resume_ids=[9, 8]),
    Generate(rid="r2", prompt_ids=[], sampling={}, prefill_node=None, timeout_s=0.0, kv_source="decode-b",
             kv_source_blocks=6, lora_name="sql", lora_path="/adapters/sql"),
    Tokens(rid="r1", ids=[5], logprobs=[[-0.1, [[5, -0.1], [6, -2.3]]]], finish="stop", num_prompt_tokens=3,
           num_cached_tokens=16, prefill_path="remote:prefill-a"),
    Tokens(rid="r1", ids=[], finish="error", error="kv checksum mismatch"),
    Tokens(rid="r1", ids=[7, 8], pos=12),
    TokenBatch(items=[Tokens(rid="r1", ids=[7], pos=2), Tokens(rid="r2", ids=[9], logprobs=[[-0.5, []]],
                                                             finish="length", pos=0, num_prompt_tokens=4)]),
    Progress(rids=["r1", "r2"], states=["queued", "prefilling"]),
    Reject(rid="r3", reason="queue full", retry_after=0.5),
    Abort(rid="r4"),
    Handback(rid="r4"),
    MoveAway(rid="r4", reason="drain"),
    PreCopy(rid="r4.2", token_ids=list(range(40)), kv_source="decode-b", num_blocks=2, timeout_s=30.0),
    PreCopied(rid="r4.2", num_blocks=2),
    PreCopied(rid="r4.2", error="holder 'x' is not a decode node of this cluster"),
    Prefill(rid="r5", prompt_ids=list(range(100)), sampling={"seed": 7},
            dst={"address": "tcp://127.0.0.1:7000", "block_ids": [3, 4], "token": b"\x00\xff"},
            decode_node="decode-a", timeout_s=123.5, skip_blocks=1, lora_name="sql", lora_hash="ab12"),
    Prefill(rid="r5b", prompt_ids=[1, 2], sampling={}, dst={}, decode_node="decode-a", timeout_s=15.0),
    PrefillDestination(rid="r5b", dst={"address": "127.0.0.1:7000", "block_ids": [3]}, skip_blocks=1),
    PrefillDone(rid="r5", first_token=42, logprobs=None, checksum=2**63 - 1, num_cached_tokens=16),
    PrefillDone(rid="r6", error="out of blocks"),
    FetchKV(rid="r7#fetch", block_hashes=[1, 2**63 - 1], timeout_s=5.0,
            dst={"address": "tcp://127.0.0.1:7000", "block_ids": [3, 4], "token": "t"}),
    KVFetched(rid="r7#fetch", num_blocks=2, checksum=12345, kv_backend="shm"),
    KVFetched(rid="r8#fetch", error="TransferError: cancelled"),
    LoraAdapter(rid="lora-1", name="sql", path="/adapters/sql"),
    LoraAdapter(rid="lora-2", name="sql"),
    LoraDone(rid="lora-1"),
    LoraDone(rid="lora-2", error="LoRA adapter 'sql' is in use by 1 request(s)"),
    Load(node_id="decode-a", role="decode", running=3, waiting=1, free_blocks=10, total_blocks=64,
         tokens_per_s=123.4, state="draining", kv_events=[[0, 0, [1, 2, 3]], [1, 2, [4]]], kv_seq=7, timestamp=1.5,
         loras=["sql", "chat"], max_loras=4),
    Ping(nonce=7),
    Pong(nonce=7),
]


def frame(**body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    out = decode(encode(msg))
    assert type(out) is type(msg) and out == msg


def test_every_message_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


def test_defaults_fill_missing_optional_fields():
    msg = decode(frame(v=PROTOCOL_VERSION, t="tokens", rid="x", ids=[1]))
    assert msg == Tokens(rid="x", ids=[1])


def test_int_accepted_where_float_expected():
    msg = decode(frame(v=PROTOCOL_VERSION, t="reject", rid="x", reason="busy", retry_after=1))
    assert isinstance(msg, Reject) and msg.retry_after == 1


@pytest.mark.parametrize("data, match", [
    (b"", "undecodable"),
    (b"\xc1", "undecodable"),  # a reserved msgpack byte
    (msgpack.packb([1, 2]), "expected a map"),
    (frame(t="ping", nonce=1), "protocol version None"),
    (frame(v=PROTOCOL_VERSION + 1, t="ping"), "protocol version"),
    (frame(v=PROTOCOL_VERSION, t="explode"), "unknown message type"),
    (frame(v=PROTOCOL_VERSION, nonce=1), "unknown message type"),
    (frame(v=PROTOCOL_VERSION, t="ping", nonce=1, evil=True), r"unknown fields \['evil'\]"),
    (frame(v=PROTOCOL_VERSION, t="abort"), "rid"),  # a required field is missing
    (frame(v=PROTOCOL_VERSION, t="abort", rid=5), "abort.rid: expected str"),
    (frame(v=PROTOCOL_VERSION, t="ping", nonce="1"), "ping.nonce: expected int"),
    (frame(v=PROTOCOL_VERSION, t="ping", nonce=True), "ping.nonce: expected int"),
    (frame(v=PROTOCOL_VERSION, t="reject", rid="x", reason="r", retry_after="soon"), "retry_after: expected float"),
    (frame(v=PROTOCOL_VERSION, t="tokens", rid="x", ids=[1, "2"]), "tokens.ids: expected a list of ints"),
    (frame(v=PROTOCOL_VERSION, t="tokens", rid="x", ids=[1, True]), "tokens.ids: expected a list of ints"),
    (frame(v=PROTOCOL_VERSION, t="tokens", rid="x", ids=7), "tokens.ids: expected a list of ints"),
    (frame(v=PROTOCOL_VERSION, t="tokens", rid="x", ids=[], logprobs="no"), "tokens.logprobs: expected a list"),
    (frame(v=PROTOCOL_VERSION, t="tokens", rid="x", ids=[], finish=3), "tokens.finish: expected str"),
    (frame(v=PROTOCOL_VERSION, t="generate", rid="x", prompt_ids=[1], sampling=[], prefill_node=None,
           timeout_s=1.0), "generate.sampling: expected a map"),
    (frame(v=PROTOCOL_VERSION, t="generate", rid="x", prompt_ids=[1], sampling={}, prefill_node=None,
           timeout_s=None), "generate.timeout_s: expected float"),
    (frame(v=PROTOCOL_VERSION, t="generate", rid="x", prompt_ids=[1], sampling={}, prefill_node=None,
           timeout_s=float("nan")), "generate.timeout_s: must be finite"),
    (frame(v=PROTOCOL_VERSION - 1, t="generate", rid="x", prompt_ids=[1], sampling={}, prefill_node=None,
           deadline=1.7e9), "protocol version"),  # a release that sent wall-clock deadlines is refused
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=7), "load.kv_events: expected a list"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[0, 0]]), "each group"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[2, 0, [1]]]), "each group"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[0, 3, [1]]]), "each group"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[True, 0, [1]]]), "each group"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[0, 0, 5]]), "each group"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[0, 0, [1, "2"]]]), "hashes must"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[0, 0, [-1]]]), "hashes must"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_events=[[0, 0, [1 << 63]]]), "hashes must"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode",
           kv_events=[[0, 0, [1] * (1 << 17)], [1, 0, [1] * (1 << 17) + [2]]]), "more than"),
    (frame(v=PROTOCOL_VERSION, t="generate", rid="r", prompt_ids=[1], sampling={}, prefill_node=None, timeout_s=1.0,
           kv_source_blocks=-1), "kv_source_blocks"),
    (frame(v=PROTOCOL_VERSION, t="fetch_kv", rid="r", block_hashes=[-1], dst={}, timeout_s=1.0), "hashes must"),
    (frame(v=PROTOCOL_VERSION, t="fetch_kv", rid="r", block_hashes=[0] * ((1 << 16) + 1), dst={}, timeout_s=1.0),
     "more than"),
    (frame(v=PROTOCOL_VERSION, t="fetch_kv", rid="r", block_hashes=["1"], dst={}, timeout_s=1.0), "list of ints"),
    (frame(v=PROTOCOL_VERSION, t="kv_fetched", rid="r", num_blocks=-2), "num_blocks"),
    (frame(v=PROTOCOL_VERSION, t="prefill_destination", rid="r", dst={}, skip_blocks=-1), "skip_blocks"),
    (frame(v=PROTOCOL_VERSION, t="prefill_destination", rid="r", dst=[]), "prefill_destination.dst: expected"),
    (frame(v=PROTOCOL_VERSION, t="pre_copy", rid="r", token_ids=[1], kv_source="d", num_blocks=0, timeout_s=1.0),
     "pre_copy.num_blocks"),
    (frame(v=PROTOCOL_VERSION, t="pre_copy", rid="r", token_ids=[1], kv_source="d", num_blocks=1, timeout_s=1e9),
     "pre_copy.timeout_s"),
    (frame(v=PROTOCOL_VERSION, t="pre_copy", rid="r", token_ids=[1], kv_source="d", num_blocks=1, timeout_s=0.0),
     "pre_copy.timeout_s"),
    (frame(v=PROTOCOL_VERSION, t="pre_copied", rid="r", num_blocks=-1), "pre_copied.num_blocks"),
    (frame(v=PROTOCOL_VERSION, t="move_away", rid="r", reason=3), "move_away.reason: expected str"),
    (frame(v=PROTOCOL_VERSION, t="lora_adapter", rid="r", name=""), "name: must not be empty"),
    (frame(v=PROTOCOL_VERSION, t="lora_adapter", rid="r", name="x" * 300), "at most"),
    (frame(v=PROTOCOL_VERSION, t="generate", rid="r", prompt_ids=[1], sampling={}, prefill_node=None, timeout_s=1.0,
           lora_path="/a"), "without lora_name"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", loras=[""]), "load.loras"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", loras=[3]), "load.loras"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", max_loras=-1), "max_loras"),
    (frame(v=PROTOCOL_VERSION, t="load", node_id="n", role="decode", kv_seq=-1), "kv_seq"),
])
def test_bad_frames_raise_protocol_error(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_oversize_frame_rejected_before_parsing():
    huge = b"\x00" * (MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(huge)
    # A valid message that is simply too big is refused the same way.
    big = encode(Prefill(rid="x", prompt_ids=[1], sampling={}, dst={"blob": b"\x00" * MAX_FRAME_BYTES},
                         decode_node="d", timeout_s=0.0))
    assert len(big) > MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(big)


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)
    assert all(dataclasses.is_dataclass(cls) and cls.TYPE for cls in MESSAGE_TYPES.values())
