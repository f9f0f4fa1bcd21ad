"""Moving KV blocks between processes and hosts: shared memory, TCP, pairwise torch.distributed.

One channel class per backend (channel.py, backends.py); the receiver's reservations are a plain
state machine (reservations.py).

Receiver (decode node): `KVReceiver(pool).reserve(rid, block_ids)` → `Destination` (a msgpack-able
dict via to_dict) → the prefill node's `KVSender(pool).start(dst, src_ids)` → `send_layers`… →
`finish()`; the receiver resolves the reservation (`await wait`, or `on_result`).
"""

from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import ChecksumError, LayoutMismatchError, TransferError
from pdcluster.kv_transfer.layout import KVLayout
from pdcluster.kv_transfer.receiver import KVReceiver
from pdcluster.kv_transfer.reservations import TransferResult
from pdcluster.kv_transfer.sender import KVSender, Transfer
from pdcluster.kv_transfer.shm import SharedKVPool, sweep_dead_pools

__all__ = [
    "ChecksumError",
    "Destination",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "LayoutMismatchError",
    "SharedKVPool",
    "Transfer",
    "TransferError",
    "TransferResult",
    "sweep_dead_pools",
]
