"""Rank 0's side of a tensor-parallel engine: starts ranks 1..N-1 (engine/tp_worker.py, spawned processes),
joins the group with them, hands them each step's inputs through a shared-memory broadcast ring, and tells
which rank failed when a step does (dead, stopped, or never done with its step).

Rank 0 is the engine's own process: it schedules, runs its shard and samples (engine/model_runner.py).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdcluster.control.cpus import share_cpus
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import RankPools
from pdcluster.engine.lora.request import LoRAConfig
from pdcluster.engine.parallel import TPGroup, init_group, leave_group
from pdcluster.engine.rank_agent import RankAgentFactory
from pdcluster.engine.shm_collectives import ShmCollectives, supported
from pdcluster.engine.shm_ring import BroadcastRing
from pdcluster.engine.step_inputs import StepInputs, encode
from pdcluster.engine.tp_worker import WorkerSpec, run

log = logging.getLogger(__name__)
# Per rank and buffer: a decode step's [256, 4096] fp32 activations, a prefill chunk of 2048 x 1024 (larger
# tensors take gloo). 2 x ranks x this in /dev/shm.
SHM_SLOT_BYTES = 8 << 20


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, stopped or hung: the engine cannot step any more."""

    fatal = True   # EngineThread stops on it even where it survives other step errors


