"""What the prefill and decode services share: the engine thread and the service shell.

`EngineThread` drives `LLMEngine.step()` on one thread; the asyncio side hands it work as callables
(`call` / `post`) and receives each step's outputs through `loop.call_soon_threadsafe`.
`NodeService` is the shell around it: control socket (zmq ROUTER), Load publisher, /metrics, etcd
registration + cluster view, and drain on SIGTERM / SIGINT / admin state "draining".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

from pdcluster.control.config import NodeConfig
from pdcluster.control.membership import Capacity, ClusterView, NodeInfo, Registration
from pdcluster.control.metrics import DeviceCollector, new_registry, serve_metrics
from pdcluster.control.protocol import Load, Message, Ping, Pong
from pdcluster.control.transport import LoadPublisher, RouterServer

log = logging.getLogger(__name__)

LOAD_INTERVAL = 0.5  # seconds between Load reports (~2 Hz)


def engine_args_from_config(config: NodeConfig, **extra: Any):
    """`engine.config.EngineArgs` for a node config (vLLM knob names map one to one)."""
    from pdcluster.engine.args import EngineArgs

    return EngineArgs(
        model=config.model,
        dtype=_resolve_dtype(config),
        device=None if config.device == "auto" else config.device,
        block_size=config.block_size,
        kv_cache_memory=config.kv_cache_memory or None,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len or None,
        enable_chunked_prefill=config.enable_chunked_prefill,
        enable_prefix_caching=config.enable_prefix_caching,
        tensor_parallel_size=config.tensor_parallel_size,
        **extra,
    )


def _resolve_dtype(config: NodeConfig) -> str:
    """dtype "auto": float32 on CPU (bf16 GEMV is slow there), else the checkpoint's dtype."""
    if config.dtype != "auto":
        return config.dtype
    if config.device in ("auto", "cpu"):
        from pdcluster.engine.device import resolve_device

        if config.device == "cpu" or resolve_device(None).type == "cpu":
            return "float32"
    try:
        with open(os.path.join(config.model, "config.json")) as f:
            cfg = json.load(f)
        return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    except (OSError, ValueError):
        return "bfloat16"


