"""What the prefill and decode services share: the service shell around the engine thread.

The engine runs on a `pdcluster.engine.engine_thread.EngineThread` (stopping on a failed step); the asyncio
side hands it work as callables (`call` / `post`), and each step's outputs come back to the event loop
(`on_outputs`). `NodeService` is the shell around it: control socket (zmq ROUTER), Load publisher, /metrics,
etcd registration + cluster view, drain on SIGTERM / SIGINT / admin state "draining", and what both node
kinds do alike: the deadline sweep, the only-the-sender-may-abort check, engine-failure handling.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from prometheus_client import Gauge

from pdcluster.control.cluster_view import ClusterView
from pdcluster.control.etcd_client import EtcdCredentials
from pdcluster.control.gc_tuning import quiet_gc
from pdcluster.control.keys import keys_from_config
from pdcluster.control.metrics import DroppedFramesCollector, MetricsServer, new_registry, serve_metrics
from pdcluster.control.protocol import MAX_KV_EVENT_HASHES, Abort, FetchKV, Load, LoraAdapter, Message, Ping, Pong
from pdcluster.control.records import Capacity, NodeInfo
from pdcluster.control.registration import NodeIdTaken, Registration
from pdcluster.control.transport import LoadPublisher, RouterServer
from pdcluster.engine.engine_thread import EngineThread
from pdcluster.engine.stats import EngineStats
from pdcluster.kv_transfer import KVSender
from pdcluster.kv_transfer.per_rank import RankedSender
from pdcluster.monitor import DeviceUsageCollector
from pdcluster.node.config import NodeConfig, check_host_is_here
from pdcluster.node.kv_lender import KVLender
from pdcluster.node.lora import NodeLoras

if TYPE_CHECKING:
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

LOAD_INTERVAL = 0.5  # seconds between Load reports (~2 Hz)
MIGRATE_LINGER_S = 3.0  # a node that moved requests away keeps lending their KV at least this long
KV_SNAPSHOT_HASHES = 65536   # per tier in a Load report's KV snapshot (most recently used first)
KV_SNAPSHOT_INTERVAL_S = 30.0   # a snapshot this often: a router that joined late or missed reports catches up
DEADLINE_SWEEP = 0.25  # seconds between deadline checks


class InFlight(Protocol):
    """What the base reads of a subclass's per-request record."""
    owner: bytes  # zmq identity of the peer that sent the request: its replies go there, only it may abort
    deadline: float  # time.monotonic() seconds; 0: none


