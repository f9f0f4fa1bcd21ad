"""The model body under `torch.compile` (EngineArgs.enforce_eager=False), with what inductor cannot trace as
opaque custom ops.

Inductor fuses what sits between the GEMMs (residual adds, RMSNorm, RoPE, SiLU x up) and runs the body without
per-module Python. Two ops stay opaque:
- `pdcluster::paged_attention(q, k, v, layer)`: the attention backend's KV write and attention. It reads the
  step's metadata (Python lists, per-step tensors) and the layer's KV cache views from a thread-local step
  context that the runner sets around the call (`step_context`), as vLLM's forward context does; so the graph's
  only inputs are token ids and positions (one dynamic dimension, the step's token count) and the weights, and
  nothing guards on the batch's composition.
- `pdcluster::packed_linear`: the GEMM over a oneDNN-packed weight (engine/layers/linear.py), which inductor
  cannot lower unless it packed the weight itself. Inductor's own packing (freezing + `cpp.weight_prepack`)
  was measured too (docs/benchmarks.md, "Engine speed (#13)"): a little faster in bf16, slower in fp32 at one
  row (MKL instead of oneDNN), and it keeps a second copy of every weight; so the engine's packed weights stay.

Compiled artifacts go to a disk cache (`compile_cache_dir`): a process with the same model shapes skips
inductor's code generation (dynamo still traces). Tensor parallelism stays eager (its all-reduce is Python).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import types
from typing import Callable, Iterator

import torch

_local = threading.local()
# Read at import: importing torch._inductor sets the variable to its own default (a temp dir).
_USER_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


@contextlib.contextmanager
def step_context(layers: list, meta) -> Iterator[None]:
    """While the compiled body runs: `layers` (the model's SelfAttention modules, by index) and the step's
    backend metadata, for `paged_attention`."""
    previous = getattr(_local, "step", None)
    _local.step = (layers, meta)
    try:
        yield
    finally:
        _local.step = previous


@torch.library.custom_op("pdcluster::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Writes k, v into layer `layer`'s KV cache and attends q over it; [T, Hq, D]. The KV pool is not an
    argument (it is written in place, behind the compiler's back): it is the layer's, from `step_context`."""
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError("pdcluster::paged_attention runs only inside step_context (the model runner's step)")
    layers, meta = step
    attn = layers[layer]
    return attn.backend.forward(q, k, v, attn.k_cache, attn.v_cache, meta, attn.window)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("pdcluster::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) through a oneDNN-packed weight (engine/layers/linear.py `cpu_packed`): inductor cannot
    lower `mkldnn._linear_pointwise` over a weight it did not pack itself, so the compiled body calls it opaquely,
    and the eager dispatch with it (the native bf16 GEMV for decode rows)."""
    from pdcluster.engine.layers.linear import packed_matmul

    return packed_matmul(x, packed, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def compile_cache_dir() -> str:
    """Inductor's on-disk caches (FX graph and AOT autograd): PDCLUSTER_CACHE_DIR/compile, by default
    ~/.cache/pdcluster/compile (next to the native decode kernel); TORCHINDUCTOR_CACHE_DIR wins if set."""
    from pdcluster.engine.attention.native import cache_dir

    return _USER_CACHE_DIR or str(cache_dir() / "compile")


def configure() -> None:
    """Process-wide inductor settings for the engine's compiled body (idempotent)."""
    import torch._inductor.config as inductor

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
    inductor.fx_graph_cache = True


_bodies = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own: dynamo keeps its compiled graphs per code object."""
    code = fn.__code__.replace(co_name=f"compiled_body_{next(_bodies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledBody:
    """`body(ids, positions)` compiled once per engine with a dynamic token dimension; `__call__` runs it
    with the step's metadata in the step context. Dynamo specialises T == 1 (batch-1 decode) and
    compiles every other T with one graph: two compilations per engine (`compiles` counts them)."""

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layers: list) -> None:
        configure()
        self.layers = layers
        self.compiles = 0

        def counted(gm, example_inputs):
            self.compiles += 1
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)

        # Guards on the model's modules and weights cost ~1 ms per call (hundreds of tensors); they never change,
        # and each engine gets its own code object (its own dynamo cache), so no other model can hit these graphs.
        self._fn = torch.compile(_own_code(body), backend=counted, fullgraph=True,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        if ids.shape[0] > 1:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        with step_context(self.layers, meta):
            return self._fn(ids, positions)
