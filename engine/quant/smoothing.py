"""Calibrated W8A8: SmoothQuant (Xiao et al., 2023) and static activation scales, from a few prompts.

Per-token int8 activations lose the small channels of a layer's input to the few large ones (outlier channels).
SmoothQuant moves that range into the weights: a layer's input channel j is divided by s_j and the weight's column
j multiplied by it, s_j = max|X_j|^a / max|W_j|^(1-a) (a: `strength`, llm-compressor's smoothing_strength; convert's
default 0.6). The division is folded into whatever produces the input, so the float model is unchanged:

    q/k/v inputs       input_layernorm.weight / s            q/k/v_proj columns * s
    gate/up inputs     post_attention_layernorm.weight / s   gate/up_proj columns * s
    down_proj inputs   up_proj rows / s                      down_proj columns * s
    o_proj inputs      v_proj rows (and bias) / s            o_proj columns * s

o_proj's input channel (head h, dim d) comes from v_proj row (h // group, d): under GQA the heads sharing a KV head
share s (maxima over the group). `activation_maxima` runs the float model (this engine, fp32) over the prompts and
records max|x| per input channel of each of those four inputs per layer; `input_scale` gives the static per-tensor
scale of a smoothed input (max|x / s| / 127, the compressed-tensors static W8A8 scheme).

Measured on SmolLM2-135M (docs/benchmarks.md): W8A8 next-token agreement with bf16 0.89 round-to-nearest, 0.95
smoothed at strength 0.6 (0.92-0.95 over 0.4-0.8); perplexity 19.2 -> 18.2 (bf16 17.6).
"""

from __future__ import annotations

import json
import os
import re

import torch

INPUTS = ("qkv", "gate_up", "down", "o")   # the smoothed inputs of a decoder layer

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
    """Per decoder layer, max|x| per input channel of its q/k/v, gate/up, down_proj and o_proj inputs while the
    float model at `model_dir` (run in fp32, eagerly) prefills `prompts` (chat-formatted when the tokenizer has a
    template; each cut to `max_tokens_per_prompt`)."""
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=False))
    limit = min(max_tokens_per_prompt, engine.model_config.max_model_len - 1)
    try:
        layers = engine.runner.model.model.layers
        maxima: list[dict[str, torch.Tensor]] = [{} for _ in layers]

        def record(i: int, key: str, x: torch.Tensor) -> None:
            m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
            maxima[i][key] = torch.maximum(maxima[i][key], m) if key in maxima[i] else m

        def output_hook(i: int, key: str):
            return lambda _m, _inp, out: record(i, key, out[0] if isinstance(out, tuple) else out)

        def input_hook(i: int, key: str):
            return lambda _m, inp: record(i, key, inp[0])

        handles = []
        for i, layer in enumerate(layers):
            handles += [layer.input_layernorm.register_forward_hook(output_hook(i, "qkv")),
                        layer.post_attention_layernorm.register_forward_hook(output_hook(i, "gate_up")),
                        layer.self_attn.o_proj.register_forward_pre_hook(input_hook(i, "o")),
                        layer.mlp.down_proj.register_forward_pre_hook(input_hook(i, "down"))]
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
    if any(set(m) != set(INPUTS) for m in maxima):
        raise ValueError(f"{model_dir}: calibration saw no input of some decoder layer")
    return maxima


class Smoothing:
    """The smoothing factors of every layer's four inputs (`factors[i][input]`, per input channel; "v_rows": per
    v_proj output row) and the smoothed inputs' maxima; `apply` rewrites a checkpoint tensor by its name."""

    _NAME = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|"
                       r"mlp\.(?:gate|up|down)_proj)\.(weight|bias)$")

    def __init__(self, factors: list[dict[str, torch.Tensor]], maxima: list[dict[str, torch.Tensor]]) -> None:
        self.factors = factors
        self.maxima = maxima

    @classmethod
    def compute(cls, maxima: list[dict[str, torch.Tensor]], weight: dict[str, torch.Tensor], num_heads: int,
                num_kv_heads: int, strength: float) -> Smoothing:
        """`weight`: the float checkpoint's q/k/v/o/gate/up/down weights by name."""
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"smoothing strength {strength} is not in [0, 1]")

        def factor(x_max: torch.Tensor, w_max: torch.Tensor) -> torch.Tensor:
            s = x_max.clamp(min=1e-5).pow(strength) / w_max.clamp(min=1e-5).pow(1.0 - strength)
            return s.clamp(min=1e-5)

        def columns(*names: str) -> torch.Tensor:
            return torch.stack([weight[n].float().abs().amax(0) for n in names]).amax(0)

        factors = []
        for i, m in enumerate(maxima):
            p = f"model.layers.{i}"
            f = {"qkv": factor(m["qkv"], columns(*(f"{p}.self_attn.{x}_proj.weight" for x in "qkv"))),
                 "gate_up": factor(m["gate_up"], columns(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")),
                 "down": factor(m["down"], columns(f"{p}.mlp.down_proj.weight"))}
            group = num_heads // num_kv_heads
            x_o, w_o = m["o"].view(num_kv_heads, group, -1), columns(f"{p}.self_attn.o_proj.weight")
            v_rows = factor(x_o.amax(1), w_o.view(num_kv_heads, group, -1).amax(1))   # [kv heads, head_dim]
            f["v_rows"] = v_rows.reshape(-1)
            f["o"] = v_rows[:, None, :].expand(num_kv_heads, group, v_rows.shape[-1]).reshape(-1)
            factors.append(f)
        return cls(factors, maxima)

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (checkpoint name `name`) with the smoothing folded in, in float32; other tensors unchanged."""
        match = self._NAME.match(name)
        if match is None:
            return tensor
        f = self.factors[int(match.group(1))]
        module, role = match.group(2), match.group(3)
        t = tensor.float()
        if module == "input_layernorm":
            return t / f["qkv"]
        if module == "post_attention_layernorm":
            return t / f["gate_up"]
        if role == "bias":   # a linear layer's bias: only v_proj's output rows are rescaled
            return t / f["v_rows"] if module == "self_attn.v_proj" else t
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            return t * f["qkv"]
        if module == "self_attn.v_proj":
            return t * f["qkv"] / f["v_rows"][:, None]
        if module == "self_attn.o_proj":
            return t * f["o"]
        if module == "mlp.gate_proj":
            return t * f["gate_up"]
        if module == "mlp.up_proj":
            return t * f["gate_up"] / f["down"][:, None]
        return t * f["down"]   # mlp.down_proj

    def input_scale(self, module: str) -> torch.Tensor:
        """Static per-tensor int8 scale of linear module `module`'s smoothed input (max|x / s| / 127)."""
        match = re.match(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj$", module)
        if match is None:
            raise ValueError(f"calibration: {module} is not a smoothed linear layer")
        i, kind = int(match.group(1)), match.group(3)
        key = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}.get(kind, kind)
        return (self.maxima[i][key] / self.factors[i][key]).amax().clamp(min=1e-8) / 127.0


def smoothing_from(model_dir: str, prompts: list[str], num_heads: int, num_kv_heads: int,
                   strength: float) -> Smoothing:
    """Calibrate the float checkpoint at `model_dir` (its model.safetensors) over `prompts`."""
    from safetensors import safe_open

    maxima = activation_maxima(model_dir, prompts)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        weight = {n: f.get_tensor(n) for n in f.keys() if re.search(r"_proj\.weight$", n)}
    return Smoothing.compute(maxima, weight, num_heads, num_kv_heads, strength)
