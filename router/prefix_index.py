"""One node's cached KV blocks by tier, as its Load reports' block-hash events tell (engine/kv_events.py).

Exact up to what the events carry: a snapshot replaces the index, events since apply in order. A gap in the
reports' numbers (a lost report) leaves the index `stale` until the next snapshot: still used (the node checks
its own cache; a wrong guess costs routing quality, never tokens). At most `max_blocks` hashes per node; blocks
stored past that are not indexed (`dropped`). Owned by the router's event loop.
"""

from __future__ import annotations

from pdcluster.control.block_hash import STORED, TIER_NAMES

TIERS = len(TIER_NAMES)
MAX_INDEXED_BLOCKS = 1 << 18


class PrefixIndex:
    def __init__(self, max_blocks: int = MAX_INDEXED_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.tiers: dict[int, int] = {}   # hash -> bit t set when tier t holds it
        self.counts = [0] * TIERS          # blocks indexed per tier
        self.seq = 0
        self.stale = False
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.tiers)

    def apply(self, seq: int, events: list, snapshot: bool) -> None:
        """One report's events (already shape-checked by `Load.check`)."""
        if snapshot:
            self.tiers.clear()
            self.counts = [0] * TIERS
            self.stale = False
        elif seq != self.seq + 1:
            self.stale = True
        self.seq = seq
        tiers, counts = self.tiers, self.counts
        for op, tier, hashes in events:
            bit = 1 << tier
            if op == STORED:
                for h in hashes:
                    held = tiers.get(h)
                    if held is None and len(tiers) >= self.max_blocks:
                        self.dropped += 1
                    elif held is None or not held & bit:
                        tiers[h] = (held or 0) | bit
                        counts[tier] += 1
            else:
                for h in hashes:
                    held = tiers.get(h, 0)
                    if held & bit:
                        counts[tier] -= 1
                        if held == bit:
                            del tiers[h]
                        else:
                            tiers[h] = held & ~bit

    def leading_tiers(self, hashes: list[int]) -> list[int]:
        """For the leading blocks of a prompt the node holds (given its block hashes), the fastest tier holding
        each; stops at the first block it holds in no tier."""
        out = []
        for h in hashes:
            held = self.tiers.get(h, 0)
            if not held:
                break
            out.append((held & -held).bit_length() - 1)
        return out


class PrefixIndexCollector:
    """`pdcluster_router_prefix_index_blocks{node, tier}` and `_stale{node}`, read at scrape time from the
    router's node states (`nodes()`: every known node)."""

    def __init__(self, nodes) -> None:
        self.nodes = nodes

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        blocks = GaugeMetricFamily("pdcluster_router_prefix_index_blocks", "KV blocks a node holds, per tier, as "
                                   "its KV events told this router", labels=["node", "tier"])
        stale = GaugeMetricFamily("pdcluster_router_prefix_index_stale", "1: a node's KV events had a gap since its "
                                  "last snapshot", labels=["node"])
        dropped = CounterMetricFamily("pdcluster_router_prefix_index_dropped_blocks", "stored blocks not indexed: "
                                      "the node's index was full", labels=["node"])
        for node in self.nodes():
            for t, name in enumerate(TIER_NAMES):
                blocks.add_metric([node.id, name], node.index.counts[t])
            stale.add_metric([node.id], int(node.index.stale))
            dropped.add_metric([node.id], node.index.dropped)
        yield blocks
        yield stale
        yield dropped
