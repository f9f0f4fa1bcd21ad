"""Speculative decoding with heads over the target's hidden states: EAGLE, EAGLE-3 and DeepSeek MTP in the
checkpoint layouts vLLM reads. The drafts equal a from-scratch reference of each head (transformers' hidden states
and, for MTP, transformers' own DeepSeek layer), and outputs equal the engine without speculation on every
architecture, backend, sampling setting, under preemption, prefix hits, int8 KV and tensor parallelism."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import make_prompts, run_all, run_outputs, run_staggered

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.kv_connector import KVConnector
from pdcluster.engine.speculative.config import SpeculativeConfig
from pdcluster.engine.testing import add_mtp_layer, load_hf_model, make_eagle_head, make_tiny_model

ARCHS = ["llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def spec(method: str, model: str = "", k: int = 3) -> dict:
    return {"method": method, "num_speculative_tokens": k, "draft_policy": "fixed",
            **({"model": model} if model else {})}


def prompts_with_repeats() -> list[list[int]]:
    motif = make_prompts([7], seed=11)[0]
    return [motif * 4, [9] * 21, make_prompts([37], seed=12)[0], motif * 12, make_prompts([90], seed=13)[0]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for arch in ARCHS:
        target = out[arch] = make_tiny_model(str(root / arch), arch)
        out[f"eagle-{arch}"] = make_eagle_head(str(root / f"eagle-{arch}"), target, "eagle", seed=1)
        out[f"eagle3-{arch}"] = make_eagle_head(str(root / f"eagle3-{arch}"), target, "eagle3", seed=2,
                                                draft_vocab_size=300, aux_layers=[0, 1, 1])
    out["echo"] = make_eagle_head(str(root / "echo"), out["llama"], "eagle", echo=True)
    out["eagle-2layers"] = make_eagle_head(str(root / "eagle-2layers"), out["llama"], "eagle", seed=3,
                                           num_layers=2, fc_bias=True)
    out["mtp"] = add_mtp_layer(make_tiny_model(str(root / "mtp"), "deepseek_v3", num_hidden_layers=3), seed=4)
    out["mtp-echo"] = add_mtp_layer(make_tiny_model(str(root / "mtp-echo"), "deepseek_v3", num_hidden_layers=3,
                                                     seed=12), echo=True)   # a seed whose outputs repeat tokens
    return out


def record_drafts(engine) -> list[tuple[list[int], list[int]]]:
    """From now on, (the sequence's tokens, its drafts) whenever `engine`'s proposer drafts for one."""
    seen: list[tuple[list[int], list[int]]] = []
    set_drafts = engine.scheduler.set_drafts

    def record(seq, drafts):
        if drafts:
            seen.append((list(seq.token_ids), list(drafts)))
        set_drafts(seq, drafts)

    engine.scheduler.set_drafts = record
    return seen


def _greedy(make_engine, model, prompts, params=GREEDY, **kw):
    engine = make_engine(model, max_num_batched_tokens=64, **kw)
    got = run_staggered(engine, prompts, params)
    return [got[str(i)] for i in range(len(prompts))], engine.get_stats()


# ---- configuration ---------------------------------------------------------------------------------------

def test_configs_name_the_head_and_mtp_reads_the_target():
    assert SpeculativeConfig.parse(spec("eagle3", "/h")) == SpeculativeConfig("eagle3", 3, model="/h",
                                                                               draft_policy="fixed")
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}) \
        == SpeculativeConfig("mtp", 1)
    with pytest.raises(ValueError, match="eagle head's checkpoint directory"):
        SpeculativeConfig.parse(spec("eagle"))
    with pytest.raises(ValueError, match="mtp reads the target"):
        SpeculativeConfig.parse(spec("mtp", "/h"))


def test_heads_that_do_not_fit_the_target_are_refused(models, make_engine, tmp_path):
    with pytest.raises(ValueError, match="no tensors of layer 2"):   # a config that names MTP layers it lacks
        make_engine(models["deepseek_v3"], speculative_config=spec("mtp"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        make_engine(models["llama"], speculative_config=spec("mtp"))
    bad = make_tiny_model(str(tmp_path / "wide"), "llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocab_size 600"):
        make_engine(models["llama"], speculative_config=spec("eagle", make_eagle_head(str(tmp_path / "h"), bad)))
    head = make_eagle_head(str(tmp_path / "h3"), models["llama"], "eagle3", aux_layers=[0, 1, 5])
    with pytest.raises(ValueError, match=re.escape("eagle_aux_hidden_state_layer_ids [0, 1, 5]")):
        make_engine(models["llama"], speculative_config=spec("eagle3", head))
    from safetensors.torch import load_file, save_file

    path = os.path.join(head, "model.safetensors")
    tensors = load_file(path)
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=re.escape("lacks ['midlayer.hidden_norm.weight']")):
        make_engine(models["llama"], speculative_config=spec("eagle3", head))


# ---- the heads against a reference ------------------------------------------------------------------------

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions[:, None].float() * inv[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    half = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos[:, None] + half * sin[:, None]


def _llama_layer(t, p, x_in, residual, cfg):
    """One Llama layer over the whole sequence from scratch: attention over `x_in` (already normed), the MLP."""
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = x_in.shape[0]
    pos = torch.arange(n)
    q = _rope((x_in @ t[f"{p}self_attn.q_proj.weight"].T).view(n, heads, hd), pos, cfg["rope_theta"])
    k = _rope((x_in @ t[f"{p}self_attn.k_proj.weight"].T).view(n, kv, hd), pos, cfg["rope_theta"])
    v = (x_in @ t[f"{p}self_attn.v_proj.weight"].T).view(n, kv, hd)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                       enable_gqa=True).transpose(0, 1).reshape(n, heads * hd)
    hidden = o @ t[f"{p}self_attn.o_proj.weight"].T + residual
    normed = _rms(hidden, t[f"{p}post_attention_layernorm.weight"])
    mlp = (F.silu(normed @ t[f"{p}mlp.gate_proj.weight"].T) * (normed @ t[f"{p}mlp.up_proj.weight"].T)) \
        @ t[f"{p}mlp.down_proj.weight"].T
    return mlp + hidden


def _reference_drafts(method: str, head_dir: str, target_dir: str, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `tokens`, everything recomputed from scratch each draft: the target's
    features from transformers (hidden_states: the stream entering each layer, the last one normed)."""
    from safetensors.torch import load_file

    hf = load_hf_model(target_dir)
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    embed = hf.get_input_embeddings().weight.detach()
    lm_head = hf.get_output_embeddings().weight.detach()
    if method == "mtp":
        return _reference_mtp(target_dir, tokens, states[-1][0], embed, k)
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    t = {name.replace("midlayer.", "layers.0."): v for name, v in load_file(
        os.path.join(head_dir, "model.safetensors")).items()}
    aux = cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if method == "eagle":
        feats = states[-1][0]
    else:
        feats = torch.cat([states[i][0] for i in aux], -1) @ t["fc.weight"].T
    ids = list(tokens[1:])
    drafts = []
    for _ in range(k):
        e = embed[torch.tensor(ids)]
        if method == "eagle":
            x = torch.cat((e, feats), -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
            for i in range(cfg["num_hidden_layers"]):
                x_in = x if i == 0 else _rms(x, t[f"layers.{i}.input_layernorm.weight"])
                x = _llama_layer(t, f"layers.{i}.", x_in, x, cfg)
            out = x
            best = int((out[-1] @ lm_head.T).argmax())
        else:
            x_in = torch.cat((_rms(e, t["layers.0.input_layernorm.weight"]),
                              _rms(feats, t["layers.0.hidden_norm.weight"])), -1)
            out = _llama_layer(t, "layers.0.", x_in, feats, cfg)
            best = int((_rms(out[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
            best += int(t["d2t"][best])
        drafts.append(best)
        ids.append(best)
        feats = torch.cat((feats, out[-1:]))
    return drafts


def _reference_mtp(target_dir: str, tokens: list[int], last_hidden, embed, k: int) -> list[int]:
    """DeepSeek MTP with transformers' DeepseekV3 decoder layer (loaded as layer L of an L + 1 layer model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    layer_index = config.num_hidden_layers
    config.num_hidden_layers += 1
    full = AutoModelForCausalLM.from_pretrained(target_dir, config=config, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    t = load_file(os.path.join(target_dir, "model.safetensors"))
    p = f"model.layers.{layer_index}."
    feats = last_hidden
    ids = list(tokens[1:])
    drafts = []
    with torch.no_grad():
        for _ in range(k):
            n = len(ids)
            e = embed[torch.tensor(ids)].clone()
            e[0] = 0.0   # position 0
            x = torch.cat((_rms(e, t[f"{p}enorm.weight"]), _rms(feats, t[f"{p}hnorm.weight"])), -1) \
                @ t[f"{p}eh_proj.weight"].T
            position_ids = torch.arange(n)[None]
            rope = full.model.rotary_emb(x[None], position_ids)
            out = full.model.layers[layer_index](x[None], attention_mask=None, position_ids=position_ids,
                                                 position_embeddings=rope)
            out = (out[0] if isinstance(out, tuple) else out)[0]
            best = int((_rms(out[-1], t[f"{p}shared_head.norm.weight"]) @ t[f"{p}shared_head.head.weight"].T).argmax())
            drafts.append(best)
            ids.append(best)
            feats = torch.cat((feats, out[-1:]))
    return drafts


@pytest.mark.parametrize("method, head", [("eagle", "eagle-2layers"), ("eagle3", "eagle3-llama"), ("mtp", "mtp")])
def test_drafts_equal_a_from_scratch_reference_of_the_head(method, head, models, make_engine):
    """The head's KV, written a chunk at a time (prompt chunks, then each step's verified tokens, drafting or
    paused), and its own features for later drafts give the drafts of the head recomputed from scratch over the
    whole sequence."""
    target = models["mtp"] if method == "mtp" else models["llama"]
    engine = make_engine(target, speculative_config=spec(method, "" if method == "mtp" else models[head], 3),
                         max_num_batched_tokens=32)
    seen = record_drafts(engine)
    # 24 tokens: this random head's drafts fail, so drafting pauses (2, 4, 8 steps); the later drafts check that
    # the head kept up with the tokens of the paused steps
    run_all(engine, [make_prompts([45], seed=21)[0]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert len(seen) >= 5
    for tokens, drafts in seen[:6]:
        assert drafts == _reference_drafts(method, models[head], target, tokens, len(drafts)), len(tokens)


# ---- greedy: the same tokens as without speculation ------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_the_target_alone_for_every_architecture(arch, models, make_engine):
    prompts = prompts_with_repeats()
    want, _ = _greedy(make_engine, models[arch], prompts)
    for method in ("eagle", "eagle3"):
        got, stats = _greedy(make_engine, models[arch], prompts,
                             speculative_config=spec(method, models[f"{method}-{arch}"]))
        assert got == want, method
        assert stats.spec_method == method and stats.spec_num_draft_tokens > 0


def test_drafts_that_pass_keep_the_output(models, make_engine):
    """The echo head drafts right wherever the target repeats a token: many drafts pass, several in one step,
    outputs unchanged."""
    prompts = prompts_with_repeats()
    for target, method, head in ((models["llama"], "eagle", models["echo"]), (models["mtp-echo"], "mtp", "")):
        want, _ = _greedy(make_engine, target, prompts)
        got, stats = _greedy(make_engine, target, prompts, speculative_config=spec(method, head, 4))
        assert got == want, method
        assert stats.spec_num_accepted_tokens > 10 and stats.spec_accepted_per_position[1] > 0, (method, stats)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equal_with_prefix_hits_preemption_and_int8(backend, models, make_engine):
    """Prefix hits (the target skips positions: the head's KV there is another request's) and preemption (the
    head starts over from the recomputed prompt); int8 KV in both pools."""
    base = prompts_with_repeats()
    prompts = base + [base[0][:20] + [5, 6, 7], base[3][:50]]
    kw = dict(attention_backend=backend, num_gpu_blocks_override=22, block_size=8, max_num_seqs=8)
    for kv in ("auto", "int8"):
        want, plain = _greedy(make_engine, models["llama"], prompts, kv_cache_dtype=kv, **kw)
        assert plain.num_preemptions > 0 and plain.prefix_cache_hit_tokens > 0
        for method, head in (("eagle", models["echo"]), ("eagle3", models["eagle3-llama"])):
            got, stats = _greedy(make_engine, models["llama"], prompts, kv_cache_dtype=kv,
                                 speculative_config=spec(method, head), **kw)
            assert got == want, (kv, method)
    mla_want, _ = _greedy(make_engine, models["mtp-echo"], prompts, num_gpu_blocks_override=22, block_size=8)
    got, stats = _greedy(make_engine, models["mtp-echo"], prompts, num_gpu_blocks_override=22, block_size=8,
                         speculative_config=spec("mtp", k=2))
    assert got == mla_want and stats.spec_num_accepted_tokens > 0


def test_npu_and_flashinfer_paths_run_the_heads(models, make_engine):
    from flashinfer_emulator import emulated_flashinfer
    from npu_emulator import emulated_torch_npu

    prompts = prompts_with_repeats()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    head = spec("eagle", models["echo"])
    kw = dict(dtype="float16", num_gpu_blocks_override=48, max_num_batched_tokens=64)
    with emulated_torch_npu(npu_on_cpu=True):
        want = run_all(make_engine(models["llama"], device="npu", attention_backend="cpu", **kw), prompts, params)
        engine = make_engine(models["llama"], device="npu", speculative_config=head, **kw)
        assert run_all(engine, prompts, params) == want
        assert engine.get_stats().spec_num_accepted_tokens > 0
    kw = dict(num_gpu_blocks_override=48, max_num_batched_tokens=64)
    want = run_all(make_engine(models["llama"], attention_backend="torch", **kw), prompts, params)
    with emulated_flashinfer(float32=True):
        engine = make_engine(models["llama"], attention_backend="flashinfer", speculative_config=head, **kw)
        assert run_all(engine, prompts, params) == want
        assert engine.get_stats().spec_num_accepted_tokens > 0


def test_seeded_sampling_logprobs_and_grammar_equal_the_target_alone(models, make_engine):
    model = models["llama"]
    prompts = (prompts_with_repeats() * 3)[:12]
    params = [SamplingParams(temperature=[0.0, 0.8, 1.2][i % 3], top_k=[0, 20][i % 2], seed=50 + i,
                             max_tokens=[9, 25][i % 2], logprobs=2 if i % 2 else None, ignore_eos=i % 4 == 0,
                             repetition_penalty=1.1 if i % 3 == 1 else 1.0,
                             structured_outputs={"regex": "(ab|cd){2,5}x"} if i % 5 == 2 else None)
              for i in range(len(prompts))]
    want = [o.outputs[0] for o in run_outputs(make_engine(model), prompts, params)]
    for method, head in (("eagle", models["echo"]), ("eagle3", models["eagle3-llama"])):
        engine = make_engine(model, speculative_config=spec(method, head, 4))
        got = [o.outputs[0] for o in run_outputs(engine, prompts, params)]
        for g, w in zip(got, want, strict=True):
            assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), method
            if w.logprobs is not None:
                assert [a for a, _ in g.logprobs] == pytest.approx([a for a, _ in w.logprobs], abs=1e-4)


def test_heads_still_follow_the_target_while_drafting_is_off(models, make_engine):
    """disable_by_batch_size: no drafts while many sequences run, yet the head keeps reading the target, so once
    the batch shrinks it drafts from the whole context (what the from-scratch reference drafts)."""
    prompts = prompts_with_repeats()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 6, 6, 30, 30)]
    want = run_all(make_engine(models["llama"]), prompts, params)
    engine = make_engine(models["llama"], speculative_config={**spec("eagle", models["eagle-2layers"]),
                                                              "disable_by_batch_size": 3})
    seen = record_drafts(engine)
    assert run_all(engine, prompts, params) == want
    # drafts only once the three short ones finished, for the long ones
    assert seen and all(any(tokens[:len(p)] == p and len(tokens) >= len(p) + 6 for p in prompts[3:])
                        for tokens, _ in seen)
    for tokens, drafts in seen[:3]:
        assert drafts == _reference_drafts("eagle", models["eagle-2layers"], models["llama"], tokens, len(drafts))


# ---- P/D: the prefill node ships the prompt's features ---------------------------------------------------

class _Reservations(KVConnector):
    def __init__(self) -> None:
        self.reserved: dict[str, list[int]] = {}

    def on_remote_reserved(self, request_id, block_ids, num_cached_tokens):
        self.reserved[request_id] = list(block_ids)


def _prefill_then_decode(make_engine, model, head_spec, prompts, params):
    """The P/D flow in one process: the prefill engine computes each prompt (chunked, hold_blocks), its blocks
    are copied into the decode engine's reservation, which gets the first token and the prompt's features.
    Returns (outputs, the decode engine's recorded (tokens, drafts), the prefill engine)."""
    prefill = make_engine(model, speculative_config=head_spec, max_num_batched_tokens=32)
    decode = make_engine(model, speculative_config=head_spec, kv_connector=_Reservations(),
                         num_gpu_blocks_override=64)
    seen = record_drafts(decode)
    for i, p in enumerate(prompts):
        assert decode.add_request(f"d{i}", p, params, remote_kv=True)
        prefill.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
        out = None
        while out is None:
            out = next((o for o in prefill.step() if o.finished), None)
        for src, dst in zip(out.block_ids, decode.kv_connector.reserved[f"d{i}"], strict=False):
            decode.kv_pool.block(dst).copy_(prefill.kv_pool.block(src))
        prefill.abort(f"p{i}")
        decode.remote_kv_landed(f"d{i}", out.new_token_ids[0], None, out.prompt_features)
    got = {}
    while decode.has_unfinished_requests():
        for o in decode.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    return [got[f"d{i}"] for i in range(len(prompts))], seen, prefill


def test_a_prefill_engine_ships_the_prompt_features_and_the_decode_head_drafts_from_them(models, make_engine,
                                                                                       monkeypatch):
    """The decode engine's head runs over the features the prefill engine kept (its own head never ran): its
    first drafts are the reference's over the whole prompt; with a bound below the prompt, only the last
    positions travel and the output is still the target's."""
    from pdcluster.engine.speculative import head_proposer

    model, head = models["llama"], models["eagle-2layers"]
    prompts = [make_prompts([70], seed=31)[0], make_prompts([45], seed=32)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = run_all(make_engine(model), prompts, params)
    ran = []
    run = head_proposer.HeadProposer._run
    monkeypatch.setattr(head_proposer.HeadProposer, "_run",
                        lambda self, views, from_target: ran.append(self) or run(self, views, from_target))
    got, seen, prefill = _prefill_then_decode(make_engine, model, spec("eagle", head), prompts, params)
    assert got == want and prefill.proposer not in ran
    firsts = {tuple(tokens[:len(p)]): (tokens, drafts) for tokens, drafts in reversed(seen)
              for p in prompts if tokens[:len(p)] == p}
    assert len(firsts) == 2
    for tokens, drafts in firsts.values():
        assert drafts == _reference_drafts("eagle", head, model, tokens, len(drafts))
    monkeypatch.setattr(head_proposer, "SHIPPED_FEATURE_BYTES", 20 * 64 * 4)   # 20 rows of fp32 features
    got, seen, _ = _prefill_then_decode(make_engine, model, spec("eagle", head), prompts, params)
    assert got == want and seen


def test_a_decode_engine_ignores_features_that_do_not_fit(models, make_engine):
    engine = make_engine(models["llama"], speculative_config=spec("eagle", models["echo"]),
                         kv_connector=_Reservations())
    prompt = make_prompts([20], seed=33)[0]
    for i, features in enumerate([(0, "float32", b"\0" * 19 * 64 * 4), (0, "int64", b"\0" * 20 * 64 * 8),
                                  (3, "float32", b"\0" * 20 * 64 * 4), (0, "bogus", b"\0" * 8)]):
        engine.add_request(f"r{i}", prompt, GREEDY, remote_kv=True)
        engine.remote_kv_landed(f"r{i}", 5, None, features)
        assert engine.scheduler.requests[f"r{i}"].proposer_state is None
    engine.abort_all()


def test_prefill_done_carries_the_features_and_refuses_odd_ones():
    import dataclasses

    from pdcluster.control.protocol import PrefillDone, ProtocolError, decode, encode

    msg = PrefillDone(rid="r", first_token=3, features=b"\x00" * 16, features_dtype="bfloat16", features_start=4)
    assert decode(encode(msg)) == msg
    for bad in ({"features_dtype": "int64"}, {"features_start": -1}, {"features": "text"}):
        with pytest.raises(ProtocolError):
            decode(encode(dataclasses.replace(msg, **bad)))


@pytest.mark.slow
def test_tensor_parallel_target_with_a_rank0_head(models, make_engine, tmp_path):
    """TP = 2 over gloo: features come from rank 0's full hidden states; the head reads the whole embedding and
    LM head from the target's checkpoint (the ranks hold vocabulary shards)."""
    model = make_tiny_model(str(tmp_path / "tp"), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    heads = {"eagle": make_eagle_head(str(tmp_path / "echo"), model, "eagle", echo=True),
             "eagle3": make_eagle_head(str(tmp_path / "e3"), model, "eagle3", draft_vocab_size=200,
                                       aux_layers=[0, 1, 1])}
    prompts = prompts_with_repeats()
    kw = dict(max_num_batched_tokens=48, num_gpu_blocks_override=40, block_size=8, max_num_seqs=6)
    want = run_all(make_engine(model, **kw), prompts, GREEDY)
    for method, head in heads.items():
        engine = make_engine(model, tensor_parallel_size=2, speculative_config=spec(method, head), **kw)
        assert run_all(engine, prompts, GREEDY) == want, method
        if method == "eagle":
            assert engine.get_stats().spec_num_accepted_tokens > 0
        engine.shutdown()


def test_a_converted_deepseek_keeps_its_mtp_layers(models, make_engine, tmp_path):
    """`pdcluster convert` writes the MTP layer (past num_hidden_layers) whole into the output, so `mtp` runs on a
    converted model as on the original checkpoint."""
    from safetensors import safe_open

    from pdcluster.engine.convert import convert_model

    converted = convert_model(models["mtp-echo"], str(tmp_path / "converted"), "float32")
    with open(os.path.join(converted, "config.json")) as f:
        mtp = f"model.layers.{json.load(f)['num_hidden_layers']}."
    with safe_open(os.path.join(converted, "model.safetensors"), "pt") as f:
        assert {f"{mtp}eh_proj.weight", f"{mtp}enorm.weight"} <= set(f.keys())
    prompts = prompts_with_repeats()
    want, source_stats = _greedy(make_engine, models["mtp-echo"], prompts, speculative_config=spec("mtp", k=2))
    got, stats = _greedy(make_engine, converted, prompts, speculative_config=spec("mtp", k=2))
    assert got == want and stats.spec_num_accepted_tokens == source_stats.spec_num_accepted_tokens > 0


@pytest.mark.slow
def test_mtp_on_a_presharded_tensor_parallel_conversion(models, make_engine, tmp_path):
    """A conversion for TP = 2 keeps the MTP layer whole in rank 0's file, where the rank-0 head reads it."""
    from pdcluster.engine.convert import convert_model

    converted = convert_model(models["mtp-echo"], str(tmp_path / "tp2"), "float32", tensor_parallel_size=2)
    prompts = prompts_with_repeats()[:4]
    kw = dict(max_num_batched_tokens=48, num_gpu_blocks_override=40, block_size=8)
    want = run_all(make_engine(models["mtp-echo"], **kw), prompts, GREEDY)
    engine = make_engine(converted, tensor_parallel_size=2, speculative_config=spec("mtp", k=2), **kw)
    assert run_all(engine, prompts, GREEDY) == want
    assert engine.get_stats().spec_num_accepted_tokens > 0
    engine.shutdown()


@pytest.mark.slow
def test_eagle_on_a_presharded_tensor_parallel_conversion(make_engine, tmp_path):
    """A conversion for TP = 2 holds vocabulary shards of the embedding and LM head per rank file: the rank-0
    head reads them whole (concatenated over the files)."""
    from pdcluster.engine.convert import convert_model

    model = make_tiny_model(str(tmp_path / "tp"), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    head = make_eagle_head(str(tmp_path / "echo"), model, "eagle", echo=True)
    converted = convert_model(model, str(tmp_path / "tp2"), "float32", tensor_parallel_size=2)
    prompts = prompts_with_repeats()[:4]
    kw = dict(max_num_batched_tokens=48, num_gpu_blocks_override=40, block_size=8)
    want = run_all(make_engine(model, **kw), prompts, GREEDY)
    engine = make_engine(converted, tensor_parallel_size=2, speculative_config=spec("eagle", head), **kw)
    assert run_all(engine, prompts, GREEDY) == want
    assert engine.get_stats().spec_num_accepted_tokens > 0
    engine.shutdown()
