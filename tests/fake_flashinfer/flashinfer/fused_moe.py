"""flashinfer.fused_moe.cutlass_fused_moe, as in flashinfer-python v0.6.17 (`flashinfer/fused_moe/core.py`
cutlass_fused_moe and its docstring; https://docs.flashinfer.ai/api/fused_moe.html; the input checks of
csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu FusedMoeRunner; the weight convention of its
test tests/moe/test_trtllm_cutlass_fused_moe.py).

One call routes, runs and combines: for each token t and each of its k experts e (global id) held by this rank
(ep_rank * E_local <= e < (ep_rank + 1) * E_local, E_local = fc1_expert_weights.shape[0]):
    out[t] += token_final_scales[t, j] * (act(input[t] @ fc1[e_local].T) @ fc2[e_local].T)
fc1 is [E_local, 2 * I, H] with the LINEAR half first and the GATE half second (the test splits it as
`w3_expert, w1_expert = torch.chunk(w31_expert, 2, dim=0)`; Swiglu = silu(x @ w1.T) * (x @ w3.T)); fc2 is
[E_local, H, I]. Rounding as the kernels: each GEMM accumulates in float32 and writes its activation dtype, the
activation rounds once, the finalize sums the k weighted rows in float32.

Emulated: unquantized float16 / bfloat16 (activation and weights of one dtype, output that dtype), ActivationType
Swiglu, expert parallelism (ep_size / ep_rank), `output=`. Raised as the binding does: input not 2-D of the weights'
dtype, token_selected_experts not int32 [T, k], token_final_scales not float32 [T, k], weights not 3-D with one
expert count, fc1 rows != 2 * fc2's inter size, hidden or inter size not a multiple of 8 (TMA's 128-bit
alignment), expert ids outside [0, E_local * ep_size), an output_dtype the runner cannot produce, a wrong `output`.
float32 only with `flashinfer._emulator.allow_float32` (no float32 runner on hardware: "Could not construct fused
moe op"). Not emulated (NotImplementedError): quantization (quant_scales, input_sf), biases, swiglu_alpha / beta /
limit, other activations, tp_size > 1, all-to-all, min-latency mode, cluster parallelism.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.nn.functional as F

from flashinfer import _emulator


class ActivationType(IntEnum):
    """flashinfer/tllm_enums.py ActivationType (copied from TensorRT-LLM's common.h)."""
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def cutlass_fused_moe(input: torch.Tensor, token_selected_experts: torch.Tensor, token_final_scales: torch.Tensor,
                      fc1_expert_weights: torch.Tensor, fc2_expert_weights: torch.Tensor, output_dtype: torch.dtype,
                      quant_scales=None, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None,
                      swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size: int = 1, tp_rank: int = 0,
                      ep_size: int = 1, ep_rank: int = 0, cluster_size: int = 1, cluster_rank: int = 0,
                      output: torch.Tensor | None = None, enable_alltoall: bool = False,
                      use_deepseek_fp8_block_scale: bool = False, use_w4_group_scaling: bool = False,
                      use_mxfp8_act_scaling: bool = False, min_latency_mode: bool = False,
                      use_packed_weights: bool = False, tune_max_num_tokens: int = 8192, enable_pdl=None,
                      activation_type: ActivationType = ActivationType.Swiglu, swizzled_input_sf: bool = True,
                      use_fused_finalize: bool = True, profile_ids=None,
                      workspace_buffer=None) -> list[torch.Tensor]:
    """The MoE layer's output [num_tokens, hidden_size] (this rank's experts only) as the first of four tensors,
    as core.py returns them outside min-latency mode: [output, num_active_experts_per_node,
    experts_to_token_score, active_expert_global_ids] (the last three only allocated there, and not written:
    filled with -1 here); see the module docstring."""
    if min_latency_mode:
        raise NotImplementedError("min latency mode not yet implemented for Blackwell.")
    unsupported = {"quant_scales": quant_scales, "fc1_expert_biases": fc1_expert_biases,
                   "fc2_expert_biases": fc2_expert_biases, "input_sf": input_sf, "swiglu_alpha": swiglu_alpha,
                   "swiglu_beta": swiglu_beta, "swiglu_limit": swiglu_limit, "profile_ids": profile_ids,
                   "workspace_buffer": workspace_buffer}
    given = [name for name, v in unsupported.items() if v is not None and not (name == "quant_scales" and v == [])]
    if given or use_deepseek_fp8_block_scale or use_w4_group_scaling or use_mxfp8_act_scaling or use_packed_weights:
        raise NotImplementedError(f"flashinfer emulator: quantized / biased cutlass_fused_moe ({', '.join(given)}) "
                                  "is not emulated")
    if activation_type != ActivationType.Swiglu:
        raise NotImplementedError(f"flashinfer emulator: activation_type {activation_type!r} is not emulated")
    if tp_size != 1 or cluster_size != 1 or enable_alltoall:
        raise NotImplementedError("flashinfer emulator: tp_size > 1, cluster parallelism and all-to-all are not "
                                  "emulated (pass this rank's weight slices with tp_size 1)")
    x, ids, scales, fc1, fc2 = input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights
    dtype = x.dtype
    allowed = _emulator.HALF_DTYPES + ((torch.float32,) if _emulator.allow_float32 else ())
    if dtype not in allowed or fc1.dtype != dtype or fc2.dtype != dtype:
        raise RuntimeError(f"Could not construct fused moe op with the requested input combination Activation: "
                           f"{dtype}, Weight: {fc1.dtype}, Output: {output_dtype}")
    if output_dtype != dtype:
        raise RuntimeError(f"Invalid output type {output_dtype} specified for {dtype} (unquantized runners write "
                           "their activation dtype)")
    _check(ids.dtype == torch.int32,
           f"token_selected_experts must be int32 (CHECK_INPUT_TYPE dl_int32), got {ids.dtype}")
    _check(scales is not None and scales.dtype == torch.float32,
           f"token_final_scales must be float32, got {None if scales is None else scales.dtype}")
    _check(x.dim() == 2 and ids.dim() == 2 and scales.dim() == 2, "input, token_selected_experts and "
           "token_final_scales must be 2-D (CHECK_DIM(2, ...))")
    _check(fc1.dim() == 3 and fc2.dim() == 3, "fc1_expert_weights and fc2_expert_weights must be 3-D")
    _check(x.shape[0] == ids.shape[0], "input and token_selected_experts must have the same num tokens.")
    _check(x.shape[0] == scales.shape[0], "input and token_selected_experts_probs must have the same num tokens.")
    _check(ids.shape[1] == scales.shape[1],
           "token_selected_experts and token_final_scales must have the same number of experts per token.")
    _check(fc1.shape[0] == fc2.shape[0], "fc1_expert_weights and fc2_expert_weights must have the same number of "
           "experts.")
    _check(fc1.shape[1] == fc2.shape[2] * 2, "fc1_expert_weights inter size must be 2 times fc2_expert_weights "
           "inter size.")
    experts_local, hidden, inter = fc2.shape
    _check(fc1.shape[2] == hidden and x.shape[1] == hidden,
           f"input [T, {x.shape[1]}] and fc1 [E, 2I, {fc1.shape[2]}] must have fc2's hidden size {hidden}")
    min_alignment = 128 // (8 * dtype.itemsize)
    _check(hidden % min_alignment == 0, f"hidden_size {hidden} must be divisible by {min_alignment} for weights")
    _check(inter % min_alignment == 0, f"inter_size {inter} must be divisible by {min_alignment} for weights")
    _check(ep_size >= 1 and 0 <= ep_rank < ep_size, f"ep_rank {ep_rank} must lie in [0, ep_size = {ep_size})")
    total = experts_local * ep_size
    if ids.numel():
        _check(0 <= int(ids.min()) and int(ids.max()) < total,
               f"token_selected_experts must lie in [0, num_experts_total = {total}), got "
               f"[{int(ids.min())}, {int(ids.max())}]")
    for t in (x, ids, scales, fc1, fc2):
        _check(t.device == x.device, "all tensors must be on the input's device")
    if output is None:
        output = torch.empty(x.shape[0], hidden, dtype=output_dtype, device=x.device)
    else:
        _check(tuple(output.shape) == (x.shape[0], hidden) and output.dtype == output_dtype
               and output.device == x.device, f"Invalid output: expected {(x.shape[0], hidden)} {output_dtype}, got "
               f"{tuple(output.shape)} {output.dtype}")
    _emulator.calls["cutlass_fused_moe"] += 1

    start = ep_rank * experts_local
    acc = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    local = ids.long() - start
    for e in range(experts_local):
        token, slot = torch.nonzero(local == e, as_tuple=True)
        if token.numel() == 0:
            continue
        up, gate = fc1[e].float().chunk(2, dim=0)
        xe = x[token].float()
        h = torch.cat((xe @ up.t(), xe @ gate.t()), dim=-1).to(dtype).float()   # GEMM1 writes its dtype
        act = (F.silu(h[:, inter:]) * h[:, :inter]).to(dtype).float()
        y = (act @ fc2[e].float().t()).to(dtype).float()
        acc.index_add_(0, token, y * scales[token, slot].unsqueeze(-1))
    output.copy_(acc.to(output_dtype))
    unwritten = [torch.full((1,), -1, dtype=torch.int32, device=x.device),
                 torch.full((experts_local, x.shape[0]), -1.0, dtype=torch.float32, device=x.device),
                 torch.full((experts_local,), -1, dtype=torch.int32, device=x.device)]
    return [output, *unwritten]


__all__ = ["ActivationType", "cutlass_fused_moe"]
