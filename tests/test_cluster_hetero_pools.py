"""P/D between nodes whose KV pools are cut differently (issue #34 item 3): a prefill node sliced per rank over more
ranks than its decode node (TP 2 sliced -> TP 1: both prefill ranks write the decode node's one pool, one reservation
with two writers), a prefill node of one pool feeding a decode node sliced per rank (TP 1 -> TP 2 sliced: the
prefill node's one-rank RankedSender writes each decode slice its heads), and a model with fewer KV heads than the
prefill node's slices (2 heads, TP 4 sliced -> TP 2 sliced: prefill ranks 1 and 3 hold copies that ranks 0 and 2
send). Registration accepts them; greedy output is the offline TP 1 engine's, every prompt's KV comes from the
prefill node, no transfer fails, nothing stays reserved.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytestmark = pytest.mark.timeout(600)


def _serve_across(tmp_path, prefill: dict, decode: dict, name: str, kv_heads: int = 4,
                  lengths: tuple[int, ...] = (12, 40, 77)) -> None:
    """A cluster of one prefill node (`prefill` knobs) and one decode node (`decode`) of a model of `kv_heads` KV heads
    answers prompts of `lengths` like the offline TP 1 engine, every prompt prefilled remotely
    (rank_kv_helpers.serve_every_prompt_remotely)."""
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

    model = make_tiny_model(str(tmp_path / "tiny-gqa"), "llama", num_attention_heads=8, num_key_value_heads=kv_heads,
                            hidden_size=64, intermediate_size=128)
    prompts = make_prompts(list(lengths), seed=11)
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


@pytest.mark.cluster
@pytest.mark.slow
def test_a_tp4_prefill_node_sliced_per_rank_feeds_a_tp2_decode_node_sliced_of_a_two_kv_head_model(tmp_path):
    """Each prefill slice holds a copy of one of the 2 heads: decode slice r takes its head from the first prefill
    slice holding it (ranks 0 and 2), the prefill node counting the bytes that crossed, as the decode node does."""
    _serve_across(tmp_path, {"tensor_parallel_size": 4, "kv_pool_per_rank": True},
                  {"tensor_parallel_size": 2, "kv_pool_per_rank": True}, "copies", kv_heads=2, lengths=(12, 40))
