"""Calibrated W8A8: SmoothQuant (Xiao et al., 2023) and static activation scales, from a few prompts.

Per-token int8 activations lose the small channels of a layer's input to the few large ones (outlier channels).
SmoothQuant moves that range into the weights: a layer's input channel j is divided by s_j and the weight's column
j multiplied by it, s_j = max|X_j|^a / max|W_j|^(1-a) (a: `strength`, llm-compressor's smoothing_strength; convert's
default 0.6; max|W_j| over every quantized layer reading that input). The division is folded into whatever produces
the input, so the float model is unchanged:

    q/k/v inputs       input_layernorm.weight / s            q/k/v_proj columns * s
    gate/up inputs     post_attention_layernorm.weight / s   gate/up_proj columns * s
    down_proj inputs   up_proj rows / s                      down_proj columns * s
    o_proj inputs      v_proj rows (and bias) / s            o_proj columns * s

o_proj's input channel (head h, dim d) comes from v_proj row (h // group, d): under GQA the heads sharing a KV head
share s (maxima over the group).

Mixture of experts (Qwen3-MoE, Mixtral, DeepSeek's MoE layers): the post-attention norm's output feeds the router,
every routed expert's gate/up and the shared experts' gate/up; its s (max|W| over all those experts' gate/up columns,
the router's left out: it stays float) is multiplied back into all of them, the router's columns included, so the
router's logits and the routing are unchanged. Each routed expert's down_proj input is its own: its maxima are
recorded per expert (recomputed in fp32 from the tokens the router sends it, `_expert_maxima`), its s folded into
that expert's up rows and down columns. An expert no calibration token reached keeps s = 1, and its static down
scale is the largest of its layer's calibrated experts. The shared experts' down input is smoothed like a dense one.

DeepSeek MLA, smoothed where the folding is exact:
    q_proj / q_a_proj and kv_a_proj_with_mqa   input_layernorm.weight / s (one s for both; RoPE acts on their
                                               outputs, the input's columns are free)
    q_b_proj                                   q_a_layernorm.weight / s (the norm's weight, not q_a_proj's rows:
                                               the RMS normalization in between is not linear)
    o_proj                                     kv_b_proj's value rows / s (per head h, value dim d: o_proj's input
                                               is attention-weighted sums of those rows' outputs, in the absorbed
                                               and expanded forms alike)
kv_b_proj's input (kv_a_layernorm's output) is not smoothed: the engine dequantizes kv_b_proj at load (the backend
multiplies by per-head slices) and never quantizes its input; it gets a static scale only so the checkpoint is
complete. kv_a_proj_with_mqa's rows are never touched (their k_pe part is roped, their latent part normalized).

`activation_maxima` runs the float model (this engine, fp32) over the prompts and records, per layer, max|x| per
input channel of those inputs; `input_scale` gives the static per-tensor scale of a smoothed input (max|x / s| /
127, the compressed-tensors static W8A8 scheme). Routed experts' gate/up share their layer's scale (the whole
input's maximum, as the shared experts see it), their down_proj inputs have one each.

Measured on SmolLM2-135M (docs/benchmarks.md): W8A8 next-token agreement with bf16 0.89 round-to-nearest, 0.95
smoothed at strength 0.6 (0.92-0.95 over 0.4-0.8); perplexity 19.2 -> 18.2 (bf16 17.6).
"""

from __future__ import annotations

import json
import os
import re

import torch

