"""Tensor parallelism on CPU with gloo: one engine over N processes (engine/tp_executor.py).

TP = 2 and 4 against TP = 1 (fp32): logits within 1e-4 and identical greedy output on tiny models with
(heads, KV heads) = (8, 4) and (4, 1) (KV heads replicated when there are fewer than ranks), with chunked
prefill, prefix-cache hits and preemption in the same run; pre-sharded conversions; bad configurations
refused before any process starts; a rank that dies or stops makes the engine fail naming it; a 1P1D cluster
with both nodes at TP = 2 answers the OpenAI client exactly like the offline TP = 1 engine.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from engine_helpers import make_prompts, run_all

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.testing import make_tiny_model, prefill_logits

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Long prompts (chunked over 48-token steps), a shared 64-token prefix (prefix-cache hits once the first is
# done), more work than the 40-block pool holds at once (preemption).
PREFIX = make_prompts([64], seed=7)[0]
PROMPTS = [PREFIX + p for p in make_prompts([5, 70, 33], seed=8)] + make_prompts([120, 9, 57, 90], seed=9)
ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=48, num_gpu_blocks_override=40,
              block_size=8, max_num_seqs=6)


@pytest.fixture(scope="module")
def model_8_4(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tp84")), "llama", num_attention_heads=8,
                           num_key_value_heads=4, hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def model_4_1(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tp41")), "qwen2", num_attention_heads=4,
                           num_key_value_heads=1, hidden_size=64, intermediate_size=128)


def _reference(model: str, make_engine) -> tuple[torch.Tensor, list[list[int]], int]:
    engine = make_engine(model, **ENGINE)
    logits = prefill_logits(engine, PROMPTS[3], list(range(15)))
    outputs = run_all(engine, PROMPTS, GREEDY)
    return logits, outputs, engine.get_stats().num_preemptions


_CACHE: dict[str, tuple] = {}


@pytest.mark.parametrize("tp, model", [
    (2, "model_8_4"), (2, "model_4_1"),
    pytest.param(4, "model_8_4", marks=pytest.mark.slow), pytest.param(4, "model_4_1", marks=pytest.mark.slow)])
def test_tp_equals_tp1(tp, model, request, make_engine):
    path = request.getfixturevalue(model)
    if path not in _CACHE:
        _CACHE[path] = _reference(path, make_engine)
    ref_logits, ref_outputs, ref_preemptions = _CACHE[path]
    engine = make_engine(path, tensor_parallel_size=tp, **ENGINE)
    assert engine.kv_pool.tensor.shape[1] == 2 * tp   # every rank's k and v planes, shared with the workers
    logits = prefill_logits(engine, PROMPTS[3], list(range(15)))
    assert (logits - ref_logits).abs().max().item() < 1e-4
    outputs = run_all(engine, PROMPTS, GREEDY)
    assert outputs == ref_outputs
    stats = engine.get_stats()
    assert stats.prefix_cache_hit_tokens >= 64
    assert stats.num_preemptions > 0 and ref_preemptions > 0


def test_presharded_conversion_is_read_rank_by_rank(model_8_4, tmp_path, make_engine):
    from pdcluster.engine.convert import convert_model
    from pdcluster.engine.llm_engine import LLMEngine

    out = convert_model(model_8_4, str(tmp_path / "tp2"), dtype="float32", tensor_parallel_size=2)
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == [
        "model-rank0-of-2.safetensors", "model-rank1-of-2.safetensors"]
    engine = make_engine(out, tensor_parallel_size=2, **ENGINE)
    if model_8_4 not in _CACHE:
        _CACHE[model_8_4] = _reference(model_8_4, make_engine)
    assert run_all(engine, PROMPTS[:3], GREEDY) == _CACHE[model_8_4][1][:3]
    with pytest.raises(ValueError, match="converted for tensor_parallel_size=2"):
        LLMEngine(EngineArgs(model=out, tensor_parallel_size=1, device="cpu"))


def test_bad_configurations_are_refused_before_any_process_starts(model_8_4, monkeypatch):
    from pdcluster.engine import parallel
    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.llm_engine import LLMEngine

    started = []
    monkeypatch.setattr("pdcluster.engine.llm_engine.TPWorkers", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 8"):
        LLMEngine(EngineArgs(model=model_8_4, tensor_parallel_size=3, device="cpu"))
    config = ModelConfig.from_pretrained(model_8_4)
    with pytest.raises(ValueError, match="needs the hccl collective backend"):   # no torch_npu here
        parallel.backend_for("npu")
    monkeypatch.setattr(parallel, "backend_for", lambda kind: "nccl")
    monkeypatch.setattr(parallel, "visible_devices", lambda kind: 2)
    with pytest.raises(ValueError, match="needs 4 cuda devices, this process sees 2 .see CUDA_VISIBLE_DEVICES"):
        parallel.check_tensor_parallel(config, 4, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="weight_pool: not supported with tensor_parallel_size > 1"):
        LLMEngine(EngineArgs(model=model_8_4, tensor_parallel_size=2, device="cpu", weight_pool="tp-test:64MiB"))
    assert started == []


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_that_dies_or_stops_fails_the_engine_naming_it(how, model_8_4):
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.tp_executor import TPWorkerError

    engine = LLMEngine(EngineArgs(model=model_8_4, tensor_parallel_size=2, collective_timeout=5, **ENGINE))
    try:
        assert run_all(engine, PROMPTS[:1], GREEDY)   # healthy first
        worker = engine.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "kill":   # noticed between steps too
            deadline = time.monotonic() + 10
            while engine.runner.workers.dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(TPWorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
                engine.check_health()
        engine.add_request("after", PROMPTS[1], GREEDY)
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1 .*(exited with code -9|is stopped)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 5 + 10   # within the collective timeout (plus slack), never a hang
        engine.abort_all()
    finally:
        if how == "stop":
            os.kill(worker.pid, signal.SIGCONT)
        engine.shutdown()
    assert not worker.is_alive()


def test_kv_layouts_of_different_tensor_parallel_sizes_match_on_the_model_heads():
    from pdcluster.kv_transfer.errors import LayoutMismatchError
    from pdcluster.kv_transfer.layout import KVLayout

    tp2 = KVLayout.of(torch.zeros(2, 4, 4, 8, 1, 16))   # 2 ranks x (k, v), one KV head each
    tp1 = KVLayout.of(torch.zeros(2, 2, 4, 8, 2, 16))   # the same 2 heads in one rank (regrouped on the way)
    assert tp2.tensor_parallel_size == 2 and tp2.layer_bytes == tp1.layer_bytes
    assert KVLayout.from_dict(tp2.to_dict()) == tp2
    old_peer = {k: v for k, v in tp1.to_dict().items() if k not in ("tensor_parallel_size", "total_kv_heads")}
    assert KVLayout.from_dict(old_peer).tensor_parallel_size == 1
    tp2.check_compatible(tp1)
    with pytest.raises(LayoutMismatchError, match="total_kv_heads: sender 1 vs receiver 2"):   # another model
        tp2.check_compatible(KVLayout.of(torch.zeros(2, 2, 4, 8, 1, 16)))


# ---- a 1P1D cluster with both nodes at TP = 2 -------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_cluster(model_8_4, tmp_path_factory):
    from pdcluster.cli.supervisor import LocalCluster

    c = LocalCluster(model=model_8_4, work_dir=tmp_path_factory.mktemp("tp-cluster"), num_prefill=1, num_decode=1,
                     port=0, cluster="tp", lease_ttl=2,
                     node_config={"kv_cache_memory": "8MiB", "device": "cpu", "dtype": "float32",
                                  "tensor_parallel_size": 2},
                     router_config={"disagg_min_tokens": 0})
    with c:
        yield c


@pytest.mark.cluster
@pytest.mark.slow
async def test_1p1d_at_tp2_answers_like_offline_tp1_and_admits_a_prefill_node_of_another_tp(tp_cluster, model_8_4):
    import psutil
    from cluster_helpers import client, complete, node_metrics, total, wait_until_async

    from pdcluster.engine import LLM

    llm = LLM(model=model_8_4, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    prompts = make_prompts([12, 40, 77], seed=11)
    expected = [llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
                .outputs[0].token_ids for p in prompts]
    tokenizer = llm.get_tokenizer()
    api = client(tp_cluster)
    name = os.path.basename(model_8_4)
    results = [await complete(api, name, p, 16, stream=i % 2 == 0) for i, p in enumerate(prompts)]
    for got, want in zip(results, expected, strict=True):
        assert got.text == tokenizer.decode(want, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert got.usage == 16
    assert total(node_metrics(tp_cluster, "prefill"), "pdcluster_kv_transfers_total{") >= len(prompts)

    # A prefill node of another tensor_parallel_size joins over any KV backend: every channel regroups the heads
    # (gloo on the receiver: tests/test_kv_device_regroup.py).
    other = tp_cluster.start_node("prefill", "prefill-tp1", tensor_parallel_size=1, kv_backend="gloo")
    await wait_until_async(lambda: _registered(tp_cluster, "prefill-tp1"), 120, "the TP 1 prefill node registers")
    assert other.proc.poll() is None
    other.proc.terminate()
    assert other.proc.wait(60) is not None

    # A decode rank that dies takes its node out of the cluster (the router moves streams elsewhere).
    decode = tp_cluster.service("decode-0")
    ranks = [p for p in psutil.Process(decode.proc.pid).children(recursive=True)
             if "multiprocessing" in " ".join(p.cmdline())]
    assert len(ranks) >= 1
    for p in ranks:
        p.kill()
    await wait_until_async(lambda: _gone("decode-0", tp_cluster), 30, "decode-0 leaving etcd")
    assert decode.proc.wait(60) != 0


async def _gone(node_id, cluster) -> bool:
    from cluster_helpers import registered_nodes

    return node_id not in await registered_nodes(cluster)


def test_pdcluster_up_gives_each_node_its_own_devices_when_the_host_has_enough():
    from pdcluster.cli.sizing import node_device_env

    eight = lambda kind: 8  # noqa: E731
    assert node_device_env("npu", 4, 1, 2, eight) == {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    assert node_device_env("cuda", 2, 0, 2, eight) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert node_device_env("cuda", 4, 0, 3, eight) == {}   # 12 needed: the nodes share (and a warning says so)
    assert node_device_env("cpu", 2, 0, 2, eight) == {} and node_device_env(None, 1, 0, 2, eight) == {}


async def _registered(cluster, node_id: str) -> bool:
    from cluster_helpers import registered_nodes

    return node_id in await registered_nodes(cluster)
