"""Mixture-of-experts layer: a replicated router (`gate`), the routed experts' SwiGLU weights stacked as
w13 [E_local, 2 * I_local, H] (gate rows first) and w2 [E_local, H, I_local], and a device kernel
(`MoEKernel`: moe_cpu.py, moe_npu.py, moe_cuda.py) that routes the tokens and runs the experts.

A quantized checkpoint hands each expert's gate / up / down as `QuantizedWeight`s (`load_expert`); `prepack` packs
them per expert (gate and up merged) for the CPU kernel's quantized matmuls (engine/quant/kernels.py), or, on
devices whose MoE kernel takes only dense stacks (NPU, CUDA so far), dequantizes them into w13 / w2 once.

Tensor parallelism without expert parallelism slices every expert like GatedMLP (I_local = I / tp); with it
(`expert_parallel`) a rank holds E / tp whole experts. Either way each rank computes its part for every token and
one all-reduce sums the parts, as RowParallelLinear does. Shared experts (DeepSeek, Qwen2-MoE) are a GatedMLP the
model adds itself. Under torch.compile (engine/compiled.py) the routing and experts run as one opaque op,
`pdcluster::fused_moe`: grouping tokens by expert has data-dependent shapes the compiler cannot trace."""

from __future__ import annotations

import itertools
import re
import weakref
from typing import Protocol

import torch
from torch import nn

from pdcluster.device import is_npu
from pdcluster.engine.layers.linear import Linear, release
from pdcluster.engine.layers.moe_routing import RoutingConfig
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.quant.scheme import QuantizedWeight, merge_rows