# Built in when no calibration file is given: chat questions, prose, code, numbers, lists and other languages.
CALIBRATION_PROMPTS = [
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left, right = merge_sort(items[:middle]), merge_sort(items[middle:])\n    return merge(left, right)\n",
    "Summarize the causes of the French Revolution in three sentences.",
    "The mitochondria is the powerhouse of the cell: it turns glucose and oxygen into ATP, the energy currency "
    "that muscles, neurons and every other cell spend to do their work.",
    "Convert 72 degrees Fahrenheit to Celsius and show the calculation: (72 - 32) * 5 / 9 = 22.2.",
    "List five tips for writing a clear email to a busy manager.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id "
    "GROUP BY name ORDER BY orders DESC LIMIT 10;",
    "Translate into French: The library opens at nine in the morning and closes at six in the evening.",
    "Quelle est la différence entre un virus et une bactérie ? Réponds simplement.",
    "Once upon a time, in a village at the edge of a dark forest, there lived a young girl who could talk to "
    "birds. One morning a crow landed on her window with a warning.",
    "What are the pros and cons of remote work for a small software company?",
    "Solve for x: 3x + 7 = 22. Then check the answer by substituting it back.",
    '{"user": {"id": 4127, "name": "Ada", "roles": ["admin", "editor"], "active": true}}',
    "Describe the water cycle to a ten-year-old.",
]


def read_prompts(path: str) -> list[str]:
    """Calibration prompts from a file: .jsonl (one JSON string, or an object with "text" or "prompt", per line)
    or plain text (prompts separated by blank lines)."""
    with open(path, encoding="utf-8") as f:
        content = f.read()
    if path.endswith(".jsonl"):
        prompts = []
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            text = item if isinstance(item, str) else item.get("text", item.get("prompt")) \
                if isinstance(item, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: expected a string or an object with \"text\" or \"prompt\"")
            prompts.append(text)
    else:
        prompts = [p.strip() for p in re.split(r"\n\s*\n", content)]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"{path}: no calibration prompts in it")
    return prompts


def activation_maxima(model_dir: str, prompts: list[str],
                      max_tokens_per_prompt: int = 512) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, max|x| per input channel of its smoothed inputs while the float model at `model_dir` (run
    in fp32, eagerly) prefills `prompts` (chat-formatted when the tokenizer has a template; each cut to
    `max_tokens_per_prompt`). Keys: "qkv" (input_layernorm's output), "o", "gate_up" (post_attention_layernorm's
    output); a dense MLP "down"; routed experts "experts_down" [E, I] and "experts_tokens" [E] (tokens routed to
    each), shared experts "shared_down"; MLA "q_b" (q_a_layernorm's output, with q LoRA) and "kv_b"
    (kv_a_layernorm's output)."""
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.layers.mla import MLAttention
    from pdcluster.engine.layers.moe import FusedMoE
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=False))
    limit = min(max_tokens_per_prompt, engine.model_config.max_model_len - 1)
    try:
        engine.runner.cut_last_layer = False   # every row's activations, the last layer's too (logit_rows_only)
        layers = engine.runner.model.model.layers
        maxima: list[dict[str, torch.Tensor]] = [{} for _ in layers]
        expected: list[set[str]] = [set() for _ in layers]

        def record(i: int, key: str, x: torch.Tensor) -> None:
            m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
            maxima[i][key] = torch.maximum(maxima[i][key], m) if key in maxima[i] else m

        def output_hook(i: int, key: str):
            return lambda _m, _inp, out: record(i, key, out[0] if isinstance(out, tuple) else out)

        def input_hook(i: int, key: str):
            return lambda _m, inp: record(i, key, inp[0])

        def experts_hook(i: int):
            def hook(moe, inp) -> None:
                hidden = inp[0].detach()
                m, counts = _expert_maxima(moe, hidden.reshape(-1, hidden.shape[-1]))
                seen = maxima[i]
                seen["experts_down"] = torch.maximum(seen["experts_down"], m) if "experts_down" in seen else m
                seen["experts_tokens"] = seen.get("experts_tokens", torch.zeros_like(counts)) + counts
            return hook

        handles = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            outputs = [(layer.input_layernorm, "qkv"), (layer.post_attention_layernorm, "gate_up")]
            inputs = [(attn.o_proj, "o")]
            if isinstance(attn, MLAttention):
                outputs.append((attn.kv_a_layernorm, "kv_b"))
                if attn.mla.q_lora_rank:
                    outputs.append((attn.q_a_layernorm, "q_b"))
            moe = mlp if isinstance(mlp, FusedMoE) else getattr(mlp, "experts", None)
            if isinstance(moe, FusedMoE):   # Qwen3-MoE / Mixtral: the layer's mlp; DeepSeek: DeepseekMoE.experts
                handles.append(moe.register_forward_pre_hook(experts_hook(i)))
                expected[i] |= {"experts_down", "experts_tokens"}
                shared = getattr(mlp, "shared_experts", None)
                if shared is not None:
                    inputs.append((shared.down_proj, "shared_down"))
            else:
                inputs.append((mlp.down_proj, "down"))
            handles += [m.register_forward_hook(output_hook(i, key)) for m, key in outputs]
            handles += [m.register_forward_pre_hook(input_hook(i, key)) for m, key in inputs]
            expected[i] |= {key for _, key in outputs + inputs}
        tok = engine.tokenizer
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for n, prompt in enumerate(prompts):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True) if tok.chat_template else prompt
            ids = tok.encode(text, add_special_tokens=not tok.chat_template)[:limit]
            engine.add_request(f"calibration-{n}", ids, params)
        while engine.has_unfinished_requests():
            engine.step()
        for h in handles:
            h.remove()
    finally:
        engine.shutdown()
    if any(set(m) != keys for m, keys in zip(maxima, expected, strict=True)):
        raise ValueError(f"{model_dir}: calibration saw no input of some decoder layer")
    return [{k: v.cpu() for k, v in m.items()} for m in maxima]   # beside the checkpoint's weights


