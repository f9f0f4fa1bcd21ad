"""P/D between nodes whose KV pools are cut differently (issue #34 item 3): a prefill node sliced per rank over more
ranks than its decode node (TP 2 sliced -> TP 1: both prefill ranks write the decode node's one pool, one reservation
with two writers), and a prefill node of one pool feeding a decode node sliced per rank (TP 1 -> TP 2 sliced: the
prefill node's one-rank RankedSender writes each decode slice its heads). Registration accepts both; greedy output is
the offline TP 1 engine's, every prompt's KV comes from the prefill node, no transfer fails, nothing stays reserved.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

pytestmark = pytest.mark.timeout(600)


def _serve_across(tmp_path, prefill: dict, decode: dict, name: str) -> None:
    """A cluster of one prefill node (`prefill` knobs) and one decode node (`decode`) of a 4-KV-head model answers
    like the offline TP 1 engine, every prompt prefilled remotely (rank_kv_helpers.serve_every_prompt_remotely)."""
    from cluster_helpers import total
    from engine_helpers import make_prompts
    from rank_kv_helpers import serve_every_prompt_remotely
    from transformers import AutoTokenizer

    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.control.etcd_client import close_quietly, connect
    from pdcluster.control.queries import list_nodes
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine import LLM
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny-gqa"), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    prompts = make_prompts([12, 40, 77], seed=11)
    n = 10
    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    want = [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) for ids in want]
    node = {"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu", "dtype": "float32"}
    (tmp_path / "cluster").mkdir()
    with LocalCluster(model=model, work_dir=tmp_path / "cluster", num_prefill=0, num_decode=0, port=0,
                      cluster=f"{name}-{uuid.uuid4().hex[:6]}", lease_ttl=2, threads_per_node=1,
                      node_config=node, router_config={"disagg_min_tokens": 0}) as cluster:
        cluster.start_node("prefill", "prefill-0", **prefill)
        cluster.start_node("decode", "decode-0", **decode)
        cluster.wait_ready(1, 1, timeout=300, serving=True)

        async def slices() -> dict[str, int]:
            etcd = await connect([cluster.etcd])
            try:
                return {n.role: n.capacity.kv_rank_slices for n in await list_nodes(etcd, cluster.cluster)
                        if n.role != "router"}
            finally:
                await close_quietly(etcd)

        def sliced(knobs: dict) -> int:
            tp = knobs.get("tensor_parallel_size", 1)
            return tp if tp > 1 and knobs.get("kv_pool_per_rank") else 0

        assert asyncio.run(slices()) == {"prefill": sliced(prefill), "decode": sliced(decode)}
        after = serve_every_prompt_remotely(cluster, prompts, n, texts)
        assert total(after, 'pdcluster_node_prefills_total{path="local"}') == 0


@pytest.mark.cluster
@pytest.mark.slow
def test_a_tp2_prefill_node_sliced_per_rank_feeds_a_tp1_decode_node(tmp_path):
    _serve_across(tmp_path, {"tensor_parallel_size": 2, "kv_pool_per_rank": True}, {"tensor_parallel_size": 1},
                  "sliced-to-whole")


@pytest.mark.cluster
@pytest.mark.slow
def test_a_tp1_prefill_node_feeds_a_tp2_decode_node_sliced_per_rank(tmp_path):
    _serve_across(tmp_path, {"tensor_parallel_size": 1}, {"tensor_parallel_size": 2, "kv_pool_per_rank": True},
                  "whole-to-sliced")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("mine, peer_slices, peer_tp, kv_heads", [
    (2, 2, 2, 8), (2, 0, 2, 8), (2, 0, 1, 8), (2, 4, 4, 8), (0, 2, 2, 8), (2, 4, 4, 2), (0, 4, 4, 2), (2, 0, 1, 1)])
def test_registration_pairs_pools_sliced_any_way_where_the_heads_regroup(role, device, mine, peer_slices, peer_tp,
                                                                         kv_heads):
    """Pools sliced alike pair rank to rank; sliced otherwise or not at all, they pair where the channels regroup the
    heads (CPU pools) and no slice holds a copy of a head (a model with fewer KV heads than a side's slices); the
    refusal names both pools and why."""
    from types import SimpleNamespace

    from pdcluster.control.records import Capacity, NodeInfo
    from pdcluster.node.service import NodeService

    other = "decode" if role == "prefill" else "prefill"
    peer = NodeInfo(node_id=f"{other}-0", role=other, model="m", kv_backends=["tcp"],
                    capacity=Capacity(tensor_parallel_size=peer_tp, kv_rank_slices=peer_slices))
    node = SimpleNamespace(role=role, config=SimpleNamespace(tensor_parallel_size=max(mine, 1), kv_backend="auto"),
                           engine=SimpleNamespace(device=torch.device(device), rank_sliced_pool=bool(mine),
                                                  model_config=SimpleNamespace(num_kv_heads=kv_heads, kv_latent_dim=0)),
                           speculative=lambda: "", served_model_name=lambda: "m",
                           view=SimpleNamespace(nodes_by_role=lambda r: [peer]))
    for name in ("_slicing_refusal", "_regroup_refusal", "kv_rank_slices"):
        setattr(node, name, getattr(NodeService, name).__get__(node))
    why = NodeService._peer_mismatch(node)

    def pool(slices: int, tp: int) -> str:
        return f"sliced per rank over {slices} ranks" if slices else f"one pool (tensor_parallel_size {tp})"

    pools = (f"this node's KV is {pool(mine, max(mine, 1))}, {other} node {other}-0's is {pool(peer_slices, peer_tp)} "
             "for model 'm'")
    if mine == peer_slices:
        assert why == ""
    elif kv_heads < max(mine, peer_slices):
        most = "this node's" if mine > peer_slices else f"the {other} node's"
        assert why == (f"{pools}: the model has {kv_heads} KV heads, fewer than {most} {max(mine, peer_slices)} rank "
                       "slices (each would hold a copy of one): between pools sliced over different numbers of ranks "
                       "that is not built; refusing to register")
    elif device == "cuda":   # a device pool's channels do not regroup heads (yet)
        assert why.startswith(pools) and "only between CPU pools (this one is on cuda: not run on a device yet)" in why
    else:
        assert why == ""
