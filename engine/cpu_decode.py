"""A decode step of a dense Llama-family model on CPU as a flat list of native kernel calls.

The eager forward spends ~8 ms of a ~30 ms SmolLM2 fp32 step at batch 1 outside the kernels (module calls, each
op's checks, a new tensor per op; docs/benchmarks.md "Decode step plan (#27)"). For steps where every row decodes
one token, `DecodePlan` runs the same kernels in the same order on the same values — strips_gemm.c (or the layer's
packed matmul), fused_ops.c's add + RMSNorm / rotary / SiLU x up, paged_decode.c, torch's `index_copy_` for the KV
write, Qwen3's per-head q/k norms through their modules — with every check done once when the plan is built and the
step's activations in a few buffers reused by every layer. The result is bitwise the eager forward's
(tests/test_cpu_decode.py). Models or steps it does not cover (prefill chunks, MoE, MLA, LoRA, quantized or
tensor-parallel layers, int8 KV, a norm bias, EAGLE's captured layers, a per-layer callback) take the eager forward.
`PDCLUSTER_DECODE_PLAN=0` in the environment when the model loads keeps the eager forward (for A/B runs)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import native
from pdcluster.engine.attention.cpu_backend import CpuAttentionBackend
from pdcluster.engine.attention.torch_backend import TorchAttentionMetadata
from pdcluster.engine.layers.linear import Linear, packed_matmul


def enabled() -> bool:
    return os.environ.get("PDCLUSTER_DECODE_PLAN", "1") != "0"


class Matmul:
    """x @ W.T (+ bias) of one linear (or one half of a GatedMLP's gate_up): strips_gemm.c called directly, with
    its weight arguments fixed, into the caller's buffer; any other packed weight through `packed_matmul`."""
    __slots__ = ("packed", "bias", "n", "k", "strips", "args")
    args: tuple[int, int, int, int | None]

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed, self.bias = packed, bias
        self.n, self.k = packed.shape
        self.strips = bool(getattr(packed, "strips", False))
        self.args = (0, 0, 0, None)   # (oneDNN's packed weight is an opaque tensor: no data pointer)
        if self.strips:
            self.args = (packed.data_ptr(), native._FLOAT_KINDS[packed.dtype], self.n,
                         None if bias is None else bias.data_ptr())

    def __call__(self, fn, x: torch.Tensor, out: torch.Tensor, threads: int) -> torch.Tensor:
        if not self.strips:
            return packed_matmul(x, self.packed, self.bias)
        xf = x if x.dtype == torch.float32 else x.float()
        w, wkind, n, bias = self.args
        m = x.shape[0]
        fn(xf.data_ptr(), xf.stride(0) if m > 1 else self.k, m, self.k, w, wkind, n, bias, out.data_ptr(),
           native._FLOAT_KINDS[out.dtype], threads, 0)
        return out


class PlanLayer:
    __slots__ = ("attn", "input_norm", "post_norm", "qkv", "o", "gate", "up", "down", "window", "flat")

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.input_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv = Matmul(attn.qkv_proj.packed, attn.qkv_proj.bias)
        self.o = Matmul(attn.o_proj.packed, attn.o_proj.bias)
        n, b = mlp.intermediate_size, mlp.gate_up_proj.bias
        self.gate = Matmul(mlp.packed_halves[0], None if b is None else b[:n])
        self.up = Matmul(mlp.packed_halves[1], None if b is None else b[n:])
        self.down = Matmul(mlp.down_proj.packed, mlp.down_proj.bias)
        self.window = attn.window
        self.flat: tuple = (None, None, None, None)   # see `caches`

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's caches (bound by the model runner, rebound with a new pool), and the same as the rows
        [slots, Hkv, D] the KV write indexes."""
        k, v = self.attn.k_cache, self.attn.v_cache
        assert k is not None and v is not None
        if self.flat[0] is not k or self.flat[1] is not v:
            self.flat = (k, v, k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]))
        return self.flat


class DecodePlan:
    def __init__(self, model, backend: CpuAttentionBackend) -> None:
        inner = model.model
        lib = native.load()
        assert lib is not None
        self.lib = lib
        self.embed, self.rotary, self.final_norm = inner.embed_tokens.weight, inner.rotary, inner.norm.weight
        self.layers = [PlanLayer(layer) for layer in inner.layers]
        first = inner.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.eps = inner.norm.eps
        self.scale = backend.scale
        self.dtype = self.embed.dtype
        self.kind = native._FLOAT_KINDS[self.dtype]
        self.attention = native.decode_kernel(self.dtype)

    @classmethod
    def build(cls, model, backend) -> DecodePlan | None:
        """The plan for `model` (prepacked, on CPU), or None where it does not apply (the eager forward runs)."""
        if not enabled() or not isinstance(backend, CpuAttentionBackend) or not native.FUSED_OPS:
            return None
        from pdcluster.engine.layers.attention import SelfAttention
        from pdcluster.engine.layers.mlp import GatedMLP
        from pdcluster.engine.models.llama import DecoderLayer, LlamaModel

        inner = getattr(model, "model", None)
        if type(inner) is not LlamaModel or inner.capture_layers or inner.embed_tokens.tp.size != 1:
            return None
        dtype = inner.embed_tokens.weight.dtype
        if inner.embed_tokens.weight.device.type != "cpu" or dtype not in native._FLOAT_KINDS \
                or native.decode_kernel(dtype) is None or native._fused("rms_norm", False, inner.norm.weight) is None \
                or inner.rotary.cos.dtype != dtype:
            return None
        norms = [inner.norm]
        for layer in inner.layers:
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not SelfAttention \
                    or type(layer.mlp) is not GatedMLP or layer.mlp.packed_halves is None:
                return None
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
            if any(not _plain(lin, dtype) for lin in linears) or layer.self_attn.o_proj.tp.size != 1 \
                    or any(p.dtype != dtype for p in layer.mlp.packed_halves):
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            if any(n is not None and n.bias is not None for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)):
                return None
        if any(n.bias is not None or n.weight.dtype != dtype or n.eps != inner.norm.eps for n in norms):
            return None
        return cls(model, backend)

    def covers(self, meta: TorchAttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is one the plan runs: every row decodes, into a float cache of the model's dtype."""
        if meta.prefills or meta.num_decode_tokens != num_tokens or meta.decode_block_tables is None \
                or meta.decode_context_lens is None:
            return False
        k = self.layers[0].attn.k_cache
        return k is not None and k.dtype == self.dtype

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        """The final hidden states [B, hidden] of a step that `covers` says the plan runs."""
        lib, kind, eps, threads = self.lib, self.kind, self.eps, torch.get_num_threads()
        rms, silu, rotary, gemm = lib.rms_norm, lib.silu_and_mul, lib.rotary, lib.strips_gemm
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        b, hidden, first = ids.shape[0], self.embed.shape[1], self.layers[0]
        qkv_width, inter = first.qkv.n, first.gate.n

        def buffer(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=self.dtype)

        normed, qkv, qk, att, o, gate, up, act, down = (
            buffer(b, hidden), buffer(b, qkv_width), buffer(b, hq + hkv, d), buffer(b, hq, d), buffer(b, hidden),
            buffer(b, inter), buffer(b, inter), buffer(b, inter), buffer(b, hidden))
        sums = (buffer(b, hidden), buffer(b, hidden))   # the residual stream, written alternately
        cos, sin = self.rotary.lookup(positions)
        slots = meta.slot_index
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None   # (`covers`)
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.to(torch.int32).contiguous()
        lens = lens.to(torch.int32).contiguous()
        q_size, kv_size = hq * d, hkv * d

        def norm(x: torch.Tensor, residual: torch.Tensor | None, s: torch.Tensor | None, w: torch.Tensor,
                 y: torch.Tensor) -> None:
            rms(x.data_ptr(), None if residual is None else residual.data_ptr(), None if s is None else s.data_ptr(),
                w.data_ptr(), y.data_ptr(), b, hidden, eps, kind, threads, 0)

        residual = F.embedding(ids, self.embed)
        norm(residual, None, None, first.input_norm, normed)
        turn = 0
        h = down
        for i, layer in enumerate(self.layers):
            if i:
                norm(h, residual, sums[turn], layer.input_norm, normed)
                residual, turn = sums[turn], turn ^ 1
            x = layer.qkv(gemm, normed, qkv, threads)
            heads = x
            if layer.attn.q_norm is not None:   # Qwen3: the module's own norms (torch's ops: the heads are strided)
                split = x[:, :q_size + kv_size].view(b, hq + hkv, d)
                heads = torch.cat((layer.attn.q_norm(split[:, :hq]), layer.attn.k_norm(split[:, hq:])), dim=1)
            rotary(heads.data_ptr(), heads.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), qk.data_ptr(), b,
                   hq + hkv, d, kind, threads, 0)
            k_cache, v_cache, k_flat, v_flat = layer.caches()
            k_flat.index_copy_(0, slots, qk[:, hq:])
            v_flat.index_copy_(0, slots, x[:, q_size + kv_size:].view(b, hkv, d))
            if self.attention(qk.data_ptr(), qk.stride(0), att.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              tables.data_ptr(), tables.stride(0), lens.data_ptr(), b,
                              hq, hkv, d, k_cache.shape[1], k_cache.stride(0), self.scale, layer.window, threads):
                raise MemoryError("paged_decode: could not allocate per-thread work buffers")
            y = layer.o(gemm, att.view(b, q_size), o, threads)
            norm(y, residual, sums[turn], layer.post_norm, normed)
            residual, turn = sums[turn], turn ^ 1
            g = layer.gate(gemm, normed, gate, threads)
            u = layer.up(gemm, normed, up, threads)
            silu(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), act.data_ptr(), b, inter, kind, threads, 0)
            h = layer.down(gemm, act, down, threads)
        out = buffer(b, hidden)
        norm(h, residual, sums[turn], self.final_norm, out)
        return out


def _plain(linear: Linear, dtype: torch.dtype) -> bool:
    """A float CPU linear with a packed weight and nothing added to its output (no quantization, no LoRA)."""
    packed = linear.packed if linear.packable else True
    bias = linear.bias
    return packed is not None and linear.quant is None and linear.lora is None and (
        bias is None or (bias.dtype == dtype and bias.is_contiguous()))
