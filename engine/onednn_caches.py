"""Bounds on oneDNN's shape-keyed caches in a serving process.

The packed CPU matmuls (engine/layers/linear.py, `torch.ops.mkldnn._linear_pointwise`) build one oneDNN
primitive per (rows, weight shape): a step's token count is the row count, so a prefill node sees as many
shapes as distinct step sizes (1 .. max_num_batched_tokens). Two caches keep them: ideep's
(`LRU_CACHE_CAPACITY`) and oneDNN's own (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default,
and an entry's memory grows with its row count (~2.5 MB at 2000 rows of a 64 x 192 weight). Measured
(benchmarks/soak.py, docs/reliability.md "Soak"): a prefill node of the tiny test model grew by ~600 MB in
its first 20 s of mixed prompt lengths, and one weight alone reaches 2.9 GB at 3000 row counts; with both
caches at 64 entries the node stays flat. A miss costs one primitive creation (~0.8 ms on this box, against
~45 us for a cached 64-wide matmul), which a prefill step of thousands of rows does not notice; decode batch
sizes (few, repeating) stay cached.

Both variables are read once, at the process's first oneDNN primitive: `bound_onednn_caches` must run
before the model loads (it packs weights). An operator's own setting of either variable wins.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_CAPACITY = 64   # entries in each cache
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Set both capacities in this process's environment (children inherit it) unless already set; the
    values in force."""
    return {name: os.environ.setdefault(name, str(capacity)) for name in CACHE_VARIABLES}
