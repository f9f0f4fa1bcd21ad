"""The quantized-weight kernels on a CUDA GPU (engine/quant/kernels.py): each scheme picks torch's CUDA kernel
(W8A8 `torch._int_mm` with decode-sized inputs padded past its 16-row minimum, W8A16 `_weight_int8pack_mm`, W4A16
tinygemm) and multiplies like the dequantize-then-matmul reference; a quantized engine decodes on the GPU. Skipped
without a GPU: `make gpu-check` runs it (benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.quant.kernels import pack, quant_linear, quantize_activations_dynamic
from pdcluster.engine.quant.scheme import QuantScheme, quantize_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")

SCHEMES = {"w8a8": (QuantScheme(8, 0, True, "int8_dynamic"), "int8mm"),
           "w8a16": (QuantScheme(8, 0, True), "int8pack"),
           "w4a16": (QuantScheme(4, 128, True), "int4pack"),
           "w4a16-zeros": (QuantScheme(4, 64, False), "int4pack")}


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
def test_cuda_kernels_equal_the_dequantized_reference(name, rows):
    scheme, kernel = SCHEMES[name]
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 512, generator=g) * 0.05   # 1000 rows: padded to the kernels' multiples
    qw = quantize_weight(weight, scheme)
    qw.scheme = scheme
    packed = pack(qw, scheme, torch.device("cuda"), torch.bfloat16)
    print(f"{name}: kernel {packed.kernel} {packed.variant}")
    if packed.kernel == "dequantized":
        pytest.skip(f"this torch build has no CUDA kernel for {name} (it dequantizes at load)")
    assert packed.kernel == kernel
    x = torch.randn(rows, 512, generator=g)
    got = quant_linear(x.to("cuda", torch.bfloat16), packed).float().cpu()
    xr = x.bfloat16().float()
    if scheme.activations != "none":
        xq, scale = quantize_activations_dynamic(xr)
        xr = xq.float() * scale
    want = xr @ qw.dequantize().t()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_quantized_engine_decodes_on_the_gpu(tmp_path):
    """Converted checkpoints load onto the GPU with the CUDA kernels and decode (the kernels' numbers are checked
    above; a random tiny model's greedy tokens are too tie-prone to compare across kernels)."""
    from pdcluster import LLM, SamplingParams
    from pdcluster.engine.convert import convert_model
    from pdcluster.engine.layers.linear import Linear
    from pdcluster.engine.testing import make_tiny_model

    src = make_tiny_model(str(tmp_path / "m"), "llama", hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for scheme in ("w8a8", "w8a16", "w4a16"):
        llm = LLM(model=convert_model(src, str(tmp_path / scheme), "bfloat16", quantization=scheme), device="cuda",
                  dtype="bfloat16")
        kernels = {m.quant.kernel for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quant}
        print(f"{scheme}: {kernels}")
        assert kernels and kernels <= {"int8mm", "int8pack", "int4pack", "dequantized"}
        assert len(llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids) == 16
        llm.engine.shutdown()
