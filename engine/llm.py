"""Offline batch generation, vLLM-style: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from typing import Sequence as Seq
from typing import cast

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.lora.request import LoRARequest
from pdcluster.engine.outputs import RequestOutput
from pdcluster.engine.prompts import PromptType, is_single_prompt, resolve_prompt
from pdcluster.engine.stats import EngineStats


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        from pdcluster.engine.llm_engine import LLMEngine  # torch; importing this module stays torch-free

        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._shut_down = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Release the tensor-parallel ranks, their shared memory and the torch.distributed group (another
        engine may be built in this process after). Idempotent; the LLM is unusable after."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, `{"prompt": ...}` or `{"prompt_token_ids": [...]}`, as
        vLLM takes them; one or a list of them, mixed); results in prompt order. `lora_request`: the adapter of
        every prompt, or one per prompt (None: the base model); needs enable_lora."""
        if self._shut_down:
            raise RuntimeError("LLM: shut down")
        prompt_list = [cast(PromptType, prompts)] if is_single_prompt(prompts) else list(cast(Seq[PromptType], prompts))
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompt_list)
        if len(params) != len(prompt_list):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompt_list)} prompts")
        loras: list[LoRARequest | None] = [lora_request] * len(prompt_list) \
            if lora_request is None or isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompt_list)} prompts")
        for adapter in dict.fromkeys(x for x in loras if x is not None):   # every adapter checked before any runs
            self.engine.add_lora(adapter)
        resolved = [resolve_prompt(prompt, self.tokenizer) for prompt in prompt_list]   # all checked before any runs
        order: dict[str, int] = {}
        texts = [text for _, text in resolved]
        for i, ((ids, _), sp, lora) in enumerate(zip(resolved, params, loras, strict=True)):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, sp, lora=lora)
            order[rid] = i
        results: list[RequestOutput | None] = [None] * len(prompt_list)
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
