"""pdcluster: disaggregated prefill/decode LLM serving (docs/design.md).

The public API, vLLM-named. Importing it does not import torch: the engine loads torch when one is built.
"""

from pdcluster.engine import (
                              LLM,
                              AsyncEngineArgs,
                              AsyncLLMEngine,
                              CompletionOutput,
                              EngineArgs,
                              RequestOutput,
                              SamplingParams,
                              SharedWeightPool,
)
from pdcluster.engine.convert import convert_model

__all__ = ["LLM", "SamplingParams", "EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine", "RequestOutput",
           "CompletionOutput", "SharedWeightPool", "convert_model"]