def _expert_maxima(moe, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per local expert of FusedMoE `moe` over `hidden` [T, H] (the block's input): max|x| per channel of the
    expert's down_proj input, SiLU(gate) * up, recomputed here in fp32 for the tokens the router sends it, and how
    many tokens it got. ([E_local, I], [E_local]); an expert without tokens has maxima 0."""
    import torch.nn.functional as F

    from pdcluster.engine.layers.linear import linear
    from pdcluster.engine.layers.moe import kernel_for

    kernel = moe.kernel if moe.kernel is not None else kernel_for(hidden.device)
    logits = moe.gate(hidden.float() if moe.router_fp32 else hidden).float()
    _, ids = kernel.select(logits, moe.routing, moe.e_score_correction_bias)
    n = moe.local_intermediate
    maxima = torch.zeros(moe.num_local_experts, n, dtype=torch.float32, device=hidden.device)
    counts = torch.zeros(moe.num_local_experts, dtype=torch.int64, device=hidden.device)
    for e in range(moe.num_local_experts):
        rows = hidden[(ids == moe.expert_start + e).any(-1)]
        counts[e] = rows.shape[0]
        if not rows.shape[0]:
            continue
        if isinstance(moe.packed, tuple):   # the CUDA kernel's (w31, w2): up rows first
            from pdcluster.engine.layers.moe_cuda import w31

            gate_up = F.linear(rows, w31(moe.packed[0][e:e + 1])[0]).float()
        elif moe.packed is not None:   # the CPU kernel's per-expert oneDNN copies (the float stacks are released)
            gate_up = linear(rows, moe.w13, None, moe.packed[e][0]).float()
        else:
            gate_up = F.linear(rows, moe.w13[e]).float()
        maxima[e] = (F.silu(gate_up[:, :n]) * gate_up[:, n:]).abs().amax(0)
    return maxima, counts


class Smoothing:
    """The smoothing factors of every layer's inputs (`factors[i][input]`, per input channel, keys as
    `activation_maxima`'s; "experts_down" [E, I]), the recorded maxima, and what they do to the checkpoint: `plan`
    (tensor name -> (divisor of its rows, or of a 1-D norm weight / bias; multiplier of its columns)) and the static
    input scales by linear module (`scales`). `apply` rewrites a checkpoint tensor by its name."""

    def __init__(self, factors: list[dict[str, torch.Tensor]], maxima: list[dict[str, torch.Tensor]],
                 plan: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
                 scales: dict[str, torch.Tensor]) -> None:
        self.factors = factors
        self.maxima = maxima
        self.plan = plan
        self.scales = scales

    @classmethod
    def compute(cls, maxima: list[dict[str, torch.Tensor]], column_max: dict[str, torch.Tensor], num_heads: int,
                num_kv_heads: int, strength: float, out_features: dict[str, int] | None = None) -> Smoothing:
        """`column_max`: max|W| per input column of the float checkpoint's linear weights (and MoE routers) by
        tensor name; `out_features`: their row counts (MLA's kv_b_proj is read from it)."""
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"smoothing strength {strength} is not in [0, 1]")
        out_features = out_features or {}

        def factor(x_max: torch.Tensor, w_max: torch.Tensor) -> torch.Tensor:
            s = x_max.clamp(min=1e-5).pow(strength) / w_max.clamp(min=1e-5).pow(1.0 - strength)
            return s.clamp(min=1e-5)

        def columns_of(*modules: str) -> torch.Tensor:
            return torch.stack([column_max[f"{m}.weight"].float() for m in modules]).amax(0)

        plan: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        scales: dict[str, torch.Tensor] = {}

        def rows(name: str, f: torch.Tensor) -> None:
            plan[name] = (f, plan.get(name, (None, None))[1])

        def columns(module: str, f: torch.Tensor) -> None:
            name = f"{module}.weight"
            plan[name] = (plan.get(name, (None, None))[0], f)

        def scale(module: str, x_max: torch.Tensor, f: torch.Tensor | float = 1.0) -> None:
            scales[module] = (x_max / f).amax().clamp(min=1e-8) / 127.0

        def smooth(producer: str, key: str, consumers: list[str], m: dict[str, torch.Tensor],
                   f: torch.Tensor | None = None) -> torch.Tensor:
            """Input `key` of `consumers`, produced by `producer` (a norm's weight): divided there, multiplied
            into the consumers' columns; returns s."""
            f = factor(m[key], columns_of(*consumers)) if f is None else f
            rows(producer, f)
            for c in consumers:
                columns(c, f)
                scale(c, m[key], f)
            return f

        factors = []
        for i, m in enumerate(maxima):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            f: dict[str, torch.Tensor] = {}
            if f"{a}kv_a_proj_with_mqa.weight" in column_max:   # DeepSeek MLA
                q = [a + "q_a_proj"] if f"{a}q_a_proj.weight" in column_max else [a + "q_proj"]
                f["qkv"] = smooth(p + "input_layernorm.weight", "qkv", q + [a + "kv_a_proj_with_mqa"], m)
                if "q_b" in m:
                    f["q_b"] = smooth(a + "q_a_layernorm.weight", "q_b", [a + "q_b_proj"], m)
                scale(a + "kv_b_proj", m["kv_b"])
                f["o"] = factor(m["o"], columns_of(a + "o_proj"))
                v_dim = f["o"].numel() // num_heads
                kv_b_rows = torch.ones(num_heads, out_features[f"{a}kv_b_proj.weight"] // num_heads)
                kv_b_rows[:, -v_dim:] = f["o"].view(num_heads, v_dim)   # per head: nope key rows, then values
                rows(f"{a}kv_b_proj.weight", kv_b_rows.reshape(-1))
            else:
                f["qkv"] = smooth(p + "input_layernorm.weight", "qkv", [f"{a}{x}_proj" for x in "qkv"], m)
                group = num_heads // num_kv_heads
                x_o = m["o"].view(num_kv_heads, group, -1)
                w_o = columns_of(a + "o_proj").view(num_kv_heads, group, -1)
                v_rows = factor(x_o.amax(1), w_o.amax(1))   # [kv heads, head_dim]
                f["v_rows"] = v_rows.reshape(-1)
                f["o"] = v_rows[:, None, :].expand(num_kv_heads, group, v_rows.shape[-1]).reshape(-1)
                rows(f"{a}v_proj.weight", f["v_rows"])
                rows(f"{a}v_proj.bias", f["v_rows"])
            columns(a + "o_proj", f["o"])
            scale(a + "o_proj", m["o"], f["o"])

            norm = p + "post_attention_layernorm.weight"
            if "down" in m:   # a dense MLP
                f["gate_up"] = smooth(norm, "gate_up", [p + "mlp.gate_proj", p + "mlp.up_proj"], m)
                f["down"] = factor(m["down"], columns_of(p + "mlp.down_proj"))
                rows(p + "mlp.up_proj.weight", f["down"])
                columns(p + "mlp.down_proj", f["down"])
                scale(p + "mlp.down_proj", m["down"], f["down"])
            else:
                block = "block_sparse_moe" if f"{p}block_sparse_moe.gate.weight" in column_max else "mlp"
                names = ("w1", "w3", "w2") if f"{p}{block}.experts.0.w1.weight" in column_max else \
                    ("gate_proj", "up_proj", "down_proj")
                counts = m["experts_tokens"]
                experts = [[f"{p}{block}.experts.{e}.{n}" for n in names] for e in range(counts.numel())]
                shared = f"{p}{block}.shared_experts."
                has_shared = f"{shared}down_proj.weight" in column_max
                gate_up = [x for g, u, _ in experts for x in (g, u)] + \
                    ([shared + "gate_proj", shared + "up_proj"] if has_shared else [])
                f["gate_up"] = smooth(norm, "gate_up", gate_up, m)
                columns(f"{p}{block}.gate", f["gate_up"])   # the float router: its logits stay the same
                x_down = m["experts_down"]
                calibrated = counts > 0
                w_down = torch.stack([column_max[f"{d}.weight"].float() for _, _, d in experts])
                f["experts_down"] = torch.where(calibrated[:, None], factor(x_down, w_down), 1.0)
                down_scales = (x_down / f["experts_down"]).amax(1).clamp(min=1e-8) / 127.0
                fallback = down_scales[calibrated].max()   # every token reaches some expert of the layer
                for e, (_, u, d) in enumerate(experts):
                    rows(f"{u}.weight", f["experts_down"][e])
                    columns(d, f["experts_down"][e])
                    scales[d] = (down_scales[e] if bool(calibrated[e]) else fallback).clone()
                if has_shared:
                    f["shared_down"] = factor(m["shared_down"], columns_of(shared + "down_proj"))
                    rows(shared + "up_proj.weight", f["shared_down"])
                    columns(shared + "down_proj", f["shared_down"])
                    scale(shared + "down_proj", m["shared_down"], f["shared_down"])
            factors.append(f)
        return cls(factors, maxima, plan, scales)

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (checkpoint name `name`) with the smoothing folded in, in float32; other tensors unchanged."""
        entry = self.plan.get(name)
        if entry is None:
            return tensor
        rows, columns = entry
        t = tensor.float()
        if t.dim() == 1:   # a norm's weight or a bias
            return t / rows if rows is not None else t
        if columns is not None:
            t = t * columns
        return t / rows[:, None] if rows is not None else t

    def input_scale(self, module: str) -> torch.Tensor:
        """Static per-tensor int8 scale of linear module `module`'s smoothed input (max|x / s| / 127)."""
        scale = self.scales.get(module)
        if scale is None:
            raise ValueError(f"calibration: {module} is not a smoothed linear layer")
        return scale


# the tensors whose column maxima smoothing needs: linear weights, Mixtral's expert w1/w2/w3, MoE routers
_WEIGHTS = re.compile(r"(_proj(_with_mqa)?|\.experts\.\d+\.w[123]|\.gate)\.weight$")


def smoothing_from(model_dir: str, prompts: list[str], num_heads: int, num_kv_heads: int,
                   strength: float) -> Smoothing:
    """Calibrate the float checkpoint at `model_dir` (its model.safetensors) over `prompts`."""
    from safetensors import safe_open

    maxima = activation_maxima(model_dir, prompts)
    column_max, out_features = {}, {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for n in f.keys():
            if _WEIGHTS.search(n):
                w = f.get_tensor(n)
                column_max[n] = w.float().abs().amax(0)
                out_features[n] = w.shape[0]
    return Smoothing.compute(maxima, column_max, num_heads, num_kv_heads, strength, out_features)
