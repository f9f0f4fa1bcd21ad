"""The decode node's connections to prefill nodes: one DEALER each, replies routed to one callback."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pdcluster.membership import NodeInfo
from pdcluster.protocol import Message
from pdcluster.transport import DealerClient

log = logging.getLogger(__name__)


class _Peer:
    def __init__(self, info: NodeInfo, on_message: Callable[[str, Message], None]) -> None:
        self.node_id = info.node_id
        self.address = info.control_addr
        self.dealer = DealerClient()
        self.dealer.connect(self.address)
        self._on_message = on_message
        self._reader = asyncio.create_task(self._read_loop(), name=f"prefill-peer:{self.node_id}")

    async def _read_loop(self) -> None:
        while True:
            msg = await self.dealer.recv()
            try:
                self._on_message(self.node_id, msg)
            except Exception:
                log.exception("handling %s from prefill node %s failed", msg.TYPE, self.node_id)

    def close(self) -> None:
        self._reader.cancel()
        self.dealer.close()


class PrefillPeers:
    def __init__(self, on_message: Callable[[str, Message], None]) -> None:
        self._on_message = on_message
        self._peers: dict[str, _Peer] = {}

    def send(self, info: NodeInfo, msg: Message) -> bool:
        peer = self._peers.get(info.node_id)
        if peer is None or peer.address != info.control_addr:
            if peer is not None:
                peer.close()
            peer = self._peers[info.node_id] = _Peer(info, self._on_message)
        return peer.dealer.send(msg)

    def send_to(self, node_id: str, msg: Message) -> bool:
        """Send on an existing connection only (e.g. an Abort); False when there is none."""
        peer = self._peers.get(node_id)
        return peer is not None and peer.dealer.send(msg)

    def drop(self, node_id: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