class EngineThread:
    """One thread owns the engine. Between steps it runs the callables queued by `call`/`post`;
    without work it idles on that queue. Step outputs go to `on_outputs` on the event loop."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, on_outputs: Callable[[list], None],
                 after_step: Callable[[list], None] | None = None,
                 layer_done_callback: Callable[[int], None] | None = None, idle_wait: float = 0.05) -> None:
        self.engine = engine
        self.loop = loop
        self.on_outputs = on_outputs
        self.after_step = after_step  # runs on the engine thread, before outputs reach the loop
        self.layer_done_callback = layer_done_callback
        self.idle_wait = idle_wait
        self.stats: dict[str, int] = dict(engine.get_stats())
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread; the future (of the loop) gets its result."""
        fut = self.loop.create_future()
        self._queue.put((fn, fut))
        return fut

    def post(self, fn: Callable[[Any], Any]) -> None:
        """Run `fn(engine)` on the engine thread; errors are logged. Callable from any thread."""
        self._queue.put((fn, None))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        engine = self.engine
        while not self._stop.is_set():
            self._run_commands(block=not engine.has_unfinished_requests())
            if self._stop.is_set() or not engine.has_unfinished_requests():
                self.stats = dict(engine.get_stats())
                continue
            try:
                outputs = engine.step(self.layer_done_callback)
                if self.after_step is not None:
                    self.after_step(outputs)
            except Exception as exc:  # a broken step would repeat forever: stop serving
                log.exception("engine step failed; the node stops taking requests")
                self.error = exc
                self.loop.call_soon_threadsafe(self.on_outputs, exc)
                return
            self.stats = dict(engine.get_stats())
            if outputs:
                self.loop.call_soon_threadsafe(self.on_outputs, outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._queue.get(timeout=self.idle_wait) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            try:
                result = fn(self.engine)
            except Exception as exc:
                if fut is None:
                    log.exception("engine command failed")
                else:
                    self.loop.call_soon_threadsafe(_resolve, fut, None, exc)
            else:
                if fut is not None:
                    self.loop.call_soon_threadsafe(_resolve, fut, result, None)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class NodeService:
    """Shell of a node process. Subclasses set `role`, build `self.engine`, and implement
    `handle(identity, msg)`, `num_in_flight()`, `load()` and the engine-output hook."""

    role = ""

    def __init__(self, config: NodeConfig, drain_timeout: float = 30.0) -> None:
        self.config = config
        self.node_id = config.node_id
        self.drain_timeout = drain_timeout
        self.registry = new_registry()
        self.state = "serving"  # serving | cordoned | draining
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.control = RouterServer()
        self.load_pub = LoadPublisher()
        self.view = ClusterView(config.etcd, config.cluster, registry=self.registry)
        self.registration: Registration | None = None
        self.metrics_server = None
        self.engine_thread: EngineThread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._draining_task: asyncio.Task | None = None
        self._rate_marks: dict[str, tuple[float, float]] = {}
        self.kv_bytes_moved = 0  # KV bytes sent (prefill) or received (decode), for Load.transfer_gbps
        self.registry.register(EngineStatsCollector(self.role, self.engine_stats))
        self.registry.register(DeviceCollector(self.engine_device))

    def engine_stats(self) -> dict[str, int]:
        return self.engine_thread.stats if self.engine_thread is not None else {}

    def engine_device(self) -> tuple[str, int] | None:
        """(type, index) of the engine's device; None until the subclass built its engine."""
        device = getattr(getattr(self, "engine", None), "device", None)
        return (device.type, device.index or 0) if device is not None else None

    def tokens_per_s(self, key: str) -> float:
        """Rate of the engine counter `key` since the previous call (one caller: the Load report)."""
        return self.rate(key, self.engine_stats().get(key, 0))

    def transfer_gbps(self) -> float:
        """KV transfer rate in GB/s since the previous call (one caller: the Load report)."""
        return self.rate("kv_bytes", self.kv_bytes_moved) / 1e9

    def rate(self, key: str, value: float) -> float:
        """Per-second rate of the counter `key` (now `value`) since the previous call for `key`."""
        now = time.monotonic()
        then, before = self._rate_marks.get(key, (self.started_mono, 0))
        self._rate_marks[key] = (now, value)
        return (value - before) / (now - then) if now > then and value >= before else 0.0

    # ---- subclass hooks --------------------------------------------------------------------------

    def handle(self, identity: bytes, msg: Message) -> None:
        raise NotImplementedError

    def num_in_flight(self) -> int:
        raise NotImplementedError

    def load(self) -> Load:
        raise NotImplementedError

    def capacity(self) -> Capacity:
        s = self.engine_thread.stats if self.engine_thread else {}
        return Capacity(num_blocks=int(s.get("num_total_blocks", 0)), block_size=self.config.block_size,
                        max_num_seqs=self.config.max_num_seqs)

    def node_info(self) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, role=self.role, model=self.config.model, host=self.config.host,
                        control_addr=self.control.address, load_addr=self.load_pub.address,
                        metrics_addr=f"http://{self.config.host}:{self.metrics_server.port}/metrics",
                        capacity=self.capacity(), started_at=self.started_at)

    async def on_start(self) -> None:
        """Subclass setup that needs the running loop (before registration)."""

    async def on_stop(self) -> None:
        """Subclass teardown after the node left etcd."""

    # ---- lifecycle -------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run until drained (SIGTERM / SIGINT / admin drain) or `stop()`."""
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        host = self.config.host
        self.control.bind(f"tcp://{host}:{self.config.control_port}")
        self.load_pub.bind(f"tcp://{host}:{self.config.load_port}")
        self.metrics_server = serve_metrics(self.registry, self.config.metrics_port, host=host)
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.loop.add_signal_handler(sig, self.begin_drain, f"signal {sig.name}")
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        await self.on_start()
        self.view.add_listener(self._on_view_change)
        await self.view.start(wait=5.0)
        self.registration = Registration(self.config.etcd, self.config.cluster, self.node_info(),
                                         ttl=self.config.lease_ttl, registry=self.registry)
        if not await self.registration.start(wait=10.0):
            log.warning("%s: not registered in etcd yet (%s); serving and retrying", self.node_id, self.config.etcd)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="control"),
                       asyncio.create_task(self.load_pub.run(self._load_snapshot, LOAD_INTERVAL), name="load")]
        log.info("%s node %s serving: control %s, load %s, metrics :%d", self.role, self.node_id,
                 self.control.address, self.load_pub.address, self.metrics_server.port)
        try:
            await self._stopped.wait()
        finally:
            await self._shutdown()

    def begin_drain(self, reason: str = "") -> None:
        """Stop admitting; finish in-flight work; leave etcd; stop. Idempotent."""
        if self._draining_task is not None or self.loop is None:
            return
        log.info("%s: draining (%s), %d request(s) in flight", self.node_id, reason, self.num_in_flight())
        self.state = "draining"
        self.load_pub.publish(self._load_snapshot())  # routers stop picking this node now
        self._draining_task = self.loop.create_task(self._drain())

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.num_in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_in_flight():
            log.warning("%s: drain timeout with %d request(s) still in flight", self.node_id, self.num_in_flight())
        self.stop()

    async def _shutdown(self) -> None:
        if self.registration is not None:
            await self.registration.deregister()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.view.stop()
        await self.on_stop()
        if self.engine_thread is not None:
            self.engine_thread.stop()
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
                else:
                    self.handle(identity, msg)
            except Exception:  # one bad message must not stop the node
                log.exception("%s: handling %s failed", self.node_id, msg.TYPE)

    def _load_snapshot(self) -> Load:
        load = self.load()
        load.state = self.state
        load.timestamp = time.time()
        return load

    def _on_view_change(self, event: str, node_id: str | None) -> None:
        if event.startswith("node_") and node_id != self.node_id:
            self.on_peer_change(event, node_id)
        if node_id not in (None, self.node_id):
            return
        admin = self.view.admin_state(self.node_id)
        if admin == "draining":
            self.begin_drain("admin state draining")
        elif self.state != "draining":
            self.state = "cordoned" if admin == "cordoned" else "serving"

    def on_peer_change(self, event: str, node_id: str) -> None:
        """A peer joined, changed or left the view (decode nodes watch their prefill peers)."""


