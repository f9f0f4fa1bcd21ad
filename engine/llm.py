"""Offline batch generation, vLLM-style: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from typing import Sequence as Seq

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.outputs import RequestOutput
from pdcluster.engine.stats import EngineStats


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        from pdcluster.engine.llm_engine import LLMEngine  # torch; importing this module stays torch-free

        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        order: dict[str, int] = {}
        texts: list[str | None] = []
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
                texts.append(prompt)
            else:
                ids = list(prompt)
                texts.append(None)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, sp)
            order[rid] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        i = order[out.request_id]
                        out.prompt = texts[i]
                        out.outputs[0].text = self.tokenizer.decode(
                            out.outputs[0].token_ids, skip_special_tokens=params[i].skip_special_tokens)
                        results[i] = out
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return results  # type: ignore[return-value]
