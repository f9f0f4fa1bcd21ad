"""Expert parallelism (`enable_expert_parallel`) and expert load, on CPU with gloo / shm collectives.

A tiny Qwen3-MoE (layer 0 dense, layers 1-2 with 8 experts, top-2) at tensor_parallel_size 2 and 4, experts
sliced (TP) or whole per rank (EP): greedy tokens identical to transformers and prefill logits within 1e-4 of
TP = 1, from the Hub layout, the fused transformers-5 layout and a pre-sharded conversion; Mixtral (w1/w3/w2
names) and DeepSeek-V3 (sigmoid routing with its correction bias, shared experts) at EP = 2; each rank reads only
its experts; experts that do not split over the ranks are refused. Expert load: the per-(layer, expert) token
counts the engine reports equal the counts of transformers' own routing of the same tokens, and reach Prometheus
(per-expert totals, imbalance gauges) and `NPUMonitor`.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import hf_greedy, make_prompts, run_all
from moe_helpers import write_fused_experts
from safetensors import safe_open

from pdcluster.control.metrics import new_registry, serve_metrics
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.loader import iter_weights
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.stats import EngineStats
from pdcluster.engine.testing import load_hf_model, make_tiny_model, prefill_logits
from pdcluster.engine.tp_shards import check_divisible, holds, shard_parts
from pdcluster.monitor import KEYS, NPUMonitor, analyze
from pdcluster.node.service import EngineStatsCollector

pytestmark = pytest.mark.timeout(300)

TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS)
PROMPTS = make_prompts([5, 40, 17, 70], seed=11)
# no prefix cache and a pool that never preempts: every token is routed exactly once, as in the reference
ENGINE = dict(dtype="float32", device="cpu", block_size=8, num_gpu_blocks_override=64, max_num_batched_tokens=48,
              enable_prefix_caching=False)
EXPERTS_PREFIX = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("ep_qwen3_moe")), "qwen3_moe", num_hidden_layers=3)


@pytest.fixture(scope="module")
def qwen3_moe_fused(qwen3_moe, tmp_path_factory) -> str:
    return write_fused_experts(qwen3_moe, str(tmp_path_factory.mktemp("ep_fused")))


def _config(path: str, expert_parallel: bool) -> ModelConfig:
    import dataclasses

    config = ModelConfig.from_pretrained(path)
    assert config.moe is not None
    config.moe = dataclasses.replace(config.moe, expert_parallel=expert_parallel)
    return config


def routed_counts(path: str, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """Tokens per (MoE layer, expert) from transformers' router on every token the engine computed: each prompt
    and its generated tokens but the last (sampled, never fed back)."""
    hf = load_hf_model(path)
    top_k, experts = hf.config.num_experts_per_tok, hf.config.num_experts
    totals = torch.zeros(0)
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            per_layer = hf(torch.tensor([prompt + out[:-1]]), output_router_logits=True).router_logits
            counts = torch.stack([torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=experts)
                                  for logits in per_layer])
            totals = counts if not totals.numel() else totals + counts
    return totals.tolist()


_REFERENCE: dict[str, tuple] = {}


def _reference(path: str, make_engine) -> tuple[torch.Tensor, list[list[int]]]:
    """TP = 1 prefill logits and greedy outputs, the outputs checked against transformers once."""
    if path not in _REFERENCE:
        engine = make_engine(path, **ENGINE)
        logits = prefill_logits(engine, PROMPTS[3], list(range(10)))
        outputs = run_all(engine, PROMPTS, GREEDY)
        assert outputs == hf_greedy(path, PROMPTS, TOKENS)
        _REFERENCE[path] = logits, outputs
    return _REFERENCE[path]


@pytest.mark.parametrize("tp, expert_parallel, layout", [
    (2, True, "hub"), (2, False, "hub"), (2, True, "fused"), (2, False, "fused"),
    pytest.param(4, True, "hub", marks=pytest.mark.slow), pytest.param(4, False, "hub", marks=pytest.mark.slow)])
def test_tensor_and_expert_parallel_equal_tp1_and_transformers(tp, expert_parallel, layout, qwen3_moe,
                                                              qwen3_moe_fused, make_engine):
    ref_logits, ref_outputs = _reference(qwen3_moe, make_engine)
    path = qwen3_moe if layout == "hub" else qwen3_moe_fused
    engine = make_engine(path, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, **ENGINE)
    assert engine.model_config.moe is not None and engine.model_config.moe.expert_parallel == expert_parallel
    moe = engine.runner.model.model.layers[1].mlp   # rank 0's layer
    assert moe.num_local_experts == (8 // tp if expert_parallel else 8)
    assert moe.local_intermediate == (48 if expert_parallel else 48 // tp)
    logits = prefill_logits(engine, PROMPTS[3], list(range(10)))
    assert (logits - ref_logits).abs().max().item() < 1e-4
    before = engine.get_stats().expert_tokens   # prefill_logits routed PROMPTS[3] once
    outputs = run_all(engine, PROMPTS, GREEDY)
    assert outputs == ref_outputs
    stats = engine.get_stats()
    assert stats.expert_layers == (1, 2)
    counted = [[a - b for a, b in zip(row, old, strict=True)] for row, old in zip(stats.expert_tokens, before,
                                                                                   strict=True)]
    assert counted == routed_counts(qwen3_moe, PROMPTS, outputs)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])   # w1/w3/w2 names; shared experts, correction bias
def test_other_moe_architectures_at_expert_parallel_2_equal_transformers(arch, tmp_path, make_engine):
    path = make_tiny_model(str(tmp_path / arch), arch)
    engine = make_engine(path, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    assert run_all(engine, PROMPTS, GREEDY) == hf_greedy(path, PROMPTS, TOKENS)


def test_each_rank_reads_only_its_experts(qwen3_moe, qwen3_moe_fused):
    with safe_open(os.path.join(qwen3_moe, "model.safetensors"), "pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    for rank in range(2):
        tp = TPGroup(rank=rank, size=2)
        ep = dict(iter_weights(qwen3_moe, _config(qwen3_moe, True), tp))
        mine = {int(n.split(".")[5]) for n in ep if n.startswith(EXPERTS_PREFIX)}
        assert mine == set(range(4 * rank, 4 * rank + 4))   # the other rank's experts are not read at all
        assert torch.equal(ep[f"{EXPERTS_PREFIX}.{4 * rank}.down_proj.weight"],
                           full[f"{EXPERTS_PREFIX}.{4 * rank}.down_proj.weight"])   # whole experts
        assert torch.equal(ep["model.layers.1.mlp.gate.weight"], full["model.layers.1.mlp.gate.weight"])
        sliced = dict(iter_weights(qwen3_moe, _config(qwen3_moe, False), tp))
        assert {int(n.split(".")[5]) for n in sliced if n.startswith(EXPERTS_PREFIX)} == set(range(8))
        assert torch.equal(sliced[f"{EXPERTS_PREFIX}.3.gate_proj.weight"],
                           full[f"{EXPERTS_PREFIX}.3.gate_proj.weight"][24 * rank:24 * (rank + 1)])
        assert torch.equal(sliced[f"{EXPERTS_PREFIX}.3.down_proj.weight"],
                           full[f"{EXPERTS_PREFIX}.3.down_proj.weight"][:, 24 * rank:24 * (rank + 1)])
        # the fused layout: whole experts cut along the expert dim, or each expert's gate and up rows sliced
        gate_up = torch.stack([torch.cat((full[f"{EXPERTS_PREFIX}.{e}.gate_proj.weight"],
                                          full[f"{EXPERTS_PREFIX}.{e}.up_proj.weight"])) for e in range(8)])
        fused_ep = dict(iter_weights(qwen3_moe_fused, _config(qwen3_moe, True), tp))
        assert torch.equal(fused_ep[f"{EXPERTS_PREFIX}.gate_up_proj"], gate_up[4 * rank:4 * rank + 4])
        fused_tp = dict(iter_weights(qwen3_moe_fused, _config(qwen3_moe, False), tp))
        rows = list(range(24 * rank, 24 * rank + 24)) + list(range(48 + 24 * rank, 48 + 24 * rank + 24))
        assert torch.equal(fused_tp[f"{EXPERTS_PREFIX}.gate_up_proj"], gate_up[:, rows])


def test_expert_names_of_every_layout_shard_by_mode(qwen3_moe):
    ep, tp = _config(qwen3_moe, True), _config(qwen3_moe, False)
    mixtral = "model.layers.1.block_sparse_moe.experts.6."
    assert shard_parts(mixtral + "w1.weight", (48, 64), tp, 1, 2) == [(0, 24, 24)]
    assert shard_parts(mixtral + "w3.weight", (48, 64), tp, 1, 2) == [(0, 24, 24)]
    assert shard_parts(mixtral + "w2.weight", (64, 48), tp, 1, 2) == [(1, 24, 24)]
    assert holds(mixtral + "w2.weight", ep, 1, 2) and not holds(mixtral + "w2.weight", ep, 0, 2)
    assert shard_parts(mixtral + "w2.weight", (64, 48), ep, 1, 2) is None   # a whole expert
    assert shard_parts(EXPERTS_PREFIX + ".down_proj", (8, 64, 48), tp, 1, 4) == [(2, 12, 12)]
    assert shard_parts(EXPERTS_PREFIX + ".down_proj", (8, 64, 48), ep, 1, 4) == [(0, 2, 2)]
    for replicated in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert shard_parts(replicated, (8, 64), ep, 1, 2) is None and holds(replicated, ep, 1, 2)
    assert shard_parts("model.layers.1.mlp.shared_experts.gate_proj.weight", (32, 64), ep, 1, 2) == [(0, 16, 16)]


def test_experts_that_do_not_split_are_refused(tmp_path, make_engine):
    path = make_tiny_model(str(tmp_path / "six"), "qwen3_moe", num_experts=6, moe_intermediate_size=50)
    with pytest.raises(ValueError, match="expert_parallel: tensor_parallel_size 4 does not divide num_experts 6"):
        make_engine(path, tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(ValueError, match="moe_intermediate_size 50"):
        check_divisible(_config(path, False), 4)
    check_divisible(_config(path, True), 2)   # whole experts: the intermediate size need not split


def test_presharded_expert_parallel_conversion(qwen3_moe, tmp_path, make_engine):
    from pdcluster.engine.convert import convert_model

    ref_logits, ref_outputs = _reference(qwen3_moe, make_engine)
    out = convert_model(qwen3_moe, str(tmp_path / "ep2"), dtype="float32", tensor_parallel_size=2,
                        expert_parallel=True)
    for rank in range(2):
        with safe_open(os.path.join(out, f"model-rank{rank}-of-2.safetensors"), "pt") as f:
            experts = {int(n.split(".")[5]) for n in f.keys() if n.startswith(EXPERTS_PREFIX)}
        assert experts == set(range(4 * rank, 4 * rank + 4))
    engine = make_engine(out, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    assert (prefill_logits(engine, PROMPTS[3], list(range(10))) - ref_logits).abs().max().item() < 1e-4
    assert run_all(engine, PROMPTS, GREEDY) == ref_outputs
    with pytest.raises(ValueError, match="converted with expert parallelism"):   # an engine without EP
        next(iter_weights(out, _config(qwen3_moe, False), TPGroup(rank=0, size=2)))


# ---------------------------------------------------------------------------------------------- exported load

LOAD = EngineStats(num_total_blocks=10, max_num_seqs=4, expert_layers=(1, 3),
                   expert_tokens=((10, 10, 10, 10), (36, 2, 1, 1)))


def test_expert_load_reaches_prometheus_and_the_monitor():
    assert LOAD.expert_totals == (46, 12, 11, 11)
    assert LOAD.expert_imbalance == (36 * 4 / 40, 3)   # layer 3: the busiest expert at 3.6x the mean
    registry = new_registry()
    registry.register(EngineStatsCollector(lambda: LOAD))
    server = serve_metrics(registry, 0, host="127.0.0.1")
    try:
        u = NPUMonitor(f"127.0.0.1:{server.port}").get_utilization()
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
    finally:
        server.close()
    assert set(u) == set(KEYS)
    assert u["expert_tokens"] == [46, 12, 11, 11]
    assert u["expert_imbalance"] == pytest.approx(3.6) and u["expert_imbalance_layer"] == 3
    expert_series = [line for line in text.splitlines() if line.startswith("pdcluster_node_expert_")]
    assert len(expert_series) == 4 + 2   # one series per expert, not per (layer, expert), and two gauges
    report = analyze([u, dict(u, timestamp=u["timestamp"] + 1)])
    assert "expert_imbalance" in report.causes and "layer 3" in " ".join(report.details)


def test_dense_models_export_no_expert_series(tmp_path, make_engine):
    engine = make_engine(make_tiny_model(str(tmp_path / "dense"), "llama"), **ENGINE)
    run_all(engine, PROMPTS[:1], GREEDY)
    stats = engine.get_stats()
    assert stats.expert_tokens == () and stats.expert_imbalance is None
    figures = NPUMonitor(engine).get_utilization()
    assert figures["expert_tokens"] is None and figures["expert_imbalance"] is None


def test_monitor_of_an_in_process_engine_sees_expert_load(qwen3_moe, make_engine):
    engine = make_engine(qwen3_moe, **ENGINE)
    outputs = run_all(engine, PROMPTS, GREEDY)
    want = routed_counts(qwen3_moe, PROMPTS, outputs)
    figures = NPUMonitor(engine).get_utilization()
    assert figures["expert_tokens"] == [sum(column) for column in zip(*want, strict=True)]
    worst = max((max(row) * len(row) / sum(row), layer) for layer, row in zip((1, 2), want, strict=True))
    assert (figures["expert_imbalance"], figures["expert_imbalance_layer"]) == pytest.approx(worst)
