"""Multi-LoRA serving in the engine (engine/lora/): PEFT adapters of different ranks, targets and scalings and
the base model in one batch, greedy token-exact against transformers with PEFT's merge_and_unload() model (fp32);
prefix-cache blocks never shared across adapters; device slots refilled from the host cache or the disk when
more adapters are in flight than slots; tensor parallelism; adapters we cannot serve refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_helpers import make_prompts
from lora_helpers import ALL_TARGETS, make_adapter, merged_greedy

from pdcluster import LLM, LoRARequest, SamplingParams
from pdcluster.engine.lora.layers import LoRALayer, LoRAStep
from pdcluster.engine.testing import make_tiny_model

pytest.importorskip("peft")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = make_prompts([21, 5, 40], seed=3)
ENGINE = dict(dtype="float32", device="cpu", num_gpu_blocks_override=96, block_size=8, enable_lora=True)
# (name, r, alpha, targets, rsLoRA): every target, attention only, MLP + o_proj with rsLoRA scaling
ADAPTERS = [("all8", 8, 16, ALL_TARGETS, False), ("qv4", 4, 32, ["q_proj", "v_proj"], False),
            ("mlp2", 2, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"], True)]


def _adapters(base: str, root) -> dict[str, str]:
    return {name: make_adapter(base, str(root / name), r, alpha, targets, seed=i + 1, rslora=rs)
            for i, (name, r, alpha, targets, rs) in enumerate(ADAPTERS)}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lora_setup(request, tmp_path_factory):
    """A tiny base model (Llama GQA; Qwen2 with QKV bias and tied embeddings), three adapters, and the reference
    greedy output of each prompt under each adapter and the base model."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = make_tiny_model(str(root / "base"), request.param)
    paths = _adapters(base, root)
    refs = {name: merged_greedy(base, path, PROMPTS, MAX_TOKENS) for name, path in [*paths.items(), (None, None)]}
    return base, paths, refs


def _requests(paths: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(paths.items(), start=1)}


