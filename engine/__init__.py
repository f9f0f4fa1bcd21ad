"""Model execution shared by both node kinds: loading, paged KV cache, scheduler, sampler, LLM APIs.

Heavy imports are lazy so `import engine.sampling_params` (the router) does not pull in torch models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "AsyncEngineArgs", "AsyncLLMEngine", "EngineArgs", "LLMEngine",
           "RequestOutput", "CompletionOutput"]

_WHERE = {
    "LLM": "engine.llm", "SamplingParams": "engine.sampling_params", "AsyncEngineArgs": "engine.async_engine",
    "AsyncLLMEngine": "engine.async_engine", "EngineArgs": "engine.config", "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs", "CompletionOutput": "engine.outputs",
}

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
    from engine.config import EngineArgs
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
