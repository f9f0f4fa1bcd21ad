"""Model execution shared by both node kinds: loading, paged KV cache, scheduler, sampler, LLM APIs.

The names re-exported here import without torch (torch loads when an engine is built), so the router
can import the root package. `LLMEngine` itself is `pdcluster.engine.llm_engine.LLMEngine`.
"""

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import AsyncEngineArgs, EngineArgs
from pdcluster.engine.async_engine import AsyncLLMEngine
from pdcluster.engine.llm import LLM
from pdcluster.engine.outputs import CompletionOutput, RequestOutput
from pdcluster.engine.weight_pool import SharedWeightPool

__all__ = ["LLM", "SamplingParams", "AsyncEngineArgs", "AsyncLLMEngine", "EngineArgs", "RequestOutput",
           "CompletionOutput", "SharedWeightPool"]