def test_mixed_batch_matches_merged_peft(lora_setup):
    base, paths, refs = lora_setup
    loras = _requests(paths)
    # every prompt under every adapter and the base model, interleaved, in one generate call
    items = [(name, i) for i in range(len(PROMPTS)) for name in [*loras, None]]
    with LLM(base, max_loras=3, max_lora_rank=8, **ENGINE) as llm:
        outs = llm.generate([PROMPTS[i] for _, i in items], GREEDY,
                            lora_request=[loras[n] if n else None for n, _ in items])
        assert llm.engine.runner.lora.num_slot_loads == 3
    for (name, i), out in zip(items, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (name, i)
    # the adapters do change the output
    for name in loras:
        assert refs[name] != refs[None], name


def test_same_prompt_under_two_adapters_shares_no_blocks(lora_setup, make_engine):
    base, paths, refs = lora_setup
    loras = _requests(paths)
    engine = make_engine(base, max_loras=2, max_lora_rank=8, **ENGINE)
    prompt = PROMPTS[2]   # 40 tokens: 5 full blocks

    def run(lora):
        before = engine.get_stats().prefix_cache_hit_tokens
        engine.add_request(f"r{engine.num_steps}-{lora and lora.lora_name}", prompt, GREEDY, lora=lora)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = o
        assert out is not None
        return out.outputs[0].token_ids, engine.get_stats().prefix_cache_hit_tokens - before

    tokens, hits = run(loras["all8"])
    assert (tokens, hits) == (refs["all8"][2], 0)
    tokens, hits = run(loras["qv4"])   # same tokens, another adapter: no hit
    assert (tokens, hits) == (refs["qv4"][2], 0)
    tokens, hits = run(None)           # nor for the base model
    assert (tokens, hits) == (refs[None][2], 0)
    tokens, hits = run(loras["all8"])  # the same adapter again: its own blocks are hits
    assert tokens == refs["all8"][2] and hits == 32   # (the last block is computed again for its logits)


@pytest.mark.parametrize("max_cpu_loras", [2, 1])
def test_more_adapters_in_flight_than_slots(lora_setup, max_cpu_loras):
    """One device slot, two adapters (and the base model) in flight: the scheduler admits one adapter at a time,
    the slot is refilled from the host cache (max_cpu_loras 2) or re-read from disk (1), output stays exact."""
    base, paths, refs = lora_setup
    loras = _requests(paths)
    items = [("all8", 0), ("qv4", 0), (None, 1), ("all8", 2), ("qv4", 1), ("all8", 1)]
    with LLM(base, max_loras=1, max_lora_rank=8, max_cpu_loras=max_cpu_loras, **ENGINE) as llm:
        outs = llm.generate([PROMPTS[i] for _, i in items], GREEDY,
                            lora_request=[loras[n] if n else None for n, _ in items])
        slots = llm.engine.runner.lora
        assert slots.num_slot_loads >= 3   # all8, qv4, then all8 back into the one slot
        assert len(slots.host) <= max_cpu_loras
    for (name, i), out in zip(items, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (name, i)


def test_tensor_parallel_2_matches_merged_peft(lora_setup):
    base, paths, refs = lora_setup
    loras = _requests(paths)
    items = [(name, i) for i in range(len(PROMPTS)) for name in [*loras, None]]
    with LLM(base, max_loras=3, max_lora_rank=8, tensor_parallel_size=2, **ENGINE) as llm:
        outs = llm.generate([PROMPTS[i] for _, i in items], GREEDY,
                            lora_request=[loras[n] if n else None for n, _ in items])
    for (name, i), out in zip(items, outs, strict=True):
        assert out.outputs[0].token_ids == refs[name][i], (name, i)


def test_lora_modules_at_start_and_runtime_add_remove(lora_setup, make_engine):
    base, paths, refs = lora_setup
    engine = make_engine(base, max_loras=2, max_lora_rank=8, lora_modules=f"all8={paths['all8']}",
                         **ENGINE)
    assert [r.lora_name for r in engine.list_loras()] == ["all8"]
    engine.add_lora(LoRARequest("qv4", 7, paths["qv4"]))
    assert [r.lora_name for r in engine.list_loras()] == ["all8", "qv4"]
    with pytest.raises(ValueError, match="is loaded from"):
        engine.add_lora(LoRARequest("qv4", 7, paths["mlp2"]))
    by_name = LoRARequest("all8", 1)   # a known adapter by name alone
    engine.add_request("x", PROMPTS[1], GREEDY, lora=by_name)
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.remove_lora("all8")
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out is not None and out.outputs[0].token_ids == refs["all8"][1]
    assert engine.remove_lora("all8") and not engine.remove_lora("all8")
    assert [r.lora_name for r in engine.list_loras()] == ["qv4"]
    with pytest.raises(ValueError, match="not loaded and the request gives no lora_path"):
        engine.add_request("y", PROMPTS[1], GREEDY, lora=by_name)
    assert not engine.scheduler.requests


def test_engine_without_lora_refuses_a_lora_request(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, device="cpu", num_gpu_blocks_override=16, block_size=8)
    with pytest.raises(ValueError, match="without enable_lora"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora=LoRARequest("a", 1, "/nowhere"))
    assert not engine.scheduler.requests


# ---- adapters we cannot serve --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refusal_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bad")
    base = make_tiny_model(str(root / "base"), "llama")
    llm = LLM(base, max_loras=1, max_lora_rank=4, **ENGINE)
    yield llm.engine, base, root
    llm.shutdown()


def _edit_config(path: str, **fields) -> str:
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("case, message", [
    ("rank", r"r = 8 exceeds max_lora_rank 4"),
    ("lm_head", r"target_modules \['lm_head'\] cannot be served"),
    ("dora", r"use_dora = True: DoRA adapters are not supported"),
    ("bias", r"bias = 'lora_only': trained biases are not supported"),
    ("modules_to_save", r"modules_to_save = \['lm_head'\]"),
    ("shape", r"tensor '.*layers\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \(2, 32\), expected \(2, 64\)"),
    ("corrupt", r"adapter_model\.safetensors is corrupt"),
    ("stray_tensor", r"tensor 'base_model\.model\.model\.norm\.extra\.weight' is not a LoRA A/B weight"),
    ("no_config", r"no adapter_config\.json"),
])
def test_unservable_adapter_is_refused_by_name(refusal_engine, tmp_path, case, message):
    engine, base, root = refusal_engine
    path = str(tmp_path / case)
    if case == "rank":
        make_adapter(base, path, 8, 8, ["q_proj"], seed=1)
    elif case == "lm_head":
        make_adapter(base, path, 2, 2, ["q_proj"], seed=1)
        _edit_config(path, target_modules=["q_proj", "lm_head"])
    elif case == "shape":   # an adapter of another base model (hidden 32)
        other = make_tiny_model(str(tmp_path / "other"), "llama", hidden_size=32, intermediate_size=64)
        make_adapter(other, path, 2, 2, ["q_proj"], seed=1)
    else:
        make_adapter(base, path, 2, 2, ["q_proj"], seed=1)
        weights = os.path.join(path, "adapter_model.safetensors")
        if case == "dora":
            _edit_config(path, use_dora=True)
        elif case == "bias":
            _edit_config(path, bias="lora_only")
        elif case == "modules_to_save":
            _edit_config(path, modules_to_save=["lm_head"])
        elif case == "corrupt":
            with open(weights, "r+b") as f:
                f.truncate(os.path.getsize(weights) // 2)
        elif case == "stray_tensor":
            from safetensors.torch import load_file, save_file

            tensors = load_file(weights)
            tensors["base_model.model.model.norm.extra.weight"] = torch.ones(4)
            save_file(tensors, weights)
        elif case == "no_config":
            os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(ValueError, match=message) as info:
        engine.add_lora(LoRARequest(case, 1, path))
    assert repr(case) in str(info.value)   # the adapter is named
    assert case not in [r.lora_name for r in engine.list_loras()]
    # the engine keeps serving, with a good adapter too
    good = make_adapter(base, str(tmp_path / "good"), 2, 4, ["v_proj"], seed=5)
    engine.add_request("ok", [5, 6, 7], GREEDY, lora=LoRARequest("good", 2, good))
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("good")


def test_knobs_are_checked():
    from pdcluster.engine.args import EngineArgs

    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineArgs(model="m", lora_modules={"a": "/p"})
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineArgs(model="m", enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="expected name=path"):
        EngineArgs(model="m", enable_lora=True, lora_modules="a")
    assert EngineArgs(model="m", enable_lora=True, lora_modules=["a=/x", "b=/y"]).lora_paths() == {"a": "/x",
                                                                                                   "b": "/y"}


# ---- the batched compute ----------------------------------------------------------------------------------


def test_batched_delta_equals_per_token_reference():
    """One layer, 3 slots of different ranks (padded to 4) over two output shards, tokens of every slot and of the
    base model mixed: the masked shrink/expand equals x @ A_s^T @ B_s^T token by token."""
    torch.manual_seed(0)
    step = LoRAStep()
    layer = LoRALayer(step, 16, [6, 10], slots=3, rank=4, dtype=torch.float64, device=torch.device("cpu"))
    ab = {}
    for slot, r in enumerate([4, 1, 3]):
        for shard, out in enumerate([6, 10]):
            if (slot, shard) == (1, 0):   # slot 1 targets only the second shard
                layer.set_slot(slot, shard, None, None)
                continue
            ab[slot, shard] = torch.randn(r, 16, dtype=torch.float64), torch.randn(out, r, dtype=torch.float64)
            layer.set_slot(slot, shard, *ab[slot, shard])
    slots = torch.tensor([2, -1, 0, 1, 1, -1, 2, 0])
    step.mask = (slots.unsqueeze(1) == torch.arange(3)).double().repeat_interleave(4, dim=1)
    step.lo, step.hi = 0, 3
    x = torch.randn(len(slots), 16, dtype=torch.float64)
    out = torch.zeros(len(slots), 16, dtype=torch.float64)
    layer.add_(x, out)
    want = torch.zeros_like(out)
    for t, s in enumerate(slots.tolist()):
        for shard, (lo, hi) in enumerate([(0, 6), (6, 16)]):
            if (s, shard) in ab:
                a, b = ab[s, shard]
                want[t, lo:hi] = x[t] @ a.t() @ b.t()
    torch.testing.assert_close(out, want)
    layer.clear_slot(2)
    out2 = torch.zeros_like(out)
    layer.add_(x, out2)
    assert out2[[0, 6]].abs().max() == 0
    torch.testing.assert_close(out2[2], want[2])
    # a step whose tokens use slots 1..2 only multiplies those rows (tokens of slot 0 would be cut off)
    step.lo, step.hi = 1, 3
    keep = slots != 0
    step.mask = (slots[keep].unsqueeze(1) == torch.arange(1, 3)).double().repeat_interleave(4, dim=1)
    out3 = torch.zeros(int(keep.sum()), 16, dtype=torch.float64)
    layer.add_(x[keep], out3)
    torch.testing.assert_close(out3, out2[keep])


def test_bad_lora_module_at_start_fails_the_engine(tiny_llama):
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=r"LoRA adapter 'bad' \(/nowhere\): no adapter_config\.json"):
        LLMEngine(EngineArgs(model=tiny_llama, lora_modules={"bad": "/nowhere"}, **ENGINE))


def test_adapter_on_routed_experts_is_refused(tmp_path):
    """Qwen3-MoE's layer 1 has routed experts, no dense MLP: an adapter on its gate_proj has nowhere to go."""
    from safetensors.torch import save_file

    base = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe")
    path = tmp_path / "moe_lora"
    path.mkdir()
    key = "base_model.model.model.layers.{}.mlp.gate_proj.lora_{}.weight"
    save_file({key.format(i, "A"): torch.zeros(2, 64) for i in (0, 1)} |
              {key.format(i, "B"): torch.zeros(128, 2) for i in (0, 1)}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                          "target_modules": ["gate_proj"]}))
    with LLM(base, max_lora_rank=4, **ENGINE) as llm:
        with pytest.raises(ValueError, match=r"layers\.1\.gate_proj has no LoRA-capable linear layer"):
            llm.engine.add_lora(LoRARequest("moe", 1, str(path)))
        assert not llm.engine.list_loras()


