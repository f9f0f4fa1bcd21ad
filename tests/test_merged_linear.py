"""Merged projections (one q/k/v GEMM, one gate/up weight) compute what the checkpoint's separate projections do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.engine.attention import get_backend_class
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.linear import MergedLinear
from pdcluster.engine.loader import iter_weights, load_model


def _merged(parts: dict[str, torch.Tensor], biases: dict[str, torch.Tensor] | None) -> MergedLinear:
    layer = MergedLinear(8, {name: w.shape[0] for name, w in parts.items()}, bias=biases is not None)
    for name, w in parts.items():
        layer.load_shard(layer.weight, name, w)
        if biases is not None:
            layer.load_shard(layer.bias, name, biases[name])
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_merged_linear_equals_separate_projections(bias, packed):
    g = torch.Generator().manual_seed(0)
    parts = {"q": torch.randn(12, 8, generator=g), "k": torch.randn(4, 8, generator=g),
             "v": torch.randn(4, 8, generator=g)}
    biases = {n: torch.randn(w.shape[0], generator=g) for n, w in parts.items()} if bias else None
    layer = _merged(parts, biases)
    assert layer.shard_offsets == {"q": (0, 12), "k": (12, 4), "v": (16, 4)}
    if packed:
        layer.prepack()
    x = torch.randn(5, 8, generator=g)
    want = torch.cat([F.linear(x, w, None if biases is None else biases[n]) for n, w in parts.items()], dim=-1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_merged_linear_refuses_a_part_of_the_wrong_size():
    layer = MergedLinear(8, {"gate": 6, "up": 6})
    with pytest.raises(ValueError, match="shard up: checkpoint has 5 rows, model expects 6"):
        layer.load_shard(layer.weight, "up", torch.zeros(5, 8))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loaded_model_merged_layers_match_checkpoint_projections(arch, tiny_models):
    """Every layer's qkv_proj and gated MLP, loaded (and prepacked) from the checkpoint, against F.linear on the
    checkpoint's own q/k/v (with Qwen2's biases), gate, up and down tensors."""
    model_dir = tiny_models[arch]
    config = ModelConfig.from_pretrained(model_dir)
    backend = get_backend_class("torch")(config.num_heads, config.num_kv_heads, config.head_dim)
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"), backend)
    ckpt = dict(iter_weights(model_dir))
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        want = torch.cat([F.linear(x, ckpt[f"{p}self_attn.{n}_proj.weight"], ckpt.get(f"{p}self_attn.{n}_proj.bias"))
                          for n in "qkv"], dim=-1)
        with torch.inference_mode():
            torch.testing.assert_close(layer.self_attn.qkv_proj(x), want, rtol=1e-5, atol=1e-5)
            gate, up = (F.linear(x, ckpt[f"{p}mlp.{n}_proj.weight"]) for n in ("gate", "up"))
            want = F.linear(F.silu(gate) * up, ckpt[f"{p}mlp.down_proj.weight"])
            torch.testing.assert_close(layer.mlp(x), want, rtol=1e-5, atol=1e-5)
    assert config.qkv_bias == (arch == "qwen2")