class TPWorkers:
    def __init__(self, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention_backend: str | None, size: int, timeout_s: float, lora: LoRAConfig | None = None) -> None:
        """Starts the workers and joins the group (returns once every rank joined). `self.group` is rank 0's."""
        self.size, self.timeout_s = size, timeout_s
        self.dead: TPWorkerError | None = None
        self._closed = False
        store = torch.distributed.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=timeout_s))
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.ring = BroadcastRing.create(size - 1)
        self.shm = _shm_collectives(device, size)
        try:
            self._start(model_dir, config, dtype, device, attention_backend, store, lora)
        except BaseException as exc:
            self.close()
            if isinstance(exc, Exception) and not isinstance(exc, TPWorkerError):
                raise TPWorkerError(f"tensor parallelism: the ranks did not start and join within "
                                    f"{timeout_s:.0f} s ({self._describe_ranks(behind=False) or exc})") from exc
            raise
        self._store = store
        atexit.register(self.close)

    def _start(self, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str | None, store: torch.distributed.TCPStore, lora: LoRAConfig | None) -> None:
        size, timeout_s = self.size, self.timeout_s
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
        cores = sorted(os.sched_getaffinity(0))
        # CPU ranks share this process's cores: each its own slice when there is one for every rank. Rank 0
        # keeps them all (the caller's thread, and the node's other threads, run there too).
        slices = share_cpus(cores, [1] * size) if device.type == "cpu" and len(cores) >= size else [[]] * size
        if device.type == "cpu":
            torch.set_num_threads(threads)
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            parent_end, child_end = ctx.Pipe()
            spec = WorkerSpec(model_dir, config, str(dtype).removeprefix("torch."), device.type, attention_backend,
                              rank, size, store.port, self.ring.attach_args(), threads, slices[rank], timeout_s,
                              self.shm.attach_args(rank) if self.shm else None, lora)
            proc = ctx.Process(target=run, args=(spec, child_end), name=f"pdcluster-tp-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.group: TPGroup = init_group(0, size, device, store, timeout_s, self.shm)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until every rank loaded its shard; raises with a failing rank's error."""
        try:
            for rank, reply in enumerate(self._replies(timeout_s), start=1):
                if reply[0] != "ready":
                    raise TPWorkerError(f"tensor-parallel rank {rank} failed to start:\n{reply[1]}")
        except BaseException:
            self.close()
            raise
        self.ring.unlink()   # every rank has mapped it
        if self.shm is not None:
            self.shm.unlink()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def bind_pool(self, pools: RankPools) -> None:
        self.ring.send_control(("pool", pools), self.conns)
        for rank, reply in enumerate(self._replies(self.timeout_s), start=1):
            if reply[0] != "bound":
                raise TPWorkerError(f"tensor-parallel rank {rank}: unexpected reply {reply!r}")

    def start_agents(self, factory: RankAgentFactory) -> list[Any]:
        """Every rank builds `factory(its KV pool tensor, rank, size)` (engine/rank_agent.py); their `info`s."""
        self.ring.send_control(("agent", factory), self.conns)
        infos = []
        for rank, reply in enumerate(self._replies(self.timeout_s), start=1):
            if reply[0] != "agent":
                raise TPWorkerError(f"tensor-parallel rank {rank}: its KV agent did not start:\n{reply[1]}")
            infos.append(reply[1])
        return infos

    def tell_agent(self, rank: int, message: Any) -> None:
        """`message` to rank `rank`'s agent, in order with the steps (the engine thread only: it alone writes the
        ranks' pipes)."""
        self.ring.send_control(("to_agent", message), [self.conns[rank - 1]])

    def start_tiers(self, specs: list[Any]) -> None:
        """Rank r starts its slice of the KV tiers from `specs[r - 1]` (engine/rank_tiers.py)."""
        for conn, spec in zip(self.conns, specs, strict=True):
            self.ring.send_control(("tiers", spec), [conn])
        for rank, reply in enumerate(self._replies(self.timeout_s), start=1):
            if reply[0] != "tiers":
                raise TPWorkerError(f"tensor-parallel rank {rank}: its KV tiers did not start:\n{reply[1]}")

    def tell_tiers(self, message: Any) -> None:
        """`message` to every rank's KV tiers, in order with the steps (the engine thread only)."""
        self.ring.send_control(("to_tiers", message), self.conns)

    def broadcast(self, inputs: StepInputs) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            self.ring.write(encode(inputs), self.conns, self.timeout_s)
        except (OSError, TimeoutError) as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException) -> TPWorkerError:
        """The error for a failed step, naming the rank(s) behind it."""
        ranks = self._describe_ranks(behind=False)
        if ranks:
            return TPWorkerError(f"tensor-parallel step failed: {ranks}")
        behind = self._describe_ranks()
        return TPWorkerError(f"tensor-parallel step failed: {exc}" + (f" ({behind})" if behind else ""))

    def _describe_ranks(self, behind: bool = True) -> str:
        """Dead ranks (with what they said last), else stopped ones, else (`behind`) those not done with the
        last step."""
        import psutil

        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}{self._last_words(r)}"
                for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        if dead:
            return "; ".join(dead)
        stopped = []
        for r, p in enumerate(self.procs, start=1):
            try:
                if psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
                    stopped.append(f"rank {r} (pid {p.pid}) is stopped")
            except psutil.Error:
                pass
        if stopped or not behind:
            return "; ".join(stopped)
        return "; ".join(f"rank {r} did not finish step {self.ring.seq}" for r in range(1, self.size)
                         if self.ring.done_count(r - 1) < self.ring.seq)

    def _last_words(self, rank: int) -> str:
        conn = self.conns[rank - 1]
        try:
            while conn.poll(0):
                reply = pickle.loads(conn.recv_bytes())
                if reply[0] == "error":
                    return f": {reply[1].strip().splitlines()[-1]}"
        except (OSError, EOFError, pickle.PickleError):
            pass
        return ""

    def _replies(self, timeout_s: float):
        """One reply per worker, in rank order; a worker that exits first or stays silent raises."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            deadline = time.monotonic() + timeout_s
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise TPWorkerError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                        f"{proc.exitcode}")
                if time.monotonic() > deadline:
                    raise TPWorkerError(f"tensor-parallel rank {rank} did not answer in {timeout_s:.0f} s")
            try:
                yield pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                proc.join(1.0)
                raise TPWorkerError(f"tensor-parallel rank {rank} (pid {proc.pid}) went away (exit code "
                                    f"{proc.exitcode})") from None

    def _watch(self) -> None:
        """Notice a rank that dies between steps: the next step fails at once, naming it."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self._closed:
            return
        for sentinel, (_rank, proc) in sentinels.items():
            if sentinel in ready:
                proc.join(1.0)   # the sentinel fires as the process exits; reap it for its code
        dead = ", ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                         for r, p in sentinels.values() if p.exitcode is not None)
        self.dead = TPWorkerError(f"tensor-parallel worker died: {dead}")
        self.group.abort(str(self.dead))
        log.critical("%s", self.dead)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.ring.send_control(("stop",), [c for c, p in zip(self.conns, self.procs, strict=True) if p.is_alive()])
        except OSError:
            pass
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self.ring.unlink()
        self.ring.close()
        if self.shm is not None:
            self.shm.unlink()
        leave_group()
        atexit.unregister(self.close)   # (registered once the ranks joined)


def _shm_collectives(device: torch.device, size: int) -> ShmCollectives | None:
    """The shared-memory collectives for CPU ranks, when this CPU and /dev/shm allow them (else gloo)."""
    if not supported(device):
        return None
    try:
        return ShmCollectives.create(size, SHM_SLOT_BYTES)
    except OSError as exc:
        log.warning("tensor parallelism: no room for shared-memory collectives in /dev/shm (%s); using gloo", exc)
        return None
