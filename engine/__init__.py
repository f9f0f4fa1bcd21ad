"""Model execution shared by both node kinds: loading, paged KV cache, scheduler, sampler, LLM APIs.

The names re-exported here are resolved on first use (`pdcluster.control.lazy`): importing a module of the
engine (`pdcluster.engine.args`, say) does not import the rest of it. `LLMEngine` itself is
`pdcluster.engine.llm_engine.LLMEngine`.
"""

from pdcluster.control.lazy import lazy_exports

_EXPORTS = {
    "LLM": "pdcluster.engine.llm",
    "SamplingParams": "pdcluster.control.sampling_params",
    "AsyncEngineArgs": "pdcluster.engine.args",
    "AsyncLLMEngine": "pdcluster.engine.async_engine",
    "EngineArgs": "pdcluster.engine.args",
    "RequestOutput": "pdcluster.engine.outputs",
    "CompletionOutput": "pdcluster.engine.outputs",
    "SharedWeightPool": "pdcluster.engine.weight_pool",
    "LoRARequest": "pdcluster.engine.lora.request",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

