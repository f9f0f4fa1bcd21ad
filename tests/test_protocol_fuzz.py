"""Any bytes on a wire port decode to a message or raise ProtocolError — nothing else can escape into a
receive loop (hypothesis-generated frames: raw bytes and msgpack maps shaped like our messages)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import message_like

from pdcluster.control.protocol import PROTOCOL_VERSION, Message, ProtocolError, decode
from pdcluster.control.transport import DroppedFrames


def decodes_or_refuses(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert isinstance(msg, Message)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_raise_protocol_error(frame):
    decodes_or_refuses(frame)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message_like)
def test_message_shaped_maps_decode_or_raise_protocol_error(body):
    decodes_or_refuses(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("body", [
    {"v": PROTOCOL_VERSION, "t": [1]},                     # the 10-byte frame that once killed a node's control loop
    {"v": PROTOCOL_VERSION, "t": {"a": 1}},
    {"v": PROTOCOL_VERSION, "t": "generate", 1: 2},
    {"v": PROTOCOL_VERSION, "t": "tokens", "rid": "r", "ids": [True]},
])
def test_frames_that_once_escaped_as_other_exceptions(body):
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(body, strict_types=False))


def test_dropped_frames_are_counted_and_logged_at_a_bounded_rate(caplog):
    dropped = DroppedFrames("test socket")
    with caplog.at_level("WARNING", logger="pdcluster.control.transport"):
        for _ in range(1000):
            assert dropped.decode(b"\x81\xa1v\x01") is None
    assert dropped.count == 1000
    assert len(caplog.records) == 1 and "test socket" in caplog.records[0].getMessage()


@pytest.mark.parametrize("field,value", [("block_size", 0), ("free_blocks", -1), ("running", -5),
                                         ("tokens_per_s", float("inf")), ("timestamp", float("nan"))])
def test_load_reports_with_values_a_router_cannot_compute_with_are_refused(field, value):
    from pdcluster.control.protocol import Load, encode

    good = Load(node_id="n", role="decode", block_size=16, free_blocks=3)
    assert decode(encode(good)) == good
    with pytest.raises(ProtocolError, match=f"load.{field}"):
        decode(encode(Load(node_id="n", role="decode", **{field: value})))
