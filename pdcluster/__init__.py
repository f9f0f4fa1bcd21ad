"""pdcluster: disaggregated prefill/decode LLM serving (docs/design.md).

The public API, vLLM-named, resolved on first use: `import pdcluster` imports no engine module (and no torch),
`from pdcluster import LLM` imports the engine's `LLM` module then. The router and the control plane never
import this package's names.
"""

from typing import TYPE_CHECKING

from pdcluster.control.lazy import lazy_exports

# The engine package knows which of its modules defines each of these (engine/__init__.py).
_FROM_ENGINE = ("LLM", "SamplingParams", "EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine", "RequestOutput",
                "CompletionOutput", "SharedWeightPool", "LoRARequest")
_EXPORTS = {**dict.fromkeys(_FROM_ENGINE, "pdcluster.engine"), "convert_model": "pdcluster.engine.convert"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:   # what type checkers and IDEs see (tests/test_imports.py checks they match)
    from pdcluster.control.sampling_params import SamplingParams as SamplingParams
    from pdcluster.engine.args import AsyncEngineArgs as AsyncEngineArgs
    from pdcluster.engine.args import EngineArgs as EngineArgs
    from pdcluster.engine.async_engine import AsyncLLMEngine as AsyncLLMEngine
    from pdcluster.engine.convert import convert_model as convert_model
    from pdcluster.engine.llm import LLM as LLM
    from pdcluster.engine.lora.request import LoRARequest as LoRARequest
    from pdcluster.engine.outputs import CompletionOutput as CompletionOutput
    from pdcluster.engine.outputs import RequestOutput as RequestOutput
    from pdcluster.engine.weight_pool import SharedWeightPool as SharedWeightPool
