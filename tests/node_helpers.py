"""A decode or prefill node service run in the test's process, on a tiny random model and a real etcd, with
fake peers over real zmq that the test drives (tests/test_node_services.py, test_timeouts.py, ...).

Fake prefill node: a NodeInfo registered in etcd + a zmq ROUTER socket (`FakePrefill`). Fake router / fake
decode node: a zmq DEALER. Every wait is bounded by WAIT; `serving` ends with all the engine's KV blocks free."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Callable

from pdcluster.control.etcd_server import EtcdServer
from pdcluster.control.protocol import Generate, Message, Prefill, PrefillDestination, Progress, Tokens
from pdcluster.control.records import NodeInfo
from pdcluster.control.registration import Registration
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.transport import DealerClient, RouterServer
from pdcluster.node.config import NodeConfig

WAIT = 10.0  # bound of every wait; nothing here should take more than a fraction of it
QUIET = 0.5  # how long "nothing more arrives" is watched
PROMPT = list(range(3, 40))  # 37 tokens: 3 KV blocks of 16
MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).to_dict()
PREFILL_PEER = "prefill-fake"


def node_config(kind: str, model: str, etcd: EtcdServer, cluster: str) -> NodeConfig:
    config = NodeConfig(model=model, etcd=[etcd.endpoint], cluster=cluster, node_id=f"{kind}-under-test",
                        lease_ttl=2, block_size=16, num_gpu_blocks_override=64, max_num_seqs=4)
    config.finish(kind)
    config.validate()
    return config


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(node) -> AsyncIterator:
    """Run `node.serve()` on this loop until the block exits; yields once the node is registered."""
    task = asyncio.create_task(node.serve())
    try:
        await wait_until(lambda: task.done() or (node.registration is not None and node.registration.registered),
                         "the node to register in etcd")
        assert not task.done(), f"node stopped during start: {task.exception()!r}"
        yield node
        await assert_idle(node)
    finally:
        node.stop()
        await asyncio.wait_for(task, 30)


async def assert_idle(node) -> None:
    """No request left in the node and every KV block of its engine free (none reserved for remote KV)."""
    pending = getattr(node, "requests", None)
    if pending is None:
        pending = node.jobs

    def idle() -> bool:
        s = node.engine_stats()
        return (not pending and s.num_running == 0 and s.num_waiting == 0 and s.num_reserved_blocks == 0
                and s.num_free_blocks == s.num_total_blocks > 0)

    await wait_until(idle, f"an idle node with every KV block free (now {node.engine_stats()}, "
                           f"{len(pending)} request(s))")


async def recv(sock: DealerClient, kind: type[Message]) -> Message:
    """The next `kind` message; the decode node's Progress heartbeats are skipped unless asked for."""
    while True:
        msg = await sock.recv(timeout=WAIT)
        if not (isinstance(msg, Progress) and kind is not Progress):
            break
    assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
    return msg


async def nothing_more(sock: DealerClient) -> None:
    """No message but Progress heartbeats within QUIET."""
    deadline = time.monotonic() + QUIET
    while (left := deadline - time.monotonic()) > 0:
        msg = await sock.recv(timeout=left)
        assert msg is None or isinstance(msg, Progress), f"unexpected {msg!r}"


# ---------------------------------------------------------------------------------------------- decode node

class FakePrefill:
    """A prefill node as the decode node sees it: a record in etcd and a control socket the test answers."""

    def __init__(self, etcd: EtcdServer, cluster: str) -> None:
        self.server = RouterServer()
        self.server.bind("tcp://127.0.0.1:0")
        info = NodeInfo(node_id=PREFILL_PEER, role="prefill", control_addr=self.server.address)
        self.registration = Registration([etcd.endpoint], cluster, info, ttl=2)

    async def recv(self, kind: type[Message]) -> tuple[bytes, Message]:
        identity, msg = await asyncio.wait_for(self.server.recv(), WAIT)
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return identity, msg

    async def recv_prompt(self) -> tuple[bytes, Prefill, PrefillDestination]:
        """A decode node's prompt: its `Prefill` (no destination yet), then its `PrefillDestination`."""
        identity, prefill = await self.recv(Prefill)
        assert prefill.dst == {}, "the prompt goes before its blocks are reserved"
        again, dst = await self.recv(PrefillDestination)
        assert again == identity and dst.rid == prefill.rid and dst.dst["block_ids"]
        return identity, prefill, dst

    async def close(self) -> None:
        await self.registration.deregister()
        self.server.close()


