"""Hypothesis strategies for wire frames: msgpack-able values, and maps shaped like pdcluster.control.protocol
messages (a known or junk `v` and `t`, any subset of the messages' field names, any values)."""

from __future__ import annotations

from hypothesis import strategies as st

from pdcluster.control.protocol import MESSAGE_TYPES, PROTOCOL_VERSION

FIELD_NAMES = sorted({name for cls in MESSAGE_TYPES.values() for name in cls.__dataclass_fields__})
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64),
                    st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                      max_leaves=12)
message_like = st.fixed_dictionaries(
    {"v": st.one_of(st.just(PROTOCOL_VERSION), values), "t": st.one_of(st.sampled_from(sorted(MESSAGE_TYPES)), values)},
    optional={name: values for name in FIELD_NAMES})
