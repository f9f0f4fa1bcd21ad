"""A tensor-parallel rank other than 0: its own process and device, its shard of the model, its slice of the
KV pool. It runs every step rank 0 hands it (engine/shm_ring.py) and nothing else; rank 0 schedules and
samples. Started by `TPWorkers` (engine/tp_executor.py) with the spawn method."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from pdcluster.control.gc_tuning import quiet_gc
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.lora.request import LoRAConfig

if TYPE_CHECKING:   # (torch loads in main, after SIGINT is ignored)
    from pdcluster.engine.kv_cache import RankPools
    from pdcluster.engine.rank_agent import RankAgent, RankAgentFactory
    from pdcluster.engine.rank_tiers import MirrorSpec, TierMirror

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0   # how often an idle worker checks that rank 0 is still there


@dataclass
class WorkerSpec:
    model_dir: str
    config: ModelConfig
    dtype: str                 # torch dtype name
    device: str                # device type: cpu | cuda | npu
    attention_backend: str | None
    rank: int
    size: int
    store_port: int            # rank 0's TCPStore on 127.0.0.1: the group's rendezvous
    ring: tuple                # BroadcastRing.attach arguments
    threads: int               # CPU threads for this rank's ops
    cpus: list[int]            # the cores they run on ([]: the parent's)
    timeout_s: float           # every collective's
    collectives: tuple | None  # ShmCollectives.attach arguments (CPU ranks), or None: gloo
    lora: LoRAConfig | None = None   # serve LoRA adapters (engine/lora/)


def reply(conn: Connection, *message) -> None:
    conn.send_bytes(pickle.dumps(message))


def run(spec: WorkerSpec, conn: Connection) -> None:
    """The process target: `main`'s return value becomes the exit code (a target's return value is dropped)."""
    raise SystemExit(main(spec, conn))


def main(spec: WorkerSpec, conn: Connection) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C goes to the whole group; rank 0 stops us
    import torch

    from pdcluster.engine.model_runner import ModelRunner
    from pdcluster.engine.parallel import init_group, leave_group, rank_device, set_device
    from pdcluster.engine.shm_collectives import ShmCollectives
    from pdcluster.engine.shm_ring import BroadcastRing
    from pdcluster.engine.step_inputs import decode

    parent = os.getppid()
    reader = spec.rank - 1
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)   # before the first parallel region: OpenMP's threads inherit it
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    try:
        device = rank_device(torch.device(spec.device), spec.rank)
        set_device(device)
        store = torch.distributed.TCPStore("127.0.0.1", spec.store_port, spec.size, False,
                                           timeout=datetime.timedelta(seconds=spec.timeout_s))
        shm = ShmCollectives.attach(*spec.collectives) if spec.collectives else None
        if shm is not None:
            shm.peer_check = lambda: "rank 0 exited" if os.getppid() != parent else None
        tp = init_group(spec.rank, spec.size, device, store, spec.timeout_s, shm)
        ring = BroadcastRing.attach(*spec.ring)
        runner = ModelRunner(spec.model_dir, spec.config, getattr(torch, spec.dtype), device,
                             spec.attention_backend, tp=tp, lora=spec.lora)
    except BaseException:
        reply(conn, "error", f"rank {spec.rank}: {traceback.format_exc()}")
        return 1
    quiet_gc()   # the shard's heap: out of every collection from now on
    reply(conn, "ready")
    agent: RankAgent | None = None   # the node's code on this rank's KV slice (engine/rank_agent.py)
    pools: RankPools | None = None
    tiers: TierMirror | None = None   # its slice of the KV tiers' blocks (engine/rank_tiers.py)
    try:
        while True:
            msg = ring.read(reader, conn, IDLE_POLL_S)
            if msg is None:
                if os.getppid() != parent:   # rank 0 died without a word (SIGKILL): do not linger
                    return 1
                continue
            kind, body = msg
            if kind == "step":
                runner.execute(decode(body), agent.layer_hook() if agent is not None else None)
                ring.mark_done(reader)
            elif body[0] == "pool":
                pools = body[1]
                runner.bind_kv_pool(pools.pool(spec.config, device, spec.size))
                reply(conn, "bound")
            elif body[0] == "agent":
                agent = _start_agent(body[1], runner, pools, device, spec, conn)
            elif body[0] == "to_agent":
                if agent is not None:
                    agent.on_message(body[1])
            elif body[0] == "tiers":
                tiers = _start_tiers(body[1], runner, spec, conn)
            elif body[0] == "to_tiers":
                if tiers is not None:
                    tiers.on_message(body[1])
            elif body[0] == "stop":
                return 0
    except (EOFError, OSError):   # rank 0 is gone
        return 1
    except BaseException:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    finally:
        if agent is not None:
            agent.close()
        if tiers is not None:
            tiers.close()
        leave_group()


def _start_agent(factory: RankAgentFactory, runner, pools: RankPools | None, device, spec: WorkerSpec,
                 conn: Connection) -> RankAgent | None:
    """The node's agent on this rank's KV pool (moved into the agent's `kv_pool` if it has one); rank 0 hears its
    `info`, or why it did not start."""
    if pools is None:
        reply(conn, "error", f"rank {spec.rank}: a KV agent before the KV pool was bound")
        return None
    agent = None
    try:
        agent = factory(runner.kv_pool.tensor, spec.rank, spec.size)
        if agent.kv_pool is not None:
            runner.bind_kv_pool(pools.pool(spec.config, device, spec.size, agent.kv_pool))
    except Exception:
        if agent is not None:
            agent.close()
        reply(conn, "error", f"rank {spec.rank}: {traceback.format_exc()}")
        return None
    reply(conn, "agent", agent.info)
    return agent


def _start_tiers(mirror: MirrorSpec, runner, spec: WorkerSpec, conn: Connection) -> TierMirror | None:
    """This rank's slice of the KV tiers' blocks; rank 0 hears that it started, or why not."""
    from pdcluster.engine.rank_tiers import TierMirror

    try:
        tiers = TierMirror(mirror, lambda: runner.kv_pool)
    except Exception:
        mirror.report.close()
        reply(conn, "error", f"rank {spec.rank}: {traceback.format_exc()}")
        return None
    reply(conn, "tiers")
    return tiers
