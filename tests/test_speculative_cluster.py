"""Speculative decoding across the P/D cluster, real processes: decode nodes draft with a draft model whose KV
they rebuild for prompts a prefill node computed; outputs equal the offline engine without speculation; a
decode node SIGKILLed mid-stream loses nothing (the node the streams move to rebuilds the draft state); a
prefill node whose speculative_config differs from its decode nodes' is refused at registration. With an
EAGLE-3 head the prefill node ships the prompt's features with its KV."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys

import pytest
from cluster_helpers import (
    bounded,
    client,
    complete,
    node_metrics,
    registered_nodes,
    router_metrics,
    total,
    wait_idle,
    wait_until_async,
)

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.sampling_params import SamplingParams

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL_NAME = "spec-llama"
# big enough that 8 streams of 64 tokens are still running when a node is killed (one thread per node)
MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=400, max_position_embeddings=2048)
STREAMS = 8
TOKENS = 64


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    out = []
    for i in range(STREAMS):
        motif = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(5 + i)]
        out.append(motif * (3 + i % 3) + [rng.randrange(3, MODEL["vocab_size"]) for _ in range(20)])
    return out


def offline_texts(model: str, tokens: int) -> list[str]:
    """The offline engine's greedy texts for `prompts()`, without speculation."""
    from pdcluster.engine import LLM

    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=512)
    want = [list(o.outputs[0].token_ids) for o in
            llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))]
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) for ids in want]
    llm.shutdown()
    return texts


def node_config(spec: dict) -> dict:
    return {"kv_cache_memory": "48MiB", "max_num_seqs": 16, "device": "cpu", "dtype": "float32",
            "speculative_config": spec}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("spec") / MODEL_NAME), "llama", **MODEL)


@pytest.mark.timeout(420)
async def test_1p2d_drafts_on_decode_nodes_survives_a_kill_and_refuses_a_mismatched_prefill_node(model, tmp_path):
    texts = offline_texts(model, TOKENS)
    with LocalCluster(model=model, work_dir=tmp_path, num_prefill=1, num_decode=2, port=0, cluster="spec",
                      lease_ttl=2, threads_per_node=1,
                      node_config=node_config({"method": "draft_model", "model": model, "num_speculative_tokens": 3}),
                      router_config={"disagg_min_tokens": 0, "routing_policy": "round_robin"}) as cluster:
        cluster.wait_ready(1, 2, timeout=180, serving=True)
        api = client(cluster)

        # Every prompt prefilled remotely, drafts on the decode nodes, the offline engine's tokens.
        results = await bounded([complete(api, MODEL_NAME, p, TOKENS, stream=i % 2 == 0)
                                 for i, p in enumerate(prompts())], 180)
        assert [r.text for r in results] == texts
        assert all(r.usage == TOKENS for r in results)
        decode = node_metrics(cluster, "decode")
        assert total(decode, 'pdcluster_node_prefills_total{path="remote"}') == STREAMS
        drafted = total(decode, "pdcluster_node_spec_decode_draft_tokens_total{")
        accepted = total(decode, "pdcluster_node_spec_decode_accepted_tokens_total{")
        assert accepted > 0.8 * drafted > 0, (accepted, drafted)   # the draft is the target: nearly all pass
        wait_idle(cluster)
        status = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pdcluster"), "status", "--json",
                                 "--etcd", cluster.etcd, "--cluster", "spec"], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "PDCLUSTER_CLUSTER_SECRET": cluster.cluster_secret})
        assert status.returncode == 0, status.stderr
        rows = {n["node_id"]: n for n in json.loads(status.stdout)["nodes"]}
        for node in ("decode-0", "decode-1"):
            assert rows[node]["spec_method"] == "draft_model" and rows[node]["spec_acceptance_rate"] > 0.8
            assert 1.0 < rows[node]["spec_mean_accepted_length"] <= 4.0

        # A decode node SIGKILLed mid-stream: the streams move and finish token-identical.
        before = router_metrics(cluster).get("pdcluster_router_migrations_total", 0.0)
        progress = [0] * STREAMS
        tasks = [asyncio.create_task(complete(api, MODEL_NAME, p, TOKENS, progress=progress, slot=i))
                 for i, p in enumerate(prompts())]
        await wait_until_async(lambda: min(progress) >= 3, 120, "streams did not get under way", interval=0.02)
        nodes = {s.node_id: s for s in cluster.services if s.kind == "decode"}
        running = {n: scrape_metrics(s.metrics_url)["pdcluster_node_running_requests"] for n, s in nodes.items()}
        victim = nodes[max(running, key=running.get)]
        victim.proc.kill()
        victim.proc.wait(10)
        cluster.services.remove(victim)
        cluster.sweep_dead_pools()
        moved_results = await bounded(tasks, 240)
        assert [r.text for r in moved_results] == texts
        assert [r.tokens for r in moved_results] == [r.tokens for r in results]
        assert router_metrics(cluster)["pdcluster_router_migrations_total"] - before >= 1
        survivor = next(n for n in nodes if n != victim.node_id)
        assert scrape_metrics(nodes[survivor].metrics_url)[
            'pdcluster_node_spec_decode_accepted_tokens_total{method="draft_model"}'] > 0

        # A prefill node with another speculative_config may not join; one with none may.
        other = {"method": "ngram", "num_speculative_tokens": 2}
        bad = cluster.start_node("prefill", "prefill-ngram", speculative_config=json.dumps(other))
        assert bad.proc.wait(120) == 2
        assert "speculative_config" in bad.log_path.read_text() and "refusing to register" in \
            bad.log_path.read_text()
        assert "prefill-ngram" not in await registered_nodes(cluster)
        cluster.services.remove(bad)
        plain = cluster.start_node("prefill", "prefill-plain", speculative_config="")
        cluster.wait_ready(2, 1, timeout=120)
        assert "prefill-plain" in await registered_nodes(cluster)
        assert plain.proc.poll() is None
        wait_idle(cluster)


@pytest.mark.timeout(300)
async def test_1p1d_eagle3_head_gets_the_prompt_features_from_the_prefill_node(model, tmp_path):
    from pdcluster.engine.testing import make_eagle_head

    head = make_eagle_head(str(tmp_path / "eagle3"), model, "eagle3", draft_vocab_size=256)
    texts = offline_texts(model, 24)
    with LocalCluster(model=model, work_dir=tmp_path, num_prefill=1, num_decode=1, port=0, cluster="eagle",
                      lease_ttl=2, threads_per_node=1,
                      node_config=node_config({"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                                "draft_policy": "fixed"}),
                      router_config={"disagg_min_tokens": 0, "routing_policy": "round_robin"}) as cluster:
        cluster.wait_ready(1, 1, timeout=180, serving=True)
        api = client(cluster)
        results = await bounded([complete(api, MODEL_NAME, p, 24, stream=i % 2 == 0)
                                 for i, p in enumerate(prompts())], 180)
        assert [r.text for r in results] == texts
        decode = node_metrics(cluster, "decode")
        assert total(decode, 'pdcluster_node_prefills_total{path="remote"}') == STREAMS
        assert total(decode, 'pdcluster_node_spec_decode_draft_tokens_total{method="eagle3"}') > 0
        log = next(s for s in cluster.services if s.kind == "decode").log_path.read_text()
        shipped = [int(n) for n in re.findall(r"via \w+, (\d+) feature bytes", log)]
        # every prompt's features (3 x hidden float32 per position) went with its KV
        assert sorted(shipped) == sorted(len(p) * 3 * MODEL["hidden_size"] * 4 for p in prompts()), shipped
        wait_idle(cluster)
