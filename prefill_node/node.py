"""The prefill node: runs prompts (max_tokens=1, blocks held) and writes their KV into a decode
node's reserved blocks, layer by layer while the next layer computes.

Threads: the asyncio loop (control socket, Load, deadlines), a small pool that opens the connection to
each job's KV receiver before the job reaches the engine (one connect per receiver at a time; a receiver
that does not answer within `kv_connect_timeout` fails only its own jobs), the engine thread (steps; starts
each transfer and queues layer writes from the engine's KV-connector hooks, on connections already open:
it never connects), and a small pool that waits for the receivers' checksum acks, then releases the held
blocks (they stay in the prefix cache) and answers the decode node with `PrefillDone`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdcluster.control.protocol import Abort, Load, Message, Prefill, PrefillDone
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.engine_thread import EngineThread
from pdcluster.engine.kv_connector import KVConnector, PromptInStep
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.kv_transfer import Destination, KVSender, Transfer
from pdcluster.node.config import NodeConfig, engine_args_from_config
from pdcluster.node.service import NodeService
from pdcluster.prefill_node.metrics import PrefillMetrics

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    rid: str
    decode: bytes  # zmq identity of the decode node's DEALER
    prompt_ids: list[int]
    dst: Destination
    skip_blocks: int
    deadline: float  # time.monotonic() seconds, from the Prefill message's timeout_s at receipt
    state: str = "connecting"  # connecting (to the KV receiver) | queued (engine) | sending (ack awaited) | done
    transfer: Transfer | None = None
    transfer_error: str | None = None
    nbytes: int = 0
    first_write: float = 0.0
    aborted: bool = False


class PrefillNode(NodeService):
    role = "prefill"

    def __init__(self, config: NodeConfig, max_jobs: int | None = None, layerwise: bool = True,
                 drain_timeout: float | None = None) -> None:
        super().__init__(config, drain_timeout=config.drain_timeout if drain_timeout is None else drain_timeout)
        self.metrics = PrefillMetrics(self.registry)
        self.engine = LLMEngine(engine_args_from_config(config), kv_connector=TransferConnector(self))
        self.block_size = self.engine.block_size
        self.num_layers = self.engine.model_config.num_layers
        self.sender = KVSender(self.engine.kv_pool.tensor, backend=config.kv_backend,
                               connect_timeout=config.kv_connect_timeout, auth_key=self.kv_key)
        self.layerwise = layerwise
        self.max_jobs = max_jobs or 2 * config.max_num_seqs
        self.jobs: dict[str, PrefillJob] = {}  # loop side: not yet answered
        self._engine_jobs: dict[str, PrefillJob] = {}  # engine-thread side: in the engine or sending
        self._acks = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-ack")
        self.kv_connect_timeout = config.kv_connect_timeout
        self.kv_ack_timeout = config.kv_ack_timeout
        self._connects = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-connect")
        self._connecting: dict[str, asyncio.Future] = {}  # receiver address -> its connect in flight
        self._admitting: set[asyncio.Task] = set()

    async def on_start(self) -> None:
        self.engine_thread = EngineThread(self.engine, self._after_step)
        self.engine_thread.start()
        self._tasks_extra = [self.supervised(self._deadline_loop(), "deadlines")]

    async def on_stop(self) -> None:
        for task in self._tasks_extra:
            task.cancel()
        await asyncio.gather(*self._tasks_extra, return_exceptions=True)
        self._acks.shutdown(wait=True, cancel_futures=False)
        self._connects.shutdown(wait=False, cancel_futures=True)   # a connect in flight ends by its timeout
        self.sender.close()

    def num_in_flight(self) -> int:
        return len(self.jobs)

    def load(self) -> Load:
        s = self.engine_stats()
        queued = sum(len(j.prompt_ids) for j in self.jobs.values() if j.state in ("connecting", "queued"))
        return Load(node_id=self.node_id, role=self.role, running=s.num_running, waiting=s.num_waiting,
                    free_blocks=s.num_free_blocks, total_blocks=s.num_total_blocks, block_size=self.block_size,
                    queued_prefill_tokens=queued, tokens_per_s=self.rate("tokens", s.num_prefill_tokens),
                    transfer_gbps=self.transfer_gbps(), cached_block_hashes=self.cached_block_hashes())

    # ---- messages (loop) ----------------------------------------------------------------------------

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Prefill):
            self._on_prefill(identity, msg)
        elif isinstance(msg, Abort):
            job = self.jobs.get(msg.rid)
            if job is not None and job.decode != identity:   # only the decode node that sent the Prefill may abort
                self.control.dropped.drop(f"Abort of request {msg.rid} from a peer that did not send it")
                return
            self._abort(msg.rid, "aborted by the decode node")
        else:
            log.warning("prefill node: dropped unexpected %s message", msg.TYPE)

    def _reply_error(self, identity: bytes, rid: str, error: str, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        self.control.send(identity, PrefillDone(rid=rid, error=error))

    def _on_prefill(self, identity: bytes, msg: Prefill) -> None:
        if self.state != "serving" or (self.engine_thread and self.engine_thread.error):
            self._reply_error(identity, msg.rid, f"prefill node {self.node_id} is {self.state}", "rejected")
            return
        if len(self.jobs) >= self.max_jobs:
            self._reply_error(identity, msg.rid, f"prefill queue full ({len(self.jobs)} prompts)", "rejected")
            return
        if msg.rid in self.jobs:
            log.warning("prefill node: duplicate request id %s dropped", msg.rid)
            return
        try:
            dst = Destination.from_dict(msg.dst)
            sampling = dict(msg.sampling)
            sampling["max_tokens"] = 1  # the first token only; the decode node samples the rest
            sampling["min_tokens"] = min(int(sampling.get("min_tokens", 0)), 1)
            params = SamplingParams.from_dict(sampling)
            num_blocks = -(-len(msg.prompt_ids) // self.block_size)
            if not 0 <= msg.skip_blocks < num_blocks or len(dst.block_ids) != num_blocks - msg.skip_blocks:
                raise ValueError(f"dst.block_ids: {len(dst.block_ids)} blocks after skipping {msg.skip_blocks} "
                                 f"do not match a {len(msg.prompt_ids)}-token prompt of {num_blocks} blocks")
        except (ValueError, TypeError) as exc:
            self._reply_error(identity, msg.rid, f"bad Prefill: {exc}", "error")
            return
        job = PrefillJob(rid=msg.rid, decode=identity, prompt_ids=list(msg.prompt_ids), dst=dst,
                         skip_blocks=msg.skip_blocks, deadline=time.monotonic() + msg.timeout_s)
        self.jobs[job.rid] = job
        log.info("prefill %s queued: %d prompt tokens (%d blocks cached on the decode node) for %s",
                 job.rid, len(job.prompt_ids), job.skip_blocks, msg.decode_node, extra={"request_id": job.rid})
        task = asyncio.create_task(self._admit(job, params), name=f"admit:{job.rid}")
        self._admitting.add(task)
        task.add_done_callback(self._admitting.discard)

    async def _admit(self, job: PrefillJob, params: SamplingParams) -> None:
        """Connect to the job's KV receiver (off the engine thread), then hand the prompt to the engine."""
        try:
            await asyncio.wait_for(asyncio.shield(self._connect(job.dst)), self.kv_connect_timeout)
        except Exception as exc:
            detail = f"no connection within {self.kv_connect_timeout} s" if isinstance(
                exc, asyncio.TimeoutError) else str(exc)
            self._answer(job, error=f"kv destination {job.dst.address} unreachable: {detail}")
            return
        if self.jobs.get(job.rid) is not job:   # aborted, or its deadline passed, meanwhile
            return
        job.state = "queued"

        def add(engine: LLMEngine) -> None:
            engine.add_request(job.rid, job.prompt_ids, params, hold_blocks=True)
            self._engine_jobs[job.rid] = job

        try:
            await self.engine_thread.call(add)
        except Exception as exc:
            self._answer(job, error=f"engine refused: {exc}")

    def _connect(self, dst: Destination) -> asyncio.Future:
        """The connect to dst's receiver in flight (one per receiver; jobs to it share it), or a new one."""
        fut = self._connecting.get(dst.address)
        if fut is None:
            fut = self._connecting[dst.address] = self.loop.run_in_executor(self._connects, self.sender.connect, dst)
            fut.add_done_callback(lambda f: self._connected(dst.address, f))
        return fut

    def _connected(self, address: str, fut: asyncio.Future) -> None:
        self._connecting.pop(address, None)
        if not fut.cancelled() and fut.exception() is not None:   # retrieved here: its jobs may all have given up
            log.warning("kv receiver %s: %s", address, fut.exception())

    def _abort(self, rid: str, reason: str) -> None:
        job = self.jobs.get(rid)
        if job is None:
            return
        job.aborted = True
        self.engine_thread.post(lambda e: self._abort_in_engine(e, job, reason))
        self._answer(job, error=reason, outcome="aborted")

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for job in [j for j in self.jobs.values() if now > j.deadline]:
                self._abort(job.rid, "deadline exceeded")

    def _answer(self, job: PrefillJob, out: RequestOutput | None = None, checksum: int = 0,
                error: str | None = None, outcome: str | None = None) -> None:
        """Reply once per job (late completions of aborted jobs are dropped)."""
        if self.jobs.get(job.rid) is not job:
            return
        del self.jobs[job.rid]
        self.metrics.requests.labels(outcome or ("error" if error else "ok")).inc()
        if error is not None:
            log.info("prefill %s %s: %s", job.rid, outcome or "failed", error, extra={"request_id": job.rid})
            self.control.send(job.decode, PrefillDone(rid=job.rid, error=error,
                                                      kv_backend=job.transfer.backend if job.transfer else ""))
            return
        lp = out.logprobs[0] if out.logprobs else None
        log.info("prefill %s done: %d KV bytes via %s, %d tokens from the prefix cache", job.rid, job.nbytes,
                 job.transfer.backend, out.num_cached_tokens, extra={"request_id": job.rid})
        self.control.send(job.decode, PrefillDone(
            rid=job.rid, first_token=int(out.new_token_ids[0]), checksum=checksum,
            logprobs=[[float(lp[0]), [[int(t), float(v)] for t, v in lp[1]]]] if lp is not None else None,
            num_cached_tokens=out.num_cached_tokens, kv_backend=job.transfer.backend))

    def _on_engine_failure(self) -> None:
        for job in list(self.jobs.values()):
            self._answer(job, error="prefill engine failure")
        self.exit_code = 1   # a failed engine: exit non-zero, so systemd restarts the node
        self.begin_drain("engine failure")

    # ---- engine thread -------------------------------------------------------------------------------

    def _start_transfer(self, job: PrefillJob, block_table: list[int]) -> None:
        num_blocks = -(-len(job.prompt_ids) // self.block_size)
        src = block_table[job.skip_blocks:num_blocks]
        job.nbytes = len(src) * self.sender.layout.block_bytes
        job.first_write = time.monotonic()
        try:
            # Tensors the sender creates here (e.g. its shm mapping of the destination pool) are written by
            # its own threads, so they must be normal even if the engine thread runs under inference mode.
            with torch.inference_mode(False):
                job.transfer = self.sender.start(job.dst, src, connect=False)   # connected by _admit
        except Exception as exc:
            job.transfer_error = f"kv transfer to {job.dst.address} failed to start: {exc}"
            log.warning("request %s: %s", job.rid, job.transfer_error)

    def _after_step(self, outputs: list[RequestOutput] | BaseException) -> None:
        """Each step's outputs, on the engine thread: finished prompts (their KV is sent or failed to start)
        wait for the receiver's ack on the ack pool, which answers them."""
        if isinstance(outputs, BaseException):
            self.loop.call_soon_threadsafe(self._on_engine_failure)
            return
        for out in outputs:
            job = self._engine_jobs.get(out.request_id)
            if job is None or not out.finished:
                continue
            job.state = "sending"
            self._acks.submit(self._await_ack, job, out)

    def _await_ack(self, job: PrefillJob, out: RequestOutput) -> None:
        """On an ack thread: wait for the receiver's checksum ack, then release and answer."""
        error, checksum = job.transfer_error, 0
        backend = job.transfer.backend if job.transfer else "unknown"
        if job.transfer is not None:
            try:
                checksum = job.transfer.finish(self.kv_ack_timeout)
                self.metrics.transfers.labels(backend).inc()
                self.metrics.transfer_bytes.labels(backend).inc(job.nbytes)
                self.kv_bytes_moved += job.nbytes
                self.metrics.transfer_seconds.labels(backend).observe(time.monotonic() - job.first_write)
            except Exception as exc:
                error = f"kv transfer failed: {exc}"
        if error is not None and not job.aborted:
            self.metrics.transfer_failures.labels(backend).inc()
            log.warning("request %s: %s", job.rid, error)
        self.engine_thread.post(lambda e: self._release(e, job))
        self.loop.call_soon_threadsafe(lambda: self._answer(job, out, checksum, error))

    def _release(self, engine: LLMEngine, job: PrefillJob) -> None:
        if self._engine_jobs.pop(job.rid, None) is not None:
            engine.release(job.rid)
        job.state = "done"

    def _abort_in_engine(self, engine: LLMEngine, job: PrefillJob, reason: str) -> None:
        if job.transfer is not None:
            job.transfer.abort(reason)
        if job.state == "queued" and self._engine_jobs.pop(job.rid, None) is not None:
            engine.abort(job.rid)  # the ack waiter releases jobs that are already sending
            job.state = "done"


class TransferConnector(KVConnector):
    """The engine's hooks on the prefill node: a prompt's KV leaves for its decode node as it is computed
    (layer by layer when `node.layerwise`, else in one go once the prompt is done)."""

    def __init__(self, node: PrefillNode) -> None:
        self.node = node
        self.streaming: list[PrefillJob] = []   # jobs whose last prefill chunk runs in this step

    def on_step_start(self, prompts: list[PromptInStep]) -> None:
        self.streaming = []
        if not self.node.layerwise:
            return
        for p in prompts:
            job = self.node._engine_jobs.get(p.request_id)
            if job is not None and job.transfer is None:
                self.node._start_transfer(job, p.block_ids)
                if job.transfer is not None:
                    self.streaming.append(job)

    def on_layer_done(self, layer: int) -> None:
        for job in self.streaming:
            if not job.transfer.failed:
                job.transfer.send_layers(layer, layer + 1)

    def on_prompt_done(self, request_id: str, block_ids: list[int]) -> None:
        job = self.node._engine_jobs.get(request_id)
        if job is not None and job.transfer is None and job.transfer_error is None:   # not sent layer by layer
            self.node._start_transfer(job, block_ids)
            if job.transfer is not None:
                job.transfer.send_all()


def main(config: NodeConfig) -> int:
    from pdcluster.node.service import run_service

    return run_service(lambda: PrefillNode(config))
