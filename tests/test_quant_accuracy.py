"""Accuracy of the quantization schemes on the real default model (SmolLM2-135M-Instruct), against its bf16
conversion: teacher-forced next-token agreement along bf16's greedy answers to chat prompts and perplexity on a
fixed text, printed (docs/benchmarks.md). W8A16 round-to-nearest holds the issue's 0.95; W8A8 (per-token int8
activations) measured 0.89 round-to-nearest and 0.925-0.95 calibrated with SmoothQuant (convert's default strength:
0.950 with torch's elementwise ops, 0.925 with the fused CPU kernels, whose fp32 norm sums in another order and moves
per-token int8 rounding; 0.92-0.95 over strengths 0.4-0.8; 0.916 where the calibration's fp32 matmuls run in
engine/layers/strips_gemm.c, on CPUs with AVX2 and no AVX-512), so its floor is the low end of that band; W8A8 static
(per-tensor scales) and W4A16 are reported (floors against regressions only)."""

from __future__ import annotations

import math

import pytest
import torch

from pdcluster.engine.convert import convert_model, default_model_source
from pdcluster.engine.testing import prefill_logits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How do plants make food?",
             "Give me three tips for a good night's sleep.", "Explain what a CPU does.",
             "Write a short email asking a colleague for the weekly report.", "Why is the sky blue?",
             "List four animals that live in the ocean."]
# measured 0.969 / 0.885 / 0.664 / 0.925 / 0.838 (docs/benchmarks.md)
FLOOR = {"w8a16": 0.95, "w8a8": 0.87, "w4a16": 0.6, "w8a8_smoothquant": 0.91, "w8a8_static": 0.8}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books, which "
        "had been copied by hand for centuries, could now be produced in hundreds of identical copies, and the "
        "ideas they carried spread across Europe faster than ever before.")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    try:
        src = default_model_source()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("quant-real")
    out = {"bf16": convert_model(src, str(root / "bf16"), "bfloat16")}
    for scheme in ("w8a8", "w8a16", "w4a16", "w8a8_static"):
        out[scheme] = convert_model(src, str(root / scheme), "bfloat16", quantization=scheme)
    out["w8a8_smoothquant"] = convert_model(src, str(root / "w8a8-sq"), "bfloat16", quantization="w8a8",
                                            calibration="default")
    return out


def test_next_token_agreement_and_perplexity_against_bf16(checkpoints, make_engine):
    from pdcluster.control.sampling_params import SamplingParams

    base = make_engine(checkpoints["bf16"])
    tok = base.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    for i, p in enumerate(prompts):
        base.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=48))
    answers: dict[str, list[int]] = {}
    while base.has_unfinished_requests():
        for o in base.step():
            if o.finished:
                answers[o.request_id] = o.outputs[0].token_ids
    sequences = [p + answers[str(i)] for i, p in enumerate(prompts)]
    text_ids = tok.encode(TEXT)

    def figures(engine) -> tuple[list[list[int]], float]:
        picks = [prefill_logits(engine, s).argmax(dim=-1)[len(p) - 1:len(s) - 1].tolist()
                 for s, p in zip(sequences, prompts, strict=True)]
        logits = prefill_logits(engine, text_ids)[:-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(text_ids[1:]))
        return picks, math.exp(nll.item())

    want, base_ppl = figures(base)   # bf16's next tokens along its own answers (its greedy picks, teacher-forced)
    failures = []
    for scheme in FLOOR:
        got, ppl = figures(make_engine(checkpoints[scheme]))
        same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        agreement = same / sum(len(w) for w in want)
        print(f"{scheme}: next-token agreement with bf16 {agreement:.3f}, perplexity {ppl:.2f} (bf16 {base_ppl:.2f})")
        if agreement < FLOOR[scheme] or ppl > base_ppl * {"w4a16": 2.5, "w8a8_static": 1.25}.get(scheme, 1.15):
            failures.append((scheme, agreement, ppl))
    assert not failures, failures
