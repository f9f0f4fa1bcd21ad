"""StreamingLLM (attention_sinks + streaming_window): constant KV per sequence, generation past max_model_len,
tokens equal to a straightforward reference (keys kept before rotary, rotated by cache position each step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.layers.rotary import apply_rotary, key_rerotator, rope_inv_freq
from pdcluster.engine.testing import load_hf_model

BS, SINKS, WINDOW = 8, 4, 32


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.no_grad()
def reference_stream(model_dir: str, prompt: list[int], new_tokens: int, sinks: int, window: int, bs: int) -> list[int]:
    """Greedy StreamingLLM as the paper describes it: per layer a cache of pre-rotary keys and values; the first
    `sinks` tokens (rounded up to whole blocks, as the engine keeps them) stay, blocks of `bs` tokens after them
    are dropped while `window` tokens remain after the drop; queries and keys get rotary by cache position."""
    hf = load_hf_model(model_dir)
    m, cfg = hf.model, hf.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    keep = -(-sinks // bs) * bs
    ks = [torch.empty(0, hkv, d) for _ in m.layers]
    vs = [torch.empty(0, hkv, d) for _ in m.layers]

    def forward(tokens: list[int]) -> int:
        n, start = len(tokens), ks[0].shape[0]
        x = m.embed_tokens(torch.tensor(tokens))
        cos, sin = m.rotary_emb(x[None], torch.arange(start + n)[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        causal = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, hq, d)
            ks[i] = torch.cat([ks[i], attn.k_proj(h).view(n, hkv, d)])
            vs[i] = torch.cat([vs[i], attn.v_proj(h).view(n, hkv, d)])
            qr = _rotate(q, cos[start:], sin[start:]).transpose(0, 1)[None]
            kr = _rotate(ks[i], cos, sin).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qr, kr, vs[i].transpose(0, 1)[None], attn_mask=causal,
                                               enable_gqa=True)
            x = x + attn.o_proj(o[0].transpose(0, 1).reshape(n, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for i in range(len(ks)):
            while ks[i].shape[0] - keep - bs >= window:
                ks[i] = torch.cat([ks[i][:keep], ks[i][keep + bs:]])
                vs[i] = torch.cat([vs[i][:keep], vs[i][keep + bs:]])
        return int(hf.lm_head(m.norm(x[-1])).argmax())

    out = [forward(prompt)]
    while len(out) < new_tokens:
        out.append(forward([out[-1]]))
    return out


def test_moving_stored_keys_equals_rotating_at_the_new_position():
    cfg = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    pool = KVCachePool(4, 2, BS, 2, 16, torch.float32)
    raw = torch.randn(BS, 2, 16)
    inv = rope_inv_freq(16, 10000.0, cfg)
    positions = torch.arange(40, 40 + BS)
    angles = torch.cat((inv, inv))[None, :] * positions[:, None].float()
    pool.tensor[:, 0, 1] = apply_rotary(raw, angles.cos()[:, None], angles.sin()[:, None])   # block 1's keys
    key_rerotator(pool, 16, 10000.0, cfg)([1], -24)
    moved = torch.cat((inv, inv))[None, :] * (positions - 24)[:, None].float()
    want = apply_rotary(raw, moved.cos()[:, None], moved.sin()[:, None])
    assert torch.allclose(pool.tensor[0, 0, 1], want, atol=1e-5)
    assert torch.allclose(pool.tensor[1, 0, 1], want, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_streaming_generates_past_max_model_len_with_constant_kv(backend, tiny_llama, make_engine):
    """Window 32, 4 sinks (one 8-token block), max_model_len 96: 160 tokens (5x the window) with at most 7 blocks
    in use, equal to the reference."""
    prompt = list(range(5, 25))
    engine = make_engine(tiny_llama, block_size=BS, max_model_len=96, attention_sinks=SINKS,
                         streaming_window=WINDOW, attention_backend=backend)
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
    most, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        most = max(most, engine.get_stats().num_used_blocks)
    assert out.finished and out.outputs[0].finish_reason == "length"
    got = out.outputs[0].token_ids
    assert len(got) == 160 and len(prompt) + 160 > 96
    assert most <= 1 + (WINDOW + BS) // BS + 1
    assert got == reference_stream(tiny_llama, prompt, 160, SINKS, WINDOW, BS)


def test_streaming_settings_are_checked(tiny_llama, make_engine):
    with pytest.raises(ValueError, match="streaming_window"):
        make_engine(tiny_llama, attention_sinks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(tiny_llama, max_model_len=40, attention_sinks=4, streaming_window=32, block_size=8)
    with pytest.raises(ValueError, match="int8"):
        make_engine(tiny_llama, kv_cache_dtype="int8", streaming_window=32)