def test_tensor_parallel_2_with_replicated_kv_heads(tmp_path):
    """Mistral with one KV head: at TP = 2 both ranks hold the k/v rows, and so the k/v LoRA B rows, whole."""
    base = make_tiny_model(str(tmp_path / "mistral"), "mistral")
    path = make_adapter(base, str(tmp_path / "a"), 4, 8, ALL_TARGETS, seed=9)
    refs = merged_greedy(base, path, PROMPTS[:2], MAX_TOKENS)
    assert refs != merged_greedy(base, None, PROMPTS[:2], MAX_TOKENS)
    with LLM(base, max_lora_rank=4, tensor_parallel_size=2, **ENGINE) as llm:
        outs = llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("a", 1, path))
    assert [o.outputs[0].token_ids for o in outs] == refs


async def test_async_engine_takes_a_lora_request(lora_setup):
    from pdcluster import AsyncLLMEngine

    base, paths, refs = lora_setup
    engine = AsyncLLMEngine(model=base, max_lora_rank=8, **ENGINE)
    try:
        out = await engine.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("qv4", 2, paths["qv4"]))
        base_out = await engine.generate(PROMPTS[0], GREEDY)
    finally:
        engine.shutdown()
    assert out.outputs[0].token_ids == refs["qv4"][0] and base_out.outputs[0].token_ids == refs[None][0]


