"""How much of this host each node of a local cluster may take: its devices, its memory and its cores.

The nodes of `pdcluster up` start at once on one host and each would size itself as if it were alone (all the
free memory, every device), so the local cluster divides the host among them before they start.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pdcluster.control.config import declared_default, parse_bytes
from pdcluster.control.cpus import share_cpus
from pdcluster.node.config import NodeConfig

log = logging.getLogger(__name__)

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# Cores kept off the nodes for the router and etcd: one once the host has 2 cores more than the nodes have
# ranks, two from 16 cores with 4 to spare. Fewer and they share the nodes' cores (they need little CPU).
RESERVE_ONE_SPARE, RESERVE_TWO_CORES, RESERVE_TWO_SPARE = 2, 16, 4


def node_knob(config: dict[str, Any], name: str) -> Any:
    """A node knob as given in `config`, else the default NodeConfig declares for it."""
    value = config.get(name)
    return declared_default(NodeConfig, name) if value is None else value


def node_device_env(device: str | None, tp: int, index: int, nodes: int,
                    count: Callable[[str], int] | None = None) -> dict[str, str]:
    """The visible-device variable of node `index` (of `nodes`) on an accelerator host: its own `tp` devices
    when the host has enough for every node, else none set (every node sees every device; a warning)."""
    if device not in VISIBLE_DEVICES:
        return {}
    if count is None:
        from pdcluster.engine.parallel import visible_devices

        count = visible_devices
    have = count(device)
    if have < tp * nodes:
        log.warning("%d %s device(s) for %d nodes x tensor_parallel_size %d: the nodes share devices%s", have,
                    device, nodes, tp, " (KV between nodes on one GPU moves through cuda_ipc: NCCL refuses two "
                    "ranks on one device)" if device == "cuda" else "")
        return {}
    return {VISIBLE_DEVICES[device]: ",".join(str(d) for d in range(index * tp, (index + 1) * tp))}


def shared_memory_fraction(device: str | None, tp: int, nodes: int, fraction: float,
                           count: Callable[[str], int] | None = None) -> float:
    """gpu_memory_utilization of each node when the nodes share accelerators (fewer than nodes x tp): each sizes
    its KV pool from the free memory it sees, so k nodes on one device take fraction / k each, not k x fraction."""
    if device not in VISIBLE_DEVICES:
        return fraction
    if count is None:
        from pdcluster.engine.parallel import visible_devices

        count = visible_devices
    have = count(device)
    return fraction / -(-tp * nodes // have) if 0 < have < tp * nodes else fraction


def size_node_memory(node_config: dict[str, Any], nodes: int) -> None:
    """Fill in `node_config` (shared by all `nodes` nodes) so that together they fit this host.

    CPU nodes share its RAM: without kv_cache_memory each gets a share of what is available; with it, all of
    them together must fit, or ValueError now with the numbers instead of an OOM kill later. Accelerator nodes
    without kv_cache_memory that share devices split gpu_memory_utilization (`shared_memory_fraction`)."""
    fraction = float(node_knob(node_config, "gpu_memory_utilization"))
    device = node_knob(node_config, "device")
    if device in ("auto", "cpu"):
        _size_cpu_kv_pools(node_config, nodes, fraction)
    elif node_config.get("kv_cache_memory") is None:
        tp = int(node_knob(node_config, "tensor_parallel_size"))
        node_config["gpu_memory_utilization"] = shared_memory_fraction(device, tp, nodes, fraction)


def _size_cpu_kv_pools(node_config: dict[str, Any], nodes: int, fraction: float) -> None:
    from pdcluster.engine.device import available_memory_bytes, default_cpu_kv_cache_bytes

    asked = node_config.get("kv_cache_memory")
    if asked is None:
        node_config["kv_cache_memory"] = default_cpu_kv_cache_bytes(fraction, nodes)
        return
    total, available = parse_bytes(asked) * nodes, available_memory_bytes()
    if total > available:
        raise ValueError(f"kv_cache_memory: {nodes} nodes x {parse_bytes(asked) / 2**30:.2f} GiB = "
                         f"{total / 2**30:.2f} GiB of KV pools, but this host has {available / 2**30:.2f} GiB "
                         "available; lower --kv-cache-memory or start fewer nodes")


def share_host_cores(cores: list[int], ranks: list[int], prefill_nodes: int = 0) -> tuple[list[int], list[list[int]]]:
    """(the cores of the router and etcd, each node's cores) on a host with `cores` for nodes of `ranks`
    tensor-parallel ranks each, the first `prefill_nodes` of them prefill nodes: the first cores go to the router
    and etcd when there are enough to spare (RESERVE_*), the rest in contiguous slices in node order, proportional
    to the ranks (`share_cpus`). With none to spare the router and etcd share the decode nodes' cores that no
    prefill node has (else any core): a prefill on its core is the first token's time, where a decode step has
    time to spare. Fewer cores than ranks: a warning, every node at least one core, as few sharing as can be."""
    spare = len(cores) - sum(ranks)
    reserved = (2 if len(cores) >= RESERVE_TWO_CORES and spare >= RESERVE_TWO_SPARE
                else 1 if spare >= RESERVE_ONE_SPARE else 0)
    if spare < 0:
        log.warning("%d cores for %d nodes of %d tensor-parallel ranks in all: ranks share cores (threads on a "
                    "shared core wait for each other)", len(cores), len(ranks), sum(ranks))
    nodes = share_cpus(cores[reserved:], ranks)
    if reserved or not prefill_nodes:
        return cores[:reserved], nodes
    prefill = {c for s in nodes[:prefill_nodes] for c in s}
    return sorted({c for s in nodes[prefill_nodes:] for c in s} - prefill), nodes
