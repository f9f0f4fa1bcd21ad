"""Multi-LoRA through a 1P1D cluster (real etcd, router, node processes, the official openai client): requests name
adapters by `model`, mixed with base-model requests; every prompt is prefilled on the prefill node under the
request's adapter (Prefill carries it) and the answers equal the offline engine's with that adapter (itself exact
against PEFT's merged model: tests/test_lora.py). /v1/models lists the adapters with their parent; an adapter
loaded and unloaded at run time through the router's endpoints, while other requests keep flowing, serves in
between and is gone after; a prefill node whose adapter of the same name has other weights refuses the prefill and
the decode node computes it (same answer)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from cluster_helpers import client, node_metrics, total, wait_idle
from lora_helpers import ALL_TARGETS, make_adapter

from pdcluster.cli.admin import set_state
from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

MODEL_NAME = "tiny-llama"
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(20 + 9 * i)] for i in range(3)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(str(root / MODEL_NAME), "llama")
    adapters = {"a": make_adapter(model, str(root / "a"), 8, 16, ALL_TARGETS, seed=1),
                "b": make_adapter(model, str(root / "b"), 4, 8, ["q_proj", "v_proj"], seed=2),
                "c": make_adapter(model, str(root / "c"), 2, 4, ["o_proj", "down_proj"], seed=3, rslora=True)}
    c = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=1, port=0,
                     cluster="lora", lease_ttl=2, threads_per_node=1,
                     node_config={"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 128,
                                  "enable_lora": True, "max_loras": 2, "max_cpu_loras": 3,
                                  "lora_modules": [f"a={adapters['a']}", f"b={adapters['b']}"]},
                     router_config={"disagg_min_tokens": 0})
    with c:
        wait_listed(c, {"a", "b"})   # the nodes' first Load reports name the adapters they hold
        wait_prefilled_remotely(c, ["a", "b"])   # ... the prefill node's too (the decode node's alone list them)
        yield c, model, adapters


def wait_listed(cluster: LocalCluster, names: set[str], timeout: float = 20.0) -> None:
    import json
    import time
    import urllib.request

    end = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(cluster.url + "/v1/models", timeout=5) as r:
            listed = {m["id"] for m in json.loads(r.read())["data"]}
        if names <= listed:
            return
        assert time.monotonic() < end, f"the router lists {sorted(listed)}, not {sorted(names)}"
        time.sleep(0.1)


def wait_prefilled_remotely(cluster: LocalCluster, names: list[str], timeout: float = 20.0) -> None:
    """Until a request for each adapter is prefilled on the prefill node: the router sends an adapter's prefills
    only to prefill nodes whose Load reports name it, and the prefill node's first report may come after the
    decode node's."""
    import json
    import time
    import urllib.request

    end = time.monotonic() + timeout
    for name in names:
        while True:
            before = total(node_metrics(cluster, "decode"), 'pdcluster_node_prefills_total{path="remote"}')
            body = json.dumps({"model": name, "prompt": PROMPTS[0], "max_tokens": 1}).encode()
            request = urllib.request.Request(cluster.url + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                assert r.status == 200
            if total(node_metrics(cluster, "decode"), 'pdcluster_node_prefills_total{path="remote"}') > before:
                break
            assert time.monotonic() < end, f"requests for adapter {name} are not prefilled on the prefill node"
            time.sleep(0.2)
    wait_idle(cluster)


@pytest.fixture(scope="module")
def reference(setup):
    """The offline engine's greedy text for (adapter or None, prompt index)."""
    from transformers import AutoTokenizer

    from pdcluster.engine import LLM, LoRARequest, SamplingParams

    _, model, adapters = setup
    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=256, enable_lora=True, max_loras=3)
    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for i, name in enumerate([None, *adapters], start=0):
        lora = LoRARequest(name, i, adapters[name]) if name else None
        for j, o in enumerate(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                           lora_request=lora)):
            out[name, j] = tok.decode(o.outputs[0].token_ids, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)
    return out