def _finish(engine, rid: str, prompt, lora) -> object:
    engine.add_request(rid, prompt, GREEDY, lora=lora)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished and o.request_id == rid), out)
    return out


def test_a_remote_prefill_landing_beside_another_adapter_waits_for_a_slot(lora_setup, make_engine):
    """max_loras 1: a request whose KV another node computed lands (it skips admission) while one of another
    adapter runs; the step takes one adapter's rows at a time instead of failing, both outputs exact."""
    base, paths, refs = lora_setup
    engine = make_engine(base, **ENGINE, max_loras=1)
    reqs = _requests(paths)
    engine.add_request("local", PROMPTS[0], GREEDY, lora=reqs["all8"])
    engine.step()
    # the remote side: the KV of PROMPTS[1] under qv4, computed by a second engine, copied into the reservation
    donor = make_engine(base, **ENGINE, max_loras=1)
    donor.add_request("d", PROMPTS[1], SamplingParams(temperature=0, max_tokens=1), hold_blocks=True,
                      lora=reqs["qv4"])
    first = None
    while first is None:
        first = next((o for o in donor.step() if o.finished), None)
    assert engine.add_request("remote", PROMPTS[1], GREEDY, remote_kv=True, lora=reqs["qv4"])
    seq = engine.scheduler.requests["remote"]
    for src, dst in zip(first.block_ids, seq.block_table, strict=False):
        engine.kv_pool.block(dst).copy_(donor.kv_pool.block(src))
    donor.abort("d")
    outs = {o.request_id: o for o in [engine.remote_kv_landed("remote", first.new_token_ids[0])]}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["local"].outputs[0].token_ids == refs["all8"][0]
    assert outs["remote"].outputs[0].token_ids == refs["qv4"][1]


def test_an_adapter_whose_files_went_away_ends_its_requests_only(lora_setup, make_engine, tmp_path):
    """With one host-cache entry, an evicted adapter is re-read from disk when it gets a slot again; its files gone,
    its requests end with the error, the slot table stays as it was (no other adapter's weights run under its
    name), the engine serves on, and once the files are back it is exact again."""
    import shutil

    base, paths, refs = lora_setup
    moved = str(tmp_path / "qv4")
    shutil.copytree(paths["qv4"], moved)
    engine = make_engine(base, **ENGINE, max_loras=1, max_cpu_loras=1)
    qv4, all8 = LoRARequest("qv4", 1, moved), _requests(paths)["all8"]
    assert _finish(engine, "a", PROMPTS[0], qv4).outputs[0].token_ids == refs["qv4"][0]
    assert _finish(engine, "b", PROMPTS[0], all8).outputs[0].token_ids == refs["all8"][0]   # qv4 leaves the cache
    shutil.move(moved, moved + ".away")
    gone = _finish(engine, "c", PROMPTS[0], qv4)
    assert gone.finished and gone.error and "qv4" in gone.error
    assert _finish(engine, "d", PROMPTS[2], all8).outputs[0].token_ids == refs["all8"][2]
    shutil.move(moved + ".away", moved)
    assert _finish(engine, "e", PROMPTS[0], qv4).outputs[0].token_ids == refs["qv4"][0]
