"""max_num_batched_tokens="auto": a quarter of the context within [2048, 4096] (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from pdcluster.engine.args import EngineArgs
from pdcluster.engine.scheduler import resolve_batched_tokens


def test_auto_rule():
    assert resolve_batched_tokens(1000, 131072) == 1000
    assert resolve_batched_tokens("auto", 512) == 2048           # at least 2048
    assert resolve_batched_tokens("auto", 12000) == 3000         # a quarter of the context
    assert resolve_batched_tokens("auto", 131072) == 4096        # at most 4096
    assert resolve_batched_tokens("auto", 131072, enable_chunked_prefill=False) == 131072


def test_engine_args_accept_auto_and_numbers_as_text():
    assert EngineArgs(model="/m").max_num_batched_tokens == 2048
    assert EngineArgs(model="/m", max_num_batched_tokens="auto").max_num_batched_tokens == "auto"
    assert EngineArgs(model="/m", max_num_batched_tokens=" AUTO ").max_num_batched_tokens == "auto"
    assert EngineArgs(model="/m", max_num_batched_tokens="4096").max_num_batched_tokens == 4096
    assert EngineArgs(model="/m", max_num_batched_tokens="auto", enable_chunked_prefill=False,
                      max_model_len=100000).max_num_batched_tokens == "auto"
    with pytest.raises(ValueError):
        EngineArgs(model="/m", max_num_batched_tokens="lots")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(model="/m", max_num_batched_tokens=0)


def test_node_config_takes_auto():
    from pdcluster.cli.config import load_config
    from pdcluster.node.config import engine_args_from_config

    cfg = load_config("decode", overrides={"model": "/m"}, env={"PDCLUSTER_MAX_NUM_BATCHED_TOKENS": "auto"})
    assert engine_args_from_config(cfg).max_num_batched_tokens == "auto"
    cfg = load_config("prefill", overrides={"model": "/m"}, env={"PDCLUSTER_MAX_NUM_BATCHED_TOKENS": "3000"})
    assert engine_args_from_config(cfg).max_num_batched_tokens == 3000


def test_engine_resolves_auto(tmp_path, make_engine):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "llama", max_position_embeddings=16384)
    auto = dict(max_num_batched_tokens="auto", block_size=16)   # the cap counts the pool's tokens: 750 x 16 = 12000
    assert make_engine(model, num_gpu_blocks_override=1100, **auto).scheduler.max_num_batched_tokens == 4096
    assert make_engine(model, num_gpu_blocks_override=750, **auto).scheduler.max_num_batched_tokens == 3000   # capped
    assert make_engine(model, max_num_batched_tokens=100).scheduler.max_num_batched_tokens == 100