async def ask(api, model: str, j: int) -> str:
    r = await api.completions.create(model=model, prompt=PROMPTS[j], max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


async def test_adapters_and_base_model_mixed_through_p_d(setup, reference):
    cluster, _, _ = setup
    assert reference["a", 0] != reference[None, 0] and reference["b", 0] != reference[None, 0]   # they matter
    api = client(cluster)
    listed = {m.id: m for m in (await api.models.list()).data}
    assert {"a", "b"} <= set(listed) and listed["a"].parent == MODEL_NAME and listed[MODEL_NAME].parent is None
    remote = total(node_metrics(cluster, "decode"), 'pdcluster_node_prefills_total{path="remote"}')
    jobs = [(model, j) for model in (MODEL_NAME, "a", "b") for j in range(len(PROMPTS))]
    answers = await asyncio.gather(*(ask(api, model, j) for model, j in jobs))
    for (model, j), text in zip(jobs, answers, strict=True):
        assert text == reference[None if model == MODEL_NAME else model, j], (model, j)
    decode = node_metrics(cluster, "decode")
    assert total(decode, 'pdcluster_node_prefills_total{path="remote"}') - remote == len(jobs)
    assert total(decode, "pdcluster_node_remote_prefill_failures_total{") == 0
    wait_idle(cluster)


async def traffic(api, reference, stop: asyncio.Event, served: list[int]) -> None:
    """Base-model and adapter-a requests back to back until `stop`, each answer checked."""
    i = 0
    while not stop.is_set():
        model, j = (MODEL_NAME, "a")[i % 2], i % len(PROMPTS)
        assert await ask(api, model, j) == reference[None if model == MODEL_NAME else model, j]
        served[0] += 1
        i += 1


async def test_an_adapter_loaded_and_unloaded_at_run_time(setup, reference):
    cluster, _, adapters = setup
    api = client(cluster)
    stop, served = asyncio.Event(), [0]
    background = asyncio.create_task(traffic(api, reference, stop, served))
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        with pytest.raises(Exception, match="does not exist"):
            await ask(api, "c", 0)
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
        assert r.status_code == 200 and "added successfully" in r.text, r.text
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
        assert again.status_code == 400 and again.json()["error"]["message"].endswith("already been loaded.")
        bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/no/such/adapter"})
        assert bad.status_code == 400 and "could not be loaded" in bad.json()["error"]["message"]
        assert "c" in {m.id for m in (await api.models.list()).data}
        assert [await ask(api, "c", j) for j in range(len(PROMPTS))] == [reference["c", j] for j in range(3)]
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200 and "removed successfully" in r.text, r.text
        # the nodes' next Load reports drop it from the router's view
        for _ in range(50):
            if "c" not in {m.id for m in (await api.models.list()).data}:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("c still listed after unloading")
        with pytest.raises(Exception, match="does not exist"):
            await ask(api, "c", 0)
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert gone.status_code == 404
    stop.set()
    await asyncio.wait_for(background, 60)   # re-raises a wrong answer or a failed request
    assert served[0] >= 4
    wait_idle(cluster)


async def test_a_prefill_node_with_another_adapter_of_that_name_refuses(setup, reference):
    cluster, _, adapters = setup
    impostor = cluster.start_node("prefill", "prefill-1", lora_modules=[f"a={adapters['b']}"])   # "a", b's weights
    try:
        await set_state([cluster.etcd], "lora", "prefill-0", "cordoned")
        for _ in range(300):   # the router sees prefill-1 (holding "a") and prefill-0 cordoned
            health = cluster.health() or {}
            if health.get("prefill_nodes") == ["prefill-1"]:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"prefill-1 did not take over: {cluster.health()}")
        await asyncio.sleep(1.0)   # its first Load reports (the adapters it holds)
        before = total(node_metrics(cluster, "decode"), "pdcluster_node_remote_prefill_failures_total{")
        api = client(cluster)
        assert [await ask(api, "a", j) for j in range(len(PROMPTS))] == [reference["a", j] for j in range(3)]
        after = total(node_metrics(cluster, "decode"), "pdcluster_node_remote_prefill_failures_total{")
        assert after - before == len(PROMPTS)   # every prefill refused there, computed on the decode node
        assert "differs" in impostor.log_tail(200)
    finally:
        await set_state([cluster.etcd], "lora", "prefill-0", "active")
        impostor.proc.terminate()
        impostor.proc.wait(30)
    wait_idle(cluster)