# Checkpoint names of routed experts. Hub checkpoints hold one tensor per expert and projection (Qwen-MoE and
# DeepSeek gate_proj / up_proj / down_proj; Mixtral w1 / w3 / w2); transformers 5 models hold them fused,
# experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj [E, H, I], a layout some conversions save.
_PER_EXPERT = re.compile(r"^(?P<moe>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.weight$")
_FUSED_EXPERTS = re.compile(r"^(?P<moe>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_SHARD = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class MoEKernel(Protocol):
    def select(self, router_logits: torch.Tensor, cfg: RoutingConfig,
               correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] fp32 -> (weights [T, k] fp32, global expert ids [T, k] int32)."""
        ...

    def experts(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, expert_start: int, num_experts: int) -> torch.Tensor:
        """hidden [T, H] -> [T, H]: sum over each token's experts in [expert_start, expert_start + E_local) of
        weight * down(SiLU(gate) * up); tokens routed elsewhere contribute nothing."""
        ...


def kernel_for(device: torch.device) -> MoEKernel:
    if is_npu(device):
        from pdcluster.engine.layers.moe_npu import NpuMoEKernel

        return NpuMoEKernel()
    if device.type == "cuda":
        from pdcluster.engine.layers.moe_cuda import CudaMoEKernel

        return CudaMoEKernel()
    from pdcluster.engine.layers.moe_cpu import CpuMoEKernel

    return CpuMoEKernel()


_layers: "weakref.WeakValueDictionary[int, FusedMoE]" = weakref.WeakValueDictionary()
_keys = itertools.count()


@torch.library.custom_op("pdcluster::fused_moe", mutates_args=())
def fused_moe(hidden: torch.Tensor, layer_key: int) -> torch.Tensor:
    """FusedMoE `layer_key`'s routed experts over `hidden`, run eagerly inside a compiled body."""
    return _layers[layer_key].routed(hidden)


@fused_moe.register_fake
def _(hidden: torch.Tensor, layer_key: int) -> torch.Tensor:
    return torch.empty_like(hidden)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 tp: TPGroup | None = None, expert_parallel: bool = False, correction_bias: bool = False,
                 router_fp32: bool = False) -> None:
        """`router_fp32`: the router weight and its input in float32 whatever the model dtype (DeepSeek, as
        transformers keeps `gate.weight` there), so a bf16 model picks the experts an fp32 router picks."""
        super().__init__()
        tp = tp or TPGroup()
        if routing.num_experts != num_experts:
            raise ValueError(f"routing is for {routing.num_experts} experts, the layer has {num_experts}")
        if expert_parallel and num_experts % tp.size:
            raise ValueError(f"expert parallelism: {num_experts} experts do not split over {tp.size} ranks")
        if not expert_parallel and intermediate_size % tp.size:
            raise ValueError(f"tensor parallelism: moe_intermediate_size {intermediate_size} does not split over "
                             f"{tp.size} ranks")
        self.tp = tp
        self.routing = routing
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size   # per expert, whole
        self.expert_parallel = expert_parallel
        self.num_local_experts = num_experts // tp.size if expert_parallel else num_experts
        self.expert_start = tp.rank * self.num_local_experts if expert_parallel else 0
        self.local_intermediate = intermediate_size if expert_parallel else intermediate_size // tp.size
        self.gate = Linear(hidden_size, num_experts)   # the router, replicated on every rank
        self.router_fp32 = router_fp32
        if router_fp32:
            self.gate.float()
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.local_intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.local_intermediate))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32)) \
            if correction_bias else None   # fp32 in the checkpoints: it decides near-ties between experts
        self.expert_counts = torch.zeros(num_experts, dtype=torch.int64)   # tokens per expert, last forward
        self.kernel: MoEKernel | None = None
        self.packed: object | None = None   # the kernel's packed copy of w13 / w2 (prepack), if it has one
        self.quantized: dict[tuple[int, str], QuantizedWeight] = {}   # (local expert, shard) until prepack
        self.layer_key = next(_keys)   # this layer, for the compiled body's opaque op
        _layers[self.layer_key] = self

    def owns(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts

    def load_expert(self, param_name: str, expert_id: int, shard: str,
                    tensor: torch.Tensor | QuantizedWeight) -> bool:
        """Place one checkpoint tensor of global expert `expert_id`: shard "gate" / "up" ([I, H]) or "down"
        ([H, I]), whole or already cut to this rank's slice (a quantized one: cut by the loader). False (nothing
        copied) for another rank's expert."""
        if not self.owns(expert_id):
            return False
        local = expert_id - self.expert_start
        n = self.local_intermediate
        if isinstance(tensor, QuantizedWeight):
            want = (self.hidden_size, n) if shard == "down" else (n, self.hidden_size)
            if shard not in ("gate", "up", "down") or tuple(tensor.qweight.shape) != want:
                raise ValueError(f"checkpoint tensor {param_name!r} ({shard}) is quantized with shape "
                                 f"{tuple(tensor.qweight.shape)}, expected {want}")
            self.quantized[(local, shard)] = tensor
            return True
        cut_dim = 1 if shard == "down" else 0
        if tensor.shape[cut_dim] == self.intermediate_size and n != self.intermediate_size:
            tensor = tensor.narrow(cut_dim, self.tp.rank * n, n)   # a whole tensor: this rank's slice of it
        if shard == "down":
            target = self.w2.data[local]
        elif shard in ("gate", "up"):
            target = self.w13.data[local, :n] if shard == "gate" else self.w13.data[local, n:]
        else:
            raise ValueError(f"{param_name}: unknown expert shard {shard!r}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {param_name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(tensor)
        return True

    def prepack(self) -> None:
        """The loader calls it once the weights are final (and `gate.prepack` on its own)."""
        self.kernel = kernel_for(self.w13.device)
        if self.quantized:
            from pdcluster.engine.layers.moe_cpu import CpuMoEKernel

            experts = self._quantized_experts()
            if isinstance(self.kernel, CpuMoEKernel):
                from pdcluster.engine.quant.kernels import pack

                dtype = self.w13.dtype
                self.packed = [(pack(w13, w13.scheme, self.w13.device, dtype),   # type: ignore[arg-type]
                                pack(w2, w2.scheme, self.w13.device, dtype))    # type: ignore[arg-type]
                               for w13, w2 in experts]
                release(self.w13)
                release(self.w2)
                return
            for e, (w13, w2) in enumerate(experts):   # dense kernels only: dequantized once, here
                self.w13.data[e].copy_(w13.dequantize(self.w13.dtype))
                self.w2.data[e].copy_(w2.dequantize(self.w2.dtype))
        prepack = getattr(self.kernel, "prepack", None)
        if prepack is not None:
            self.packed = prepack(self.w13, self.w2)
        if self.packed is not None:   # the packed copies are the only ones kept, as GatedMLP does
            release(self.w13)
            release(self.w2)

    def _quantized_experts(self) -> list[tuple[QuantizedWeight, QuantizedWeight]]:
        """Per local expert its quantized gate and up rows merged (one matmul, as w13) and its down weight."""
        out = []
        for e in range(self.num_local_experts):
            missing = [s for s in ("gate", "up", "down") if (e, s) not in self.quantized]
            if missing:
                raise ValueError(f"quantized checkpoint: expert {self.expert_start + e} of an MoE layer lacks "
                                 f"quantized {missing} (every routed expert must be quantized alike)")
            gate, up, down = (self.quantized[(e, s)] for s in ("gate", "up", "down"))
            out.append((merge_rows([gate, up]), down))
        self.quantized = {}
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = torch.ops.pdcluster.fused_moe(hidden, self.layer_key)
        else:
            out = self.routed(hidden)
        return self.tp.all_reduce(out)

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output: route, then run its experts (before the all-reduce)."""
        if self.kernel is None:
            self.kernel = kernel_for(hidden.device)
        router_logits = self.gate(hidden.float() if self.router_fp32 else hidden).float()
        weights, ids = self.kernel.select(router_logits, self.routing, self.e_score_correction_bias)
        flat = ids.flatten().long()   # counted with index_add_: bincount would sync the device (its output size)
        self.expert_counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat))
        if self.packed is not None:
            return self.kernel.experts(hidden, self.w13, self.w2, weights, ids, self.expert_start,  # type: ignore
                                       self.num_experts, packed=self.packed)
        return self.kernel.experts(hidden, self.w13, self.w2, weights, ids, self.expert_start, self.num_experts)


def load_moe_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> list[str] | None:
    """Place a routed-expert checkpoint tensor into the FusedMoE it belongs to; the names of the parameters it
    filled (for the loader's missing-tensor check), or None when `name` is no routed expert's tensor."""
    match = _PER_EXPERT.match(name) or _FUSED_EXPERTS.match(name)
    if match is None:
        return None
    moe = model.get_submodule(match["moe"])
    if not isinstance(moe, FusedMoE):
        return None   # e.g. a shared expert's GatedMLP
    proj = match["proj"]
    if "expert" in match.groupdict():
        moe.load_expert(name, int(match["expert"]), _SHARD[proj], tensor)
        return _filled(match["moe"], proj)
    # fused [E, ...], or only this expert-parallel rank's experts [E_local, ...] (engine/tp_shards.py cut it)
    first = moe.expert_start if tensor.shape[0] != moe.num_experts else 0
    if proj == "gate_up_proj":
        n = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            moe.load_expert(name, first + e, "gate", tensor[e, :n])
            moe.load_expert(name, first + e, "up", tensor[e, n:])
    else:
        for e in range(tensor.shape[0]):
            moe.load_expert(name, first + e, "down", tensor[e])
    return _filled(match["moe"], proj)


def _filled(prefix: str, proj: str) -> list[str]:
    return [f"{prefix}.w2"] if _SHARD.get(proj) == "down" or proj == "down_proj" else [f"{prefix}.w13"]
