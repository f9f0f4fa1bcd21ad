"""The engine's hooks on the prefill node: a prompt's KV leaves for its decode node as it is computed.

Everything here runs on the engine thread. `TransferConnector` owns the table of transfers whose prompt is
in the engine (`Outgoing`, prefill_node/job.py): the node adds one with the prompt (`add`, in the same engine
call as `add_request`) and may drop one (`abort`); the hooks start each transfer on a connection the node
opened beforehand (the engine thread never connects), queue its layer writes (layer by layer when
`layerwise`, else in one go once the prompt is done), and hand it over (`handover`, which hops to the event
loop) when the prompt is done: from then on the engine thread never touches it.

A prompt whose destination is not known yet (`Outgoing.dst` None, set by the loop when it comes) is computed
all the same; its transfer starts at the first hook that sees the destination: a later layer of its last step
(which then sends the layers done so far at once) or the prompt's end. Done before it, the prompt goes to the
loop with its blocks (`src_blocks`), and the loop starts the transfer.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from pdcluster.engine.kv_connector import KVConnector, PromptInStep
from pdcluster.kv_transfer import KVSender, Transfer
from pdcluster.kv_transfer.per_rank import RankedSender, RankedTransfer
from pdcluster.prefill_node.job import Outgoing

log = logging.getLogger(__name__)


class TransferConnector(KVConnector):
    def __init__(self, layerwise: bool, handover: Callable[[Outgoing], None]) -> None:
        self.layerwise = layerwise
        self.handover = handover
        self.sender: KVSender | RankedSender | None = None   # set by the node once the engine (its KV pool) exists
        self.outgoing: dict[str, Outgoing] = {}   # prompts in the engine whose KV this node sends
        self.streaming: list[Transfer | RankedTransfer] = []   # transfers whose prompt's last chunk runs in this step
        # prompts whose last chunk runs in this step, their destination not known yet: (outgoing, block table)
        self.unrouted: list[tuple[Outgoing, list[int]]] = []

    # ---- the node's calls (through engine_thread.call / post) ----------------------------------------

    def add(self, out: Outgoing) -> None:
        self.outgoing[out.rid] = out

    def abort(self, rid: str, reason: str) -> None:
        """Drop the prompt's transfer (aborted on the wire if it started); a prompt already handed over is the
        loop's to abort."""
        out = self.outgoing.pop(rid, None)
        if out is not None and out.transfer is not None:
            out.transfer.abort(reason)

    # ---- the engine's hooks ------------------------------------------------------------------------

    def on_step_start(self, prompts: list[PromptInStep]) -> None:
        self.streaming = []
        self.unrouted = []
        if not self.layerwise:
            return
        for p in prompts:
            out = self.outgoing.get(p.request_id)
            if out is None or out.transfer is not None or out.error is not None:
                continue
            if out.dst is None:
                self.unrouted.append((out, p.block_ids))
                continue
            transfer = self._start(out, p.block_ids)
            if transfer is not None:
                self.streaming.append(transfer)

    def on_layer_done(self, layer: int) -> None:
        for transfer in self.streaming:
            if not transfer.failed:
                transfer.send_layers(layer, layer + 1)
        if self.unrouted:
            self._route_midstep(layer)

    def _route_midstep(self, layer: int) -> None:
        """Destinations that came during this step: their transfers start now with the layers done so far. Not
        for a pool sliced per rank: its other ranks hear of a transfer only between steps (they go at its end)."""
        if isinstance(self.sender, RankedSender) and self.sender.size > 1:
            return
        waiting = []
        for out, block_table in self.unrouted:
            if out.dst is None:
                waiting.append((out, block_table))
                continue
            transfer = self._start(out, block_table)
            if transfer is not None:
                transfer.send_layers(0, layer + 1)
                self.streaming.append(transfer)
        self.unrouted = waiting

    def on_prompt_done(self, request_id: str, block_ids: list[int]) -> None:
        out = self.outgoing.pop(request_id, None)
        if out is None:
            return
        if out.transfer is None and out.error is None:   # not sent layer by layer
            if out.dst is None:   # the loop starts it when the destination comes
                out.src_blocks = list(block_ids)
            else:
                transfer = self._start(out, block_ids)
                if transfer is not None:
                    transfer.send_all()
        self.handover(out)

    def _start(self, out: Outgoing, block_table: list[int]) -> Transfer | RankedTransfer | None:
        """Start the prompt's transfer (a pool sliced per rank: every rank's, the others in order with the steps,
        so when called before a step they stream its layers as rank 0 does)."""
        assert self.sender is not None, "the node sets the sender before the engine runs"
        return start_transfer(self.sender, out, block_table)


def start_transfer(sender: KVSender | RankedSender, out: Outgoing,
                   block_table: list[int]) -> Transfer | RankedTransfer | None:
    """On the engine thread: `out`'s transfer from the prompt's blocks `block_table`, on a connection the node
    opened (`out.transfer`, or None and `out.error`)."""
    assert out.dst is not None
    src = block_table[out.first_block:out.num_blocks]
    out.nbytes = len(src) * sender.layout.block_bytes * sender.layout.rank_slices   # every rank's slice
    out.first_write = time.monotonic()
    try:
        # Tensors the sender creates here (e.g. its shm mapping of the destination pool) are written by
        # its own threads, so they must be normal even if the engine thread runs under inference mode.
        with torch.inference_mode(False):
            out.transfer = sender.start(out.dst, src, connect=False)
    except Exception as exc:
        out.error = f"kv transfer to {out.dst.address} failed to start: {exc}"
        log.warning("request %s: %s", out.rid, out.error)
    return out.transfer