def run_service(service_factory: Callable[[], NodeService]) -> int:
    """Build the node (loads the model) and serve it on a fresh event loop; the process exit code."""
    try:
        service = service_factory()
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    asyncio.run(service.serve())
    return 0


class EngineStatsCollector:
    """Prometheus collector reading the engine thread's latest stats at scrape time (no polling lag)."""

    def __init__(self, role: str, stats: Callable[[], dict[str, int]]) -> None:
        self.role = role
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        total, free = s.get("num_total_blocks", 0), s.get("num_free_blocks", 0)
        query = s.get("prefix_cache_query_tokens", 0)
        gauges = {
            "pdcluster_node_running_requests": ("sequences in the running batch", s.get("num_running", 0)),
            "pdcluster_node_waiting_requests": ("sequences queued in the engine", s.get("num_waiting", 0)),
            "pdcluster_node_kv_blocks_total": ("KV pool size in blocks", total),
            "pdcluster_node_kv_blocks_free": ("free KV blocks (prefix-cached unreferenced ones count as free)", free),
            "pdcluster_node_kv_blocks_used": ("KV blocks in use", total - free),
            "pdcluster_node_kv_blocks_reserved": ("KV blocks reserved for incoming transfers",
                                                  s.get("num_reserved_blocks", 0)),
            "pdcluster_node_prefix_cache_hit_ratio": ("prompt tokens served by the prefix cache / prompt tokens",
                                                      s.get("prefix_cache_hit_tokens", 0) / query if query else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pdcluster_node_preemptions": ("sequences preempted for lack of KV blocks", "num_preemptions"),
            "pdcluster_node_prefill_tokens": ("prompt tokens computed", "num_prefill_tokens"),
            "pdcluster_node_decode_tokens": ("decode tokens computed", "num_decode_tokens"),
            "pdcluster_node_engine_steps": ("engine steps run", "num_steps"),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