class NodeService:
    """Shell of a node process. Subclasses set `role` and `upstream` (who sends them work), build their engine
    and pass it to this constructor (everything the base reads exists once it returns), and implement
    `in_flight()`, `handle(identity, msg)`, `abort(rid, reason, expired)`, `on_outputs(outputs)`,
    `on_engine_failure()` and `load()`."""

    role = ""
    upstream = ""  # who sends this node its requests (and may abort them), for log and error text

    def __init__(self, config: NodeConfig, engine: LLMEngine) -> None:
        self.config = config
        self.node_id = config.node_id
        self.engine = engine
        self.drain_timeout = config.drain_timeout
        self.registry = new_registry()
        self.state = "serving"  # serving | cordoned | draining
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        # The cluster secret's keys (None: unauthenticated, warned about): CURVE on both sockets, the KV handshake.
        self.keys = keys_from_config(config.cluster_secret, f"{self.role} node {self.node_id}")
        self.kv_key = self.keys.kv_key if self.keys is not None else None
        self.control = RouterServer(keys=self.keys)
        self.load_pub = LoadPublisher(keys=self.keys)
        self.view = ClusterView(config.etcd, config.cluster, registry=self.registry,
                                credentials=EtcdCredentials.from_config(config))
        self.registration: Registration | None = None
        self.metrics_server: MetricsServer | None = None
        # Built here, started by the subclass's on_start; each step's outputs hop to the event loop.
        self.engine_thread = EngineThread(engine, self._from_engine_thread)
        self.lender = KVLender(self.engine_thread, self.kv_sender, self.control.send)   # answers FetchKV
        self._lend_sender: KVSender | None = None
        self.loras = NodeLoras(engine, self.engine_thread, self.control.send)   # answers LoraAdapter
        self._engine_started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._draining_task: asyncio.Task | None = None
        self.handed_back_at: float | None = None   # monotonic time a request last went to another node with its KV
        self.exit_code = 0   # of the process; non-zero after a supervised task died
        self._rate_marks: dict[str, tuple[float, float]] = {}
        self.kv_bytes_moved = 0  # KV bytes sent (prefill) or received (decode), counted on the event loop
        self._kv_batches: deque[tuple[list, bool]] = deque()   # engine thread -> Load reports
        self._kv_seq = 0
        self._kv_snapshot_at = 0.0   # monotonic time of the last snapshot asked for (0: ask now)
        # Sockets this node receives on, by metric label; subclasses add theirs as they create them.
        self.frame_sources: dict[str, object] = {"control": self.control.dropped}
        self.registry.register(EngineStatsCollector(self.engine_stats))
        self.registry.register(DeviceUsageCollector(self.engine_device))
        self.registry.register(DroppedFramesCollector("pdcluster_node_dropped_frames", self.dropped_frames))
        Gauge("pdcluster_node_requests_in_flight", "requests held: admitted and not finished (decode), prompts not "
              "yet answered (prefill)", registry=self.registry).set_function(lambda: self.num_in_flight())

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop `serve()` runs on (RuntimeError before it started)."""
        if self._loop is None:
            raise RuntimeError(f"{self.role} node {self.node_id} is not serving yet")
        return self._loop

    def engine_stats(self) -> EngineStats:
        return self.engine_thread.stats

    def start_engine_thread(self) -> None:
        """Drive `self.engine` on its thread; each step's outputs (or its failure) reach `on_outputs` /
        `on_engine_failure` on the event loop."""
        self.engine_thread.start()
        self._engine_started = True

    def _from_engine_thread(self, outputs: list[RequestOutput] | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.engine_outputs, outputs)

    def engine_outputs(self, outputs: list[RequestOutput] | BaseException) -> None:
        """On the event loop: one step's outputs, or the exception that stopped the engine thread."""
        if isinstance(outputs, BaseException):
            self.on_engine_failure()
            self.exit_code = 1   # a failed engine: exit non-zero, so systemd restarts the node
            self.begin_drain("engine failure")
            return
        self.on_outputs(outputs)

    def kv_report(self) -> dict[str, Any]:
        """The KV fields of a Load report (`Load.kv_events`, `kv_seq`, `kv_snapshot`): the block-hash events the
        engine thread collected for the previous reports (collected there, so each report carries what was asked
        for one interval before), a snapshot every KV_SNAPSHOT_INTERVAL_S. Events that would not fit one report are
        dropped, the sequence number skips one (the router then knows it missed some) and a snapshot follows."""
        now = time.monotonic()
        snapshot = now - self._kv_snapshot_at >= KV_SNAPSHOT_INTERVAL_S
        if snapshot:
            self._kv_snapshot_at = now
        self.engine_thread.post(lambda engine: self._kv_batches.append(
            engine.kv_events(snapshot=snapshot, limit=KV_SNAPSHOT_HASHES)))
        events: list = []
        is_snapshot = False
        while self._kv_batches:
            batch, batch_snapshot = self._kv_batches.popleft()
            if batch_snapshot:   # a snapshot replaces everything before it
                events, is_snapshot = [], True
            events += batch
        self._kv_seq += 1
        if sum(len(g[2]) for g in events) > MAX_KV_EVENT_HASHES:
            events, is_snapshot = [], False
            self._kv_seq += 1
            self._kv_snapshot_at = 0.0
        return {"kv_events": events, "kv_seq": self._kv_seq, "kv_snapshot": is_snapshot}

    def kv_sender(self) -> KVSender | RankedSender:
        """The KVSender that writes this node's pool blocks into other nodes' (made on first use; a prefill node
        has its own)."""
        if self._lend_sender is None:
            cfg = self.config
            self._lend_sender = KVSender(self.engine.kv_pool.tensor, backend=cfg.kv_backend,
                                         connect_timeout=cfg.kv_connect_timeout, auth_key=self.kv_key,
                                         total_kv_heads=self.engine.kv_pool.model_kv_heads)
        return self._lend_sender

    def dropped_frames(self) -> dict[str, object]:
        """The `DroppedFrames` of each socket this node receives on, by label."""
        return dict(self.frame_sources)

    def engine_device(self) -> tuple[str, int]:
        """(type, index) of the engine's device."""
        device = self.engine.device
        return device.type, device.index or 0

    def transfer_gbps(self) -> float:
        """KV transfer rate in GB/s since the previous call. Each call starts a new window: the Load report
        is the one caller in production (tests call it too, and then the next report's window is shorter)."""
        return self.rate("kv_bytes", self.kv_bytes_moved) / 1e9

    def rate(self, key: str, value: float) -> float:
        """Per-second rate of the counter `key` (now `value`) since the previous call for `key`."""
        now = time.monotonic()
        then, before = self._rate_marks.get(key, (self.started_mono, 0))
        self._rate_marks[key] = (now, value)
        return (value - before) / (now - then) if now > then and value >= before else 0.0

    # ---- subclass hooks --------------------------------------------------------------------------

    def in_flight(self) -> Mapping[str, InFlight]:
        """The requests this node holds (not yet finished / answered), by id."""
        raise NotImplementedError

    def handle(self, identity: bytes, msg: Message) -> None:
        """Any message but Ping and Abort (the base answers those)."""
        raise NotImplementedError

    def abort(self, rid: str, reason: str, expired: bool = False) -> None:
        """Stop request `rid` (its sender asked, or `expired`: its deadline passed)."""
        raise NotImplementedError

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """One engine step's outputs, on the event loop."""
        raise NotImplementedError

    def on_engine_failure(self) -> None:
        """The engine thread died: answer every request in flight (the base then drains and exits 1)."""
        raise NotImplementedError

    def load(self) -> Load:
        raise NotImplementedError

    def num_in_flight(self) -> int:
        return len(self.in_flight())

    def capacity(self) -> Capacity:
        engine = self.engine
        return Capacity(num_blocks=self.engine_stats().num_total_blocks, block_size=engine.block_size,
                        max_num_seqs=self.config.max_num_seqs, max_model_len=engine.model_config.max_model_len,
                        tensor_parallel_size=self.config.tensor_parallel_size, kv_rank_slices=self.kv_rank_slices())

    def kv_rank_slices(self) -> int:
        """The ranks whose slices make this node's KV pool, each moved over its own channel; 0: one pool holds it."""
        return self.config.tensor_parallel_size if self.engine.rank_sliced_pool else 0

    def speculative(self) -> str:
        spec = self.engine.args.speculative
        return spec.to_json() if spec is not None else ""

    def served_model_name(self) -> str:
        """The model name requests for this node carry: the knob, or the model dir's name."""
        return self.config.served_model_name or os.path.basename(os.path.normpath(self.config.model))

    def node_info(self) -> NodeInfo:
        assert self.metrics_server is not None, "node_info before serve() bound the sockets"
        return NodeInfo(node_id=self.node_id, role=self.role, model=self.served_model_name(),
                        host=self.config.host, control_addr=self.control.address, load_addr=self.load_pub.address,
                        metrics_addr=f"http://{self.config.host}:{self.metrics_server.port}/metrics",
                        capacity=self.capacity(), started_at=self.started_at, speculative=self.speculative(),
                        prefix_hash_seed=self.engine.hash_seed)

    def _peer_mismatch(self) -> str:
        """Why this node may not join, or "". KV moves between prefill and decode engines of one model of any
        tensor_parallel_size, whether their pools are sliced per rank alike, otherwise or not at all (each receiving
        pool takes its heads from every sending pool holding some of them, the channels regrouping them on the way:
        kv_transfer/regroup.py, kv_transfer/per_rank/), so only speculative_config is checked: decode nodes run the
        proposer and rebuild its state, so a prefill node needs none; one that has one must have its decode nodes'
        (anything else is a deployment that does not do what it says)."""
        other = {"prefill": "decode", "decode": "prefill"}.get(self.role)
        my_spec = self.speculative()
        for peer in self.view.nodes_by_role(other) if other else []:
            if peer.model != self.served_model_name():
                continue
            prefill_spec, decode_spec = (my_spec, peer.speculative) if self.role == "prefill" \
                else (peer.speculative, my_spec)
            if prefill_spec and prefill_spec != decode_spec:
                return (f"speculative_config {my_spec or 'none'} differs from {other} node {peer.node_id}'s "
                        f"{peer.speculative or 'none'} for model {peer.model!r}: a prefill node has no "
                        "speculative_config or its decode nodes'; refusing to register")
        return ""

    async def on_start(self) -> None:
        """Subclass setup that needs the running loop (before registration)."""

    async def on_stop(self) -> None:
        """Subclass teardown after the node left etcd."""

    # ---- lifecycle -------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run until drained (SIGTERM / SIGINT / admin drain) or `stop()`."""
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        host = self.config.host
        self.control.bind(f"tcp://{host}:{self.config.control_port}")
        self.load_pub.bind(f"tcp://{host}:{self.config.load_port}")
        metrics_server = self.metrics_server = serve_metrics(self.registry, self.config.metrics_port, host=host)
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.begin_drain, f"signal {sig.name}")
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        await self.on_start()
        try:   # peers will dial the advertised host: fail now, not with every peer timing out later
            check_host_is_here(host, self.config.etcd)
        except ValueError as exc:
            log.error("%s: %s", self.node_id, exc)
            self.exit_code = 2
            await self._shutdown()
            return
        self.view.add_listener(self._on_view_change)
        await self.view.start(wait=5.0)
        mismatch = self._peer_mismatch()
        if mismatch:
            log.error("%s: %s", self.node_id, mismatch)
            self.exit_code = 2
            await self._shutdown()
            return
        registration = self.registration = Registration(self.config.etcd, self.config.cluster, self.node_info(),
                                         ttl=self.config.lease_ttl, registry=self.registry,
                                         credentials=EtcdCredentials.from_config(self.config))
        try:
            registered = await registration.start(wait=10.0)
        except NodeIdTaken as exc:  # a second process with this id: leave without touching the holder's record
            log.error("%s: %s", self.node_id, exc)
            self.registration = None
            self.exit_code = 2
            await self._shutdown()
            return
        if not registered:
            log.warning("%s: not registered in etcd yet (%s); serving and retrying", self.node_id, self.config.etcd)
        if registration.task is not None:
            registration.task.add_done_callback(self._on_task_done)  # ends only if the id was taken over
        self._tasks = [self.supervised(self._recv_loop(), "control"),
                       self.supervised(self.load_pub.run(self._load_snapshot, LOAD_INTERVAL), "load"),
                       self.supervised(self._deadline_loop(), "deadlines")]
        log.info("%s node %s serving: control %s, load %s, metrics :%d", self.role, self.node_id,
                 self.control.address, self.load_pub.address, metrics_server.port)
        try:
            await self._stopped.wait()
        finally:
            await self._shutdown()

    def begin_drain(self, reason: str = "", migrate: bool = False) -> None:
        """Stop admitting; finish in-flight work (or, `migrate` / `drain_migrate`, move it to other nodes:
        `migrate_away`); leave etcd; stop. Idempotent."""
        if self._draining_task is not None or self._loop is None:
            return
        migrate = migrate or self.config.drain_migrate
        log.info("%s: draining (%s%s), %d request(s) in flight", self.node_id, reason,
                 ", moving requests away" if migrate else "", self.num_in_flight())
        self.state = "draining"
        self.load_pub.publish(self._load_snapshot())  # routers stop picking this node now
        self._draining_task = self._loop.create_task(self._drain(migrate))

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    def supervised(self, coro, name: str) -> asyncio.Task:
        """A task that must run as long as the node: if it ends on its own (it raised), the node leaves etcd
        and exits non-zero (systemd restarts it) instead of living on as a zombie that looks healthy."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._stopped is None or self._stopped.is_set():
            return
        exc = task.exception()
        log.critical("%s: task %s ended (%r); leaving the cluster and exiting", self.node_id, task.get_name(),
                     exc, exc_info=exc)
        self.exit_code = 1
        self.stop()

    async def _drain(self, migrate: bool = False) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.num_in_flight() > 0 and time.monotonic() < deadline:
            if migrate:
                self.migrate_away()
            await asyncio.sleep(0.05)
        if self.num_in_flight():
            log.warning("%s: drain timeout with %d request(s) still in flight", self.node_id, self.num_in_flight())
        if self.handed_back_at is not None:   # their new nodes fetch the KV from here: stay until they have
            while (self.lender.lending or time.monotonic() - self.handed_back_at < MIGRATE_LINGER_S) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.stop()

    def migrate_away(self) -> None:
        """Move the requests that can move to other nodes with their KV (their new nodes fetch it from this one:
        set `handed_back_at` when one goes). Decode nodes do; others have nothing to move."""

    async def _shutdown(self) -> None:
        if self.registration is not None:
            await self.registration.deregister()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.view.stop()
        await self.lender.close()
        await self.loras.close()
        await self.on_stop()
        if self._lend_sender is not None:
            self._lend_sender.close()
        if not self._engine_started or self.engine_thread.stop():   # never under a step still running
            # the tensor-parallel ranks, the grammar compiler, the KV tiers' copy thread
            await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        self.control.close()
        self.load_pub.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("%s node %s stopped", self.role, self.node_id)

    # ---- internals -------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            identity, msg = await self.control.recv()
            try:
                if isinstance(msg, Ping):
                    self.control.send(identity, Pong(nonce=msg.nonce))
                elif isinstance(msg, Abort):
                    self._on_abort(identity, msg.rid)
                elif isinstance(msg, FetchKV):
                    self.lender.handle(identity, msg)
                elif isinstance(msg, LoraAdapter):
                    self.loras.handle(identity, msg)
                else:
                    self.handle(identity, msg)
            except Exception:  # one bad message must not stop the node
                log.exception("%s: handling %s failed", self.node_id, msg.TYPE)

    def _on_abort(self, identity: bytes, rid: str) -> None:
        held = self.in_flight().get(rid)
        if held is not None and held.owner != identity:   # only the peer that sent the request may abort it
            self.control.dropped.drop(f"Abort of request {rid} from a peer that did not send it")
            return
        self.abort(rid, f"aborted by the {self.upstream}")

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(DEADLINE_SWEEP)
            now = time.monotonic()
            for rid in [rid for rid, r in self.in_flight().items() if r.deadline and now > r.deadline]:
                self.abort(rid, "deadline exceeded", expired=True)

    def _load_snapshot(self) -> Load:
        load = self.load()
        load.state = self.state
        load.timestamp = time.time()
        load.loras, load.max_loras = list(self.loras.names), self.loras.max_loras
        return load

    def _on_view_change(self, event: str, node_id: str | None) -> None:
        if event.startswith("node_") and node_id is not None and node_id != self.node_id:
            if event == "node_removed":   # only decode nodes ask for KV
                self.lender.keep_peers([n.kv_addr for n in self.view.nodes_by_role("decode")])
            self.on_peer_change(event, node_id)
        if node_id not in (None, self.node_id):
            return
        admin = self.view.admin_state(self.node_id)
        if admin == "draining":
            record = self.view.admin.get(self.node_id)
            self.begin_drain("admin state draining", migrate=record is not None and record.migrate)
        elif self.state != "draining":
            self.state = "cordoned" if admin == "cordoned" else "serving"

    def on_peer_change(self, event: str, node_id: str) -> None:
        """A peer joined, changed or left the view (decode nodes watch their prefill peers)."""


def run_service(service_factory: Callable[[], NodeService]) -> int:
    """Build the node (loads the model) and serve it on a fresh event loop; the process exit code."""
    # Until the loop's drain handlers are installed, SIGTERM exits through Python, so exit hooks (the
    # shared-memory KV pool's unlink) still run; the default action would end the process on the spot.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from pdcluster.engine.onednn_caches import bound_onednn_caches

    bound_onednn_caches()   # before the model loads: the first oneDNN primitive fixes the caches' sizes
    try:
        service = service_factory()
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    quiet_gc()   # the loaded model's heap: out of every collection from now on
    asyncio.run(service.serve())
    return service.exit_code


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class EngineStatsCollector:
    """Prometheus collector reading the engine thread's latest stats at scrape time (no polling lag)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        query = s.prefix_cache_query_tokens
        gauges = {
            "pdcluster_node_running_requests": ("sequences in the running batch", s.num_running),
            "pdcluster_node_waiting_requests": ("sequences queued in the engine", s.num_waiting),
            "pdcluster_node_waiting_for_grammar_requests": ("structured-output requests whose grammar compiles",
                                                            s.num_waiting_for_grammar),
            "pdcluster_node_kv_blocks_total": ("KV pool size in blocks", s.num_total_blocks),
            "pdcluster_node_kv_blocks_free": ("free KV blocks (prefix-cached unreferenced ones count as free)",
                                              s.num_free_blocks),
            "pdcluster_node_kv_blocks_used": ("KV blocks in use", s.num_total_blocks - s.num_free_blocks),
            "pdcluster_node_kv_blocks_reserved": ("KV blocks held by requests waiting for remote KV",
                                                  s.num_reserved_blocks),
            "pdcluster_node_prefix_cache_hit_ratio": ("prompt tokens served by the prefix cache / prompt tokens",
                                                      s.prefix_cache_hit_tokens / query if query else 0.0),
            "pdcluster_node_max_num_seqs": ("max concurrently running sequences", s.max_num_seqs),
            "pdcluster_node_batch_occupancy_ratio": ("running sequences / max_num_seqs", s.batch_occupancy),
            "pdcluster_node_tokens_per_second": ("tokens generated per second over the engine's last rate "
                                                 "interval", s.tokens_per_s),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pdcluster_node_preemptions": ("sequences preempted for lack of KV blocks", s.num_preemptions),
            "pdcluster_node_prefill_tokens": ("prompt tokens computed", s.num_prefill_tokens),
            "pdcluster_node_decode_tokens": ("decode tokens computed", s.num_decode_tokens),
            "pdcluster_node_generated_tokens": ("tokens sampled (first tokens included)", s.num_generated_tokens),
            "pdcluster_node_engine_steps": ("engine steps run", s.num_steps),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from spec_decode_families(s)
        yield from expert_load_families(s)
        yield from kv_tier_families(s)
        yield from kv_fetch_families(s)


def kv_fetch_families(s: EngineStats):
    """Prefix blocks copied between nodes (FetchKV): what this node fetched, missed and lent."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("pdcluster_node_loading_kv_requests", "requests whose prefix is being loaded back from "
                            "a KV tier or fetched from another node", value=s.num_loading_kv)
    for name, doc, value in (("fetched_blocks", "prefix blocks fetched from another node instead of recomputed",
                              s.kv_fetched_blocks),
                             ("fetch_missed_blocks", "prefix blocks asked of another node that did not arrive (it "
                              "lacked them, failed or died): recomputed", s.kv_fetch_missed_blocks),
                             ("lent_blocks", "prefix blocks this node copied to another node", s.kv_lent_blocks)):
        yield CounterMetricFamily(f"pdcluster_node_kv_{name}", doc, value=value)


def kv_tier_families(s: EngineStats):
    """The KV tiers below the pool (engine/kv_tiers.py), by tier; nothing when the node has none."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if not (s.kv_tier_stored_blocks or s.kv_tier_host_blocks or s.kv_tier_disk_blocks or s.kv_tier_disk_disabled):
        return
    held = GaugeMetricFamily("pdcluster_node_kv_tier_blocks", "KV blocks a tier holds", labels=["tier"])
    loaded = CounterMetricFamily("pdcluster_node_kv_tier_loaded_blocks", "prefix blocks loaded back from a tier "
                                 "instead of recomputed", labels=["tier"])
    for tier, blocks, count in (("host", s.kv_tier_host_blocks, s.kv_tier_loaded_host_blocks),
                                ("disk", s.kv_tier_disk_blocks, s.kv_tier_loaded_disk_blocks)):
        held.add_metric([tier], blocks)
        loaded.add_metric([tier], count)
    yield held
    yield loaded
    for name, doc, value in (("stored_blocks", "blocks copied from the pool to the host tier", s.kv_tier_stored_blocks),
                             ("disk_writes", "blocks written from the host tier to disk", s.kv_tier_disk_writes),
                             ("failed_loads", "blocks that could not be read back (missing, corrupt): recomputed",
                              s.kv_tier_failed_loads),
                             ("dropped_stores", "blocks not offloaded: too many copies pending",
                              s.kv_tier_dropped_stores)):
        yield CounterMetricFamily(f"pdcluster_node_kv_tier_{name}", doc, value=value)
    yield GaugeMetricFamily("pdcluster_node_kv_tier_disk_disabled", "1: a disk write failed and the disk tier is off",
                            value=int(s.kv_tier_disk_disabled))


def spec_decode_families(s: EngineStats):
    """Speculative decoding counters, labelled with the method (none without speculative_config): acceptance
    rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
    from prometheus_client.core import CounterMetricFamily

    if not s.spec_method:
        return
    for name, doc, value in (("drafts", "sequence steps that scored drafts", s.spec_num_drafts),
                             ("draft_tokens", "draft tokens scored", s.spec_num_draft_tokens),
                             ("accepted_tokens", "draft tokens accepted", s.spec_num_accepted_tokens)):
        family = CounterMetricFamily(f"pdcluster_node_spec_decode_{name}", f"speculative decoding: {doc}",
                                     labels=["method"])
        family.add_metric([s.spec_method], value)
        yield family
    per_position = CounterMetricFamily("pdcluster_node_spec_decode_accepted_tokens_per_position",
                                       "speculative decoding: accepted drafts by their position in the step's "
                                       "drafts (0: the first)", labels=["method", "position"])
    for position, value in enumerate(s.spec_accepted_per_position):
        per_position.add_metric([s.spec_method, str(position)], value)
    yield per_position


def expert_load_families(s: EngineStats):
    """MoE expert load with label cardinality bounded by the expert count (not layers x experts): tokens per
    expert summed over the MoE layers, and the most imbalanced layer's max / mean tokens per expert."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if not s.expert_tokens:
        return
    tokens = CounterMetricFamily("pdcluster_node_expert_tokens", "tokens routed to each routed expert, summed "
                                 "over the MoE layers", labels=["expert"])
    for expert, value in enumerate(s.expert_totals):
        tokens.add_metric([str(expert)], value)
    yield tokens
    worst = s.expert_imbalance
    if worst is not None:
        yield GaugeMetricFamily("pdcluster_node_expert_imbalance_ratio", "max / mean tokens per expert of the most "
                                "imbalanced MoE layer since the start (1 = even)", value=worst[0])
        yield GaugeMetricFamily("pdcluster_node_expert_imbalance_layer", "decoder layer index of that layer",
                                value=worst[1])