@contextlib.asynccontextmanager
async def decode_setup(etcd: EtcdServer, cluster: str, model: str, prefill_timeout: float = WAIT, **knobs):
    """(decode node, fake prefill peer it can see, fake router connected to it); `knobs` on node_config's."""
    from pdcluster.decode_node.node import DecodeNode

    peer = FakePrefill(etcd, cluster)
    assert await peer.registration.start(wait=WAIT)
    router = DealerClient()
    config = node_config("decode", model, etcd, cluster)
    for name, value in knobs.items():
        setattr(config, name, value)
    try:
        node = DecodeNode(config, prefill_timeout=prefill_timeout)
        async with serving(node):
            assert await node.view.wait_for(lambda v: PREFILL_PEER in v.nodes, WAIT)
            router.connect(node.control.address)
            yield node, peer, router
    finally:
        router.close()
        await peer.close()


def generate(router: DealerClient, rid: str, prefill_node: str | None) -> None:
    assert router.send(Generate(rid=rid, prompt_ids=PROMPT, sampling=GREEDY, prefill_node=prefill_node,
                                timeout_s=60, router="router-fake"))


async def stream(router: DealerClient, rid: str) -> tuple[list[int], Tokens]:
    """All token ids of `rid` until it finishes, and its first Tokens message."""
    ids: list[int] = []
    first = None
    while True:
        msg = await recv(router, Tokens)
        assert msg.rid == rid and msg.error is None, msg
        first = first or msg
        ids += msg.ids
        if msg.finish is not None:
            assert msg.finish == "length"
            return ids, first


async def local_tokens(router: DealerClient, rid: str) -> list[int]:
    generate(router, rid, None)
    ids, first = await stream(router, rid)
    assert first.prefill_path == "local" and len(ids) == MAX_TOKENS
    return ids


async def remote_prefill_sent(node, peer: FakePrefill, router: DealerClient, rid: str) -> bytes:
    """Send a request that names the fake prefill peer; return the zmq identity its Prefill came from."""
    generate(router, rid, PREFILL_PEER)
    identity, prefill, _ = await peer.recv_prompt()
    assert prefill.rid == rid and prefill.decode_node == node.node_id
    assert prefill.prompt_ids == PROMPT
    return identity


def remote_failures(node, reason: str) -> float:
    value = node.registry.get_sample_value("pdcluster_node_remote_prefill_failures_total", {"reason": reason})
    return value or 0.0



# ---------------------------------------------------------------------------------------------- prefill node

class SilentKVListener:
    """A TCP port that accepts KV connections and never answers: a transfer to it hangs in its handshake
    until `release()` closes the connections."""

    def __init__(self) -> None:
        self.connections = 0
        self._release = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._hold, "127.0.0.1", 0)
        return "127.0.0.1:%d" % self._server.sockets[0].getsockname()[1]

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self._release.wait()
        writer.close()

    async def release(self) -> None:
        self._release.set()
        self._server.close()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def prefill_setup(etcd: EtcdServer, cluster: str, model: str, config: NodeConfig | None = None):
    """(prefill node, fake decode node connected to its control socket); `config`: node_config's by default."""
    from pdcluster.prefill_node.node import PrefillNode

    decode = DealerClient()
    try:
        node = PrefillNode(config or node_config("prefill", model, etcd, cluster))
        async with serving(node):
            decode.connect(node.control.address)
            yield node, decode
    finally:
        decode.close()


def prefill(rid: str, dst: dict, timeout_s: float = 60.0) -> Prefill:
    return Prefill(rid=rid, prompt_ids=PROMPT, sampling=GREEDY, dst=dst, decode_node="decode-fake",
                   timeout_s=timeout_s)


def destination(node, rid: str, address: str, num_blocks: int = 3) -> dict:
    """A well-formed KV destination matching the prefill node's pool layout."""
    return {"request_id": rid, "address": address, "block_ids": list(range(num_blocks)), "token": "t",
            "deadline": time.time() + 60, "backends": ["tcp"], "layout": node.sender.layout.to_dict()}
