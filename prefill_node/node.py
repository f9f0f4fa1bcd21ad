"""The prefill node: runs prompts (max_tokens=1, blocks held) and writes their KV into a decode
node's reserved blocks, layer by layer while the next layer computes.

Threads: the asyncio loop (control socket, Load, deadlines, every `PrefillJob`: prefill_node/job.py), a
small pool that opens the connection to each job's KV receiver before the job reaches the engine (one connect
per receiver at a time; a receiver that does not answer within `kv_connect_timeout` fails only its own jobs),
the engine thread (steps; `TransferConnector` starts each transfer and queues layer writes from the engine's
KV-connector hooks, on connections already open: it never connects, and hands each transfer to the loop
when its prompt is done), and a small pool that waits for the receivers' checksum acks for the loop, which
then frees the held blocks (they stay in the prefix cache) and answers the decode node with `PrefillDone`.

A decode node sends its prompt before its engine has reserved the KV blocks (`Prefill` with no `dst`) and their
destination once reserved (`PrefillDestination`): the prompt enters the engine at once and its transfer starts
when the destination comes (prefill_node/connector.py), so the reservation overlaps the prefill.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Mapping

from pdcluster.control.protocol import (
    Load,
    Message,
    Prefill,
    PrefillDestination,
    PrefillDone,
    Progress,
    logprob_to_wire,
)
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.threads import started_pool
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.kv_transfer import Destination, KVSender
from pdcluster.kv_transfer.per_rank import RankedSender, RankLinks
from pdcluster.node.config import NodeConfig, engine_args_from_config
from pdcluster.node.rank_kv import RankKV
from pdcluster.node.service import NodeService
from pdcluster.prefill_node.connector import TransferConnector, start_transfer
from pdcluster.prefill_node.job import JobState, Outgoing, PrefillJob
from pdcluster.prefill_node.metrics import PrefillMetrics

log = logging.getLogger(__name__)

RENEW_SWEEP = 0.25  # seconds between checks for jobs whose deadline to renew
ROUTE_GRACE_S = 1.0  # a done prompt waits for its destination until its deadline, and this (its expiry answers it)


def pushes_while_computing(engine: LLMEngine) -> bool:
    """Whether sending a prompt's KV layer by layer overlaps its compute: on an accelerator (the copies are the
    device's) or on more than one CPU core (the send thread has one to run on). A node on one CPU core copies on the
    core that computes either way, and 30-odd hand-offs to the send thread per prompt cost its first token more than
    one copy at its end (128-token prompts: 95 against 107 ms, docs/benchmarks.md)."""
    return engine.device.type != "cpu" or engine.tp_size > 1 or len(os.sched_getaffinity(0)) > 1


class PrefillNode(NodeService):
    role = "prefill"
    upstream = "decode node"

    def __init__(self, config: NodeConfig, max_jobs: int | None = None, layerwise: bool = True) -> None:
        self.connector = TransferConnector(layerwise, self._handover)
        super().__init__(config, LLMEngine(engine_args_from_config(config), kv_connector=self.connector))
        self.metrics = PrefillMetrics(self.registry)
        self.block_size = self.engine.block_size
        self.num_layers = self.engine.model_config.num_layers
        # A pool sliced per rank: every rank sends its own slice (pdcluster/node/rank_kv.py), rank 0 drives them
        self.rank_kv = RankKV.start(self.engine, config, self.kv_key, receive=False) \
            if self.engine.rank_sliced_pool else None
        local = KVSender(self.engine.kv_pool.tensor, backend=config.kv_backend,
                         connect_timeout=config.kv_connect_timeout, auth_key=self.kv_key,
                         total_kv_heads=self.engine.kv_pool.model_kv_heads,
                         rank_slice=self.rank_kv.rank_slice if self.rank_kv else None)
        # One pool: a one-rank RankedSender, so that a decode pool sliced per rank gets each slice its heads (a
        # destination of one pool is the local sender's own transfer)
        self.sender: RankedSender = self.rank_kv.sender(local) if self.rank_kv else \
            RankedSender(local, RankLinks([]), self.engine.tell_rank_agent)
        self.connector.sender = self.sender
        self.connector.layerwise = layerwise and pushes_while_computing(self.engine)
        log.info("prefill node: KV pushed %s", "layer by layer as it is computed" if self.connector.layerwise
                 else "once each prompt is done (one core: the copy cannot overlap the compute)")
        self.max_jobs = max_jobs or 2 * config.max_num_seqs
        self.jobs: dict[str, PrefillJob] = {}  # not yet answered (CONNECTING, QUEUED, SENDING)
        self._held: dict[str, PrefillJob] = {}  # their request is in the engine (QUEUED, SENDING, ABANDONED)
        self.kv_connect_timeout = config.kv_connect_timeout
        self.kv_ack_timeout = config.kv_ack_timeout
        self._acks = started_pool(4, "kv-ack")
        self._connects = started_pool(8, "kv-connect")
        self._connecting: dict[str, asyncio.Future] = {}  # receiver address -> its connect in flight
        self._tasks_extra: set[asyncio.Task] = set()   # admissions and ack waits in flight
        self._renewed_at_step = -1   # the engine's step count at the last renewal

    def on_peer_change(self, event: str, node_id: str) -> None:
        """A decode node left: forget the KV connections of every receiver no longer in the view (a restarted
        node has a new address; off the loop, since closing a collective's group may block)."""
        if event == "node_removed":
            live = [n.kv_addr for n in self.view.nodes_by_role("decode")]
            self._connects.submit(self.sender.keep_peers, live)

    def kv_sender(self) -> RankedSender:
        return self.sender

    async def on_start(self) -> None:
        self.start_engine_thread()
        self._tasks_extra.add(self.supervised(self._renew_loop(), "renew"))   # cancelled by on_stop

    async def on_stop(self) -> None:
        for task in self._tasks_extra:
            task.cancel()
        await asyncio.gather(*self._tasks_extra, return_exceptions=True)
        self._acks.shutdown(wait=True, cancel_futures=False)
        self._connects.shutdown(wait=False, cancel_futures=True)   # a connect in flight ends by its timeout
        self.sender.close()
        if self.rank_kv is not None:
            self.rank_kv.close()

    def in_flight(self) -> Mapping[str, PrefillJob]:
        return self.jobs

    def load(self) -> Load:
        s = self.engine_stats()
        queued = sum(len(j.prompt_ids) for j in self.jobs.values() if j.queued)
        return Load(node_id=self.node_id, role=self.role, running=s.num_running, waiting=s.num_waiting,
                    free_blocks=s.num_free_blocks, total_blocks=s.num_total_blocks, block_size=self.block_size,
                    queued_prefill_tokens=queued, tokens_per_s=s.tokens_per_s,
                    prefill_tokens_per_s=self.rate("prefill_tokens", s.num_prefill_tokens),
                    transfer_gbps=self.transfer_gbps(), **self.kv_report())

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks_extra.add(task)
        task.add_done_callback(self._tasks_extra.discard)

    # ---- messages (loop) ----------------------------------------------------------------------------

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Prefill):
            self._on_prefill(identity, msg)
        elif isinstance(msg, PrefillDestination):
            self._on_destination(identity, msg)
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
            num_blocks = -(-len(msg.prompt_ids) // self.block_size)
            dst = self._destination(msg.dst, msg.skip_blocks, len(msg.prompt_ids)) if msg.dst else None
            sampling = dict(msg.sampling)
            sampling["max_tokens"] = 1  # the first token only; the decode node samples the rest
            sampling["min_tokens"] = min(int(sampling.get("min_tokens", 0)), 1)
            params = SamplingParams.from_dict(sampling)
        except (ValueError, TypeError) as exc:
            self._reply_error(identity, msg.rid, f"bad Prefill: {exc}", "error")
            return
        job = PrefillJob(rid=msg.rid, owner=identity, prompt_ids=list(msg.prompt_ids), dst=dst,
                         skip_blocks=msg.skip_blocks, deadline=time.monotonic() + msg.timeout_s,
                         timeout_s=msg.timeout_s,
                         lora=self.loras.request(msg.lora_name, msg.lora_path) if msg.lora_name else None,
                         lora_hash=msg.lora_hash)
        self.jobs[job.rid] = job
        log.info("prefill %s queued: %d prompt tokens (%s) for %s", job.rid, len(job.prompt_ids),
                 f"{job.skip_blocks} blocks cached on the decode node" if dst else "destination to follow",
                 msg.decode_node, extra={"request_id": job.rid})
        self._spawn(self._admit(job, params, num_blocks), f"admit:{job.rid}")

    def _destination(self, d: dict, skip_blocks: int, num_tokens: int) -> Destination:
        """`d` parsed, its blocks checked against the prompt's (ValueError, TypeError)."""
        dst = Destination.from_dict(d)
        num_blocks = -(-num_tokens // self.block_size)
        if not 0 <= skip_blocks < num_blocks or len(dst.block_ids) != num_blocks - skip_blocks:
            raise ValueError(f"dst.block_ids: {len(dst.block_ids)} blocks after skipping {skip_blocks} "
                             f"do not match a {num_tokens}-token prompt of {num_blocks} blocks")
        return dst

    def _on_destination(self, identity: bytes, msg: PrefillDestination) -> None:
        """The destination of a prompt sent before it: only its owner's, once; a bad one fails the prompt."""
        job = self.jobs.get(msg.rid)
        if job is None or job.owner != identity or job.dst is not None:
            self.control.dropped.drop(f"PrefillDestination of {msg.rid}: not a prompt of that peer awaiting one")
            return
        try:
            dst = self._destination(msg.dst, msg.skip_blocks, len(job.prompt_ids))
        except (ValueError, TypeError) as exc:
            self._drop(job, f"bad PrefillDestination: {exc}", "error")
            return
        job.dst, job.skip_blocks = dst, msg.skip_blocks
        self._spawn(self._route(job), f"route:{job.rid}")

    async def _route(self, job: PrefillJob) -> None:
        """Connect to the destination's receiver, then hand it to the prompt's transfer: to the engine thread's
        `Outgoing` while the prompt is in the engine (`first_block` before `dst`: `dst` is what it looks at), or,
        done already, start the transfer from here."""
        if not await self._reached(job):
            return
        out = job.unrouted
        if job.answered or out is None:   # aborted or expired meanwhile, or still connecting (it routes itself)
            return
        job.unrouted = None
        out.first_block = job.skip_blocks
        out.dst = job.dst
        if job.outgoing is not None:
            await self._start_after_prompt(job)

    async def _start_after_prompt(self, job: PrefillJob) -> None:
        """The prompt was done before its destination came: every layer of its KV goes at once, started on the
        engine thread between steps (where every transfer starts; a pool sliced per rank tells its other ranks
        there). Its ack waiter goes on once the start is done."""
        out = job.outgoing
        assert out is not None and out.src_blocks is not None
        blocks = out.src_blocks

        def start(engine: LLMEngine) -> None:
            if out.transfer is None and out.error is None:
                transfer = start_transfer(self.sender, out, blocks)
                if transfer is not None:
                    transfer.send_all()

        job.starting = True
        try:
            await self.engine_thread.call(start)
        except Exception as exc:
            out.error = out.error or f"kv transfer failed to start: {exc}"
        finally:
            job.starting = False
        if job.answered and out.transfer is not None:   # aborted or expired meanwhile
            out.transfer.abort("aborted")
        job.routed.set()

    async def _admit(self, job: PrefillJob, params: SamplingParams, num_blocks: int) -> None:
        """Connect to the job's KV receiver (off the engine thread), then hand the prompt to the engine (under its
        LoRA adapter, loaded first if need be; one whose content differs from the decode node's is refused)."""
        if job.lora is not None:
            name = job.lora.lora_name
            try:
                digest = await self.loras.load(name, job.lora.lora_path)
                if job.lora_hash and digest != job.lora_hash:
                    raise ValueError(f"this node's adapter of that name differs ({digest[:12]} != "
                                     f"{job.lora_hash[:12]})")
            except Exception as exc:
                self._answer(job, error=f"LoRA adapter {name!r}: {exc}")
                return
        if job.dst is not None and not await self._reached(job):   # with the prompt: connect first (else _route)
            return
        if job.answered:   # aborted, or its deadline passed, meanwhile
            return
        job.move(JobState.QUEUED)
        self._held[job.rid] = job
        rid, prompt, lora = job.rid, job.prompt_ids, job.lora
        outgoing = Outgoing(rid, job.dst, first_block=job.skip_blocks, num_blocks=num_blocks)   # the engine's now
        if job.dst is None:   # (one that came while the LoRA adapter loaded is in `outgoing` already)
            job.unrouted = outgoing

        def add(engine: LLMEngine) -> None:
            engine.add_request(rid, prompt, params, hold_blocks=True, lora=lora)
            self.connector.add(outgoing)

        try:
            await self.engine_thread.call(add)
        except Exception as exc:
            self._held.pop(rid, None)
            self._answer(job, error=f"engine refused: {exc}")

    async def _reached(self, job: PrefillJob) -> bool:
        """Whether the connection to the job's KV receiver is open (opened now if need be); if not, the job is
        answered with why."""
        assert job.dst is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._connect(job.dst)), self.kv_connect_timeout)
            return True
        except Exception as exc:
            detail = f"no connection within {self.kv_connect_timeout} s" if isinstance(
                exc, asyncio.TimeoutError) else str(exc)
            if not job.answered:
                self._drop(job, f"kv destination {job.dst.address} unreachable: {detail}", "error")
            return False

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

    def abort(self, rid: str, reason: str, expired: bool = False) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            self._drop(job, reason, "aborted")

    def _drop(self, job: PrefillJob, reason: str, outcome: str) -> None:
        """Answer `job` with `reason`, dropping what it has in the engine or on the wire."""
        rid = job.rid
        if job.state is JobState.QUEUED:   # in the engine: drop it there (and its transfer, if it started)
            self._held.pop(rid, None)

            def drop(engine: LLMEngine) -> None:
                self.connector.abort(rid, reason)
                engine.abort(rid)

            self.engine_thread.post(drop)
        elif job.state is JobState.SENDING and job.outgoing is not None and job.outgoing.transfer is not None:
            job.outgoing.transfer.abort(reason)   # the ack waiter returns and frees the blocks
        self._answer(job, error=reason, outcome=outcome)

    def _answer(self, job: PrefillJob, out: RequestOutput | None = None, checksum: int = 0,
                error: str | None = None, outcome: str | None = None) -> None:
        """Reply once per job (late completions of answered jobs are dropped)."""
        if self.jobs.get(job.rid) is not job:
            return
        del self.jobs[job.rid]
        if not job.starting:   # an ack waiter still waiting for the destination goes on (and frees the blocks)
            job.routed.set()
        job.outcome = outcome or ("error" if error else "ok")
        # answered while sending by other than its ack waiter: the blocks wait for that
        job.move(JobState.ABANDONED if job.state is JobState.SENDING and outcome else JobState.DONE)
        self.metrics.requests.labels(job.outcome).inc()
        outgoing = job.outgoing
        transfer = outgoing.transfer if outgoing is not None else None
        if error is not None or out is None or outgoing is None or transfer is None:
            log.info("prefill %s %s: %s", job.rid, outcome or "failed", error, extra={"request_id": job.rid})
            self.control.send(job.owner, PrefillDone(rid=job.rid, error=error or "no kv transfer",
                                                     kv_backend=transfer.backend if transfer else ""))
            return
        lp = out.logprobs[0] if out.logprobs else None
        log.info("prefill %s done: %d KV bytes via %s, %d tokens from the prefix cache", job.rid,
                 outgoing.nbytes, transfer.backend, out.num_cached_tokens, extra={"request_id": job.rid})
        start, dtype, features = out.prompt_features or (0, "", b"")
        self.control.send(job.owner, PrefillDone(
            rid=job.rid, first_token=int(out.new_token_ids[0]), checksum=checksum,
            logprobs=[logprob_to_wire(lp)] if lp is not None else None,
            num_cached_tokens=out.num_cached_tokens, kv_backend=transfer.backend,
            features=features, features_dtype=dtype, features_start=start))

    def on_engine_failure(self) -> None:
        for job in list(self.jobs.values()):
            self._answer(job, error="prefill engine failure")

    # ---- queued jobs stay alive while the engine works through them (loop) ----------------------------

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(RENEW_SWEEP)
            self.renew()

    def renew(self) -> None:
        """A prompt may wait in this node's queue longer than its timeout when prompts come faster than this node
        prefills them. While the engine advances (a step done since the last renewal), each job in the engine
        past a quarter of its timeout gets it afresh, here (its deadline, its destination's) and on its decode
        node, which hears `Progress` and extends its wait and its KV reservation. A node whose engine is stuck
        renews nothing: its jobs expire and their decode nodes prefill them themselves, as before."""
        steps = self.engine_stats().num_steps
        if steps == self._renewed_at_step:
            return
        now = time.monotonic()
        due: dict[bytes, list[PrefillJob]] = {}
        for job in self._held.values():
            if job.state is JobState.QUEUED and job.timeout_s > 0 and job.deadline - now < 0.75 * job.timeout_s:
                due.setdefault(job.owner, []).append(job)
        if not due:
            return
        self._renewed_at_step = steps
        for owner, jobs in due.items():
            for job in jobs:
                job.deadline = now + job.timeout_s
                if job.dst is not None:   # the started transfer's too: its sender reads one float, later now
                    job.dst.renew(job.timeout_s)
            self.control.send(owner, Progress(rids=[j.rid for j in jobs], states=["prefilling"] * len(jobs)))

    # ---- a prompt done: its KV handed over, its ack awaited, its blocks freed (loop) ---------------------

    def _handover(self, outgoing: Outgoing) -> None:
        """The connector's, on the engine thread: the prompt is done; its transfer is the loop's now. Queued
        before the step's outputs, so the loop has it when the finished output comes."""
        self.loop.call_soon_threadsafe(self._handed_over, outgoing)

    def _handed_over(self, outgoing: Outgoing) -> None:
        job = self._held.get(outgoing.rid)
        if job is None or job.state is not JobState.QUEUED:   # aborted as the prompt finished
            if outgoing.transfer is not None:
                outgoing.transfer.abort("aborted")
            return
        job.outgoing = outgoing
        if outgoing.transfer is not None or outgoing.error is not None:
            job.routed.set()
        elif outgoing.dst is not None:   # came as the prompt ended, too late for the engine thread
            self._spawn(self._start_after_prompt(job), f"route:{job.rid}")
        # else: _route starts it when the destination comes

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            job = self._held.get(out.request_id)
            if job is None or not out.finished or job.state is not JobState.QUEUED:
                continue
            job.move(JobState.SENDING)
            self._spawn(self._await_ack(job, out), f"kv-ack:{job.rid}")

    async def _await_ack(self, job: PrefillJob, out: RequestOutput) -> None:
        """Wait for the transfer to start (a destination that comes after the prompt is done), then (on the ack
        pool) for the receiver's checksum ack; then free the blocks and answer."""
        try:   # an answer (abort, expiry) sets it too
            await asyncio.wait_for(job.routed.wait(), max(0.0, job.deadline - time.monotonic()) + ROUTE_GRACE_S)
        except asyncio.TimeoutError:
            pass
        outgoing = job.outgoing or Outgoing(job.rid, job.dst, job.skip_blocks, 0, error="kv transfer never started")
        error, checksum = outgoing.error, 0
        if outgoing.transfer is None and error is None:
            error = "no kv destination in time"
        transfer = outgoing.transfer
        backend = transfer.backend if transfer is not None else "unknown"
        if transfer is not None:
            try:
                checksum = await self.loop.run_in_executor(self._acks, transfer.finish, self.kv_ack_timeout)
                self.metrics.transfers.labels(backend).inc()
                # the wire's bytes, as the decode node counts them (not the connector's estimate: a rank slice holding
                # a copy of a head another slice sends sends nothing, a slice filling several receiving pools more)
                outgoing.nbytes = transfer.sent_bytes
                self.metrics.transfer_bytes.labels(backend).inc(outgoing.nbytes)
                self.kv_bytes_moved += outgoing.nbytes
                self.metrics.transfer_seconds.labels(backend).observe(time.monotonic() - outgoing.first_write)
            except Exception as exc:
                error = f"kv transfer failed: {exc}"
        if error is not None and job.state is JobState.SENDING:
            self.metrics.transfer_failures.labels(backend).inc()
            log.warning("request %s: %s", job.rid, error)
        rid = job.rid
        self._held.pop(rid, None)
        self.engine_thread.post(lambda e: e.abort(rid))   # frees the held blocks; they stay in the prefix cache
        if job.state is JobState.ABANDONED:
            job.move(JobState.DONE)
        else:
            self._answer(job, out, checksum, error)


def main(config: NodeConfig) -> int:
    from pdcluster.node.service import run_service

    return run_service(lambda: PrefillNode(config))
