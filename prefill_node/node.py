"""The prefill node: runs prompts (max_tokens=1, blocks held) and writes their KV into a decode
node's reserved blocks, layer by layer while the next layer computes.

Threads: the asyncio loop (control socket, Load, deadlines), the engine thread (steps; starts each
transfer and queues layer writes from the engine's per-layer hook), and a small pool that waits for
the receivers' checksum acks, then releases the held blocks (they stay in the prefix cache) and
answers the decode node with `PrefillDone`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdcluster.control.block_hash import block_hashes
from pdcluster.control.config import NodeConfig
from pdcluster.control.protocol import Abort, Load, Message, Prefill, PrefillDone
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.kv_transfer import Destination, KVSender, Transfer
from pdcluster.node.service import EngineThread, NodeService, engine_args_from_config
from pdcluster.prefill_node.metrics import PrefillMetrics

log = logging.getLogger(__name__)

MAX_REPORTED_HASHES = 4096  # bounded LRU of block hashes reported for prefix-aware routing
ACK_TIMEOUT = 10.0


@dataclass
class PrefillJob:
    rid: str
    decode: bytes  # zmq identity of the decode node's DEALER
    prompt_ids: list[int]
    dst: Destination
    skip_blocks: int
    deadline: float
    state: str = "queued"  # queued (engine) | sending (ack awaited) | done
    transfer: Transfer | None = None
    transfer_error: str | None = None
    nbytes: int = 0
    first_write: float = 0.0
    aborted: bool = False


class PrefillNode(NodeService):
    role = "prefill"

    def __init__(self, config: NodeConfig, max_jobs: int | None = None, layerwise: bool = True,
                 drain_timeout: float = 60.0) -> None:
        super().__init__(config, drain_timeout=drain_timeout)
        self.metrics = PrefillMetrics(self.registry)
        self.engine = LLMEngine(engine_args_from_config(config))
        self.block_size = self.engine.block_size
        self.num_layers = self.engine.model_config.num_layers
        self.sender = KVSender(self.engine.kv_pool.tensor, backend=config.kv_backend)
        self.layerwise = layerwise
        self.max_jobs = max_jobs or 2 * config.max_num_seqs
        self.jobs: dict[str, PrefillJob] = {}  # loop side: not yet answered
        self._engine_jobs: dict[str, PrefillJob] = {}  # engine-thread side: in the engine or sending
        self._layer_jobs: list[PrefillJob] = []  # jobs whose last prefill chunk runs in this step
        self._acks = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-ack")
        self.cached_hashes: OrderedDict[int, None] = OrderedDict()

    async def on_start(self) -> None:
        self.engine_thread = EngineThread(self.engine, self.loop, self._on_outputs, after_step=self._after_step,
                                          layer_done_callback=self._on_layer if self.layerwise else None)
        self.engine_thread.start()
        self._tasks_extra = [asyncio.create_task(self._deadline_loop(), name="deadlines")]

    async def on_stop(self) -> None:
        for task in self._tasks_extra:
            task.cancel()
        await asyncio.gather(*self._tasks_extra, return_exceptions=True)
        self._acks.shutdown(wait=True, cancel_futures=False)
        self.sender.close()

    def num_in_flight(self) -> int:
        return len(self.jobs)

    def load(self) -> Load:
        s = self.engine_stats()
        queued = sum(len(j.prompt_ids) for j in self.jobs.values() if j.state == "queued")
        return Load(node_id=self.node_id, role=self.role, running=s.get("num_running", 0),
                    waiting=s.get("num_waiting", 0), free_blocks=s.get("num_free_blocks", 0),
                    total_blocks=s.get("num_total_blocks", 0), block_size=self.block_size,
                    queued_prefill_tokens=queued, tokens_per_s=self.tokens_per_s("num_prefill_tokens"),
                    transfer_gbps=self.transfer_gbps(),
                    cached_block_hashes=list(self.cached_hashes))

    # ---- messages (loop) ----------------------------------------------------------------------------

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Prefill):
            self._on_prefill(identity, msg)
        elif isinstance(msg, Abort):
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
                         skip_blocks=msg.skip_blocks, deadline=msg.deadline)
        self.jobs[job.rid] = job
        log.info("prefill %s queued: %d prompt tokens (%d blocks cached on the decode node) for %s",
                 job.rid, len(job.prompt_ids), job.skip_blocks, msg.decode_node, extra={"request_id": job.rid})

        def add(engine: LLMEngine) -> None:
            engine.add_request(job.rid, job.prompt_ids, params, hold_blocks=True)
            self._engine_jobs[job.rid] = job

        fut = self.engine_thread.call(add)
        fut.add_done_callback(lambda f: f.exception() and self._answer(job, error=f"engine refused: {f.exception()}"))

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
            now = time.time()
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
        for h in block_hashes(job.prompt_ids, self.block_size):
            self.cached_hashes[h] = None
            self.cached_hashes.move_to_end(h)
        while len(self.cached_hashes) > MAX_REPORTED_HASHES:
            self.cached_hashes.popitem(last=False)
        lp = out.logprobs[0] if out.logprobs else None
        log.info("prefill %s done: %d KV bytes via %s, %d tokens from the prefix cache", job.rid, job.nbytes,
                 job.transfer.backend, out.num_cached_tokens, extra={"request_id": job.rid})
        self.control.send(job.decode, PrefillDone(
            rid=job.rid, first_token=int(out.new_token_ids[0]), checksum=checksum,
            logprobs=[[float(lp[0]), [[int(t), float(v)] for t, v in lp[1]]]] if lp is not None else None,
            num_cached_tokens=out.num_cached_tokens, kv_backend=job.transfer.backend))

    def _on_outputs(self, outputs: list[RequestOutput] | BaseException) -> None:
        if isinstance(outputs, BaseException):
            for job in list(self.jobs.values()):
                self._answer(job, error="prefill engine failure")
            self.begin_drain("engine failure")
        # successful prefills are answered by the ack waiter (_await_ack)

    # ---- engine thread -------------------------------------------------------------------------------

    def _start_transfer(self, job: PrefillJob, block_table: list[int]) -> None:
        num_blocks = -(-len(job.prompt_ids) // self.block_size)
        src = block_table[job.skip_blocks:num_blocks]
        job.nbytes = len(src) * self.sender.layout.block_bytes
        job.first_write = time.monotonic()
        try:
            # Called inside the engine's inference mode; tensors the sender creates here (e.g. its shm
            # mapping of the destination pool) are written by its own threads, so they must be normal.
            with torch.inference_mode(False):
                job.transfer = self.sender.start(job.dst, src)
        except Exception as exc:
            job.transfer_error = f"kv transfer to {job.dst.address} failed to start: {exc}"
            log.warning("request %s: %s", job.rid, job.transfer_error)

    def _on_layer(self, layer: int) -> None:
        if layer == 0:
            self._layer_jobs = []
            batch = self.engine.current_batch
            for seq, n in zip(batch.seqs if batch else (), batch.num_new_tokens if batch else ()):
                job = self._engine_jobs.get(seq.request_id)
                if job is not None and job.transfer is None and seq.num_computed_tokens + n >= seq.num_prompt_tokens:
                    self._start_transfer(job, seq.block_table)
                    if job.transfer is not None:
                        self._layer_jobs.append(job)
        for job in self._layer_jobs:
            if not job.transfer.failed:
                job.transfer.send_layers(layer, layer + 1)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        self._layer_jobs = []
        for out in outputs:
            job = self._engine_jobs.get(out.request_id)
            if job is None or not out.finished:
                continue
            if job.transfer is None and job.transfer_error is None:  # not sent layer by layer
                self._start_transfer(job, out.block_ids or [])
                if job.transfer is not None:
                    job.transfer.send_all()
            job.state = "sending"
            self._acks.submit(self._await_ack, job, out)

    def _await_ack(self, job: PrefillJob, out: RequestOutput) -> None:
        """On an ack thread: wait for the receiver's checksum ack, then release and answer."""
        error, checksum = job.transfer_error, 0
        backend = job.transfer.backend if job.transfer else "unknown"
        if job.transfer is not None:
            try:
                checksum = job.transfer.finish(ACK_TIMEOUT)
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


def main(config: NodeConfig) -> int:
    from pdcluster.node.service import run_service

    return run_service(lambda: PrefillNode(config))
