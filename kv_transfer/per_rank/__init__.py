"""KV transfer between engines whose KV pools are sliced per tensor-parallel rank (a device, where each rank's
process allocates its own slice, or `kv_pool_per_rank` on CPU): each rank sends its slice over its own channel into
the same rank's slice of an engine sliced alike, or otherwise into every receiving pool holding some of its heads
(regroup.py maps the heads; a pool that several sending ranks fill expects each as a writer of its reservation), driven
and combined by rank 0.

- `endpoint.py`: a rank's KV endpoint, in the rank's process (an engine rank agent: engine/rank_agent.py)
- `link.py`: the command link between rank 0 and each other rank's endpoint
- `sender.py`, `receiver.py`: rank 0's `RankedSender` / `RankedReceiver`, which answer like KVSender / KVReceiver
"""

from pdcluster.kv_transfer.per_rank.endpoint import RankEndpoint, RankEndpointSpec
from pdcluster.kv_transfer.per_rank.link import RankLinks
from pdcluster.kv_transfer.per_rank.receiver import RankedReceiver
from pdcluster.kv_transfer.per_rank.sender import RankedSender, RankedTransfer

__all__ = ["RankEndpoint", "RankEndpointSpec", "RankLinks", "RankedReceiver", "RankedSender", "RankedTransfer"]
