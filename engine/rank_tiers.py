"""KV tiers of a pool sliced per tensor-parallel rank (a device's, or `kv_pool_per_rank` on CPU).

Each rank's process holds its own slice of every block, so each rank keeps its own slice of the tiers' blocks,
but one index decides for all: rank 0's `SlicedKVTiers` is the engine's `KVTiers` for rank 0's slice (the index,
the LRU decisions, the pins, the block-hash events), and every other rank runs a `TierMirror` that copies its
slice as rank 0's tiers do:

- rank 0 hands the ranks its decisions in order with the steps (`TPWorkers.tell_tiers`, the step pipe): "store"
  a block under its hash (after the step that computed it), "load" hashes into pinned blocks, and what its index
  lost or moved ("spill" host -> disk, "drop" from host, "unlink" a file; `KVTiers.mirror`), batched (`flush`:
  one message after a step's stores, one per load);
- each rank copies on its own thread, off its step, and reports back over its own pipe which stores are done and
  how many leading blocks of each load it copied;
- a store unpins its block once every rank holds its slice; a load ends at the first block any rank could not
  copy (a missing, truncated or corrupt file on one rank ends it for all: the rest is recomputed, never read
  wrong), and that block leaves the index on every rank.

Budgets are per slice: the knobs divided by the ranks (every slice of a block has the same shape, so rank 0's
LRU keeps each rank within its share). Each rank's disk files go to its own directory `rank{r}-of-{n}` under
`kv_offload_disk_path`, under a layout key that names its slice (`layout_key`). A rank whose disk write fails
turns the disk tier off for all.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Callable

import torch

from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.kv_events import DISK, EVICTED, HOST
from pdcluster.engine.kv_tiers import DiskTier, KVTiers, TierLoad, TierPoll, copy_in, copy_out, layout_key, raw_bytes

if TYPE_CHECKING:
    from pdcluster.engine.tp_executor import TPWorkers

log = logging.getLogger(__name__)


def rank_dir(path: str, rank: int, ranks: int) -> str:
    return os.path.join(path, f"rank{rank}-of-{ranks}")


@dataclass
class MirrorSpec:
    """What rank r needs for its `TierMirror` (pickled to it)."""
    disk_path: str | None    # its own directory; None: no disk tier
    key: int                 # `layout_key` of its slice
    report: Connection       # its reports to rank 0
    # the hashes rank 0's disk tier indexed from an earlier run's files: any other file of rank r's is a stray (its
    # run stopped between the ranks' writes), deleted at start, so no rank's directory outgrows its budget
    keep: frozenset[int] = frozenset()


@dataclass
class _Waiting:
    """A submitted copy until every rank's part of it is in."""
    ranks: set[int]                  # ranks still to report (0: this one)
    load: TierLoad | None = None
    fewest: int = 0                  # a load: the fewest leading blocks a rank copied so far


@dataclass
class _Report:
    stored: list[int] = field(default_factory=list)
    loaded: list[tuple[int, int]] = field(default_factory=list)   # (job, leading blocks copied)
    disk_error: str = ""             # this rank's disk tier turned off


class SlicedKVTiers(KVTiers):
    """Rank 0's tiers of a sliced pool: its own slice here (`KVTiers`), the other ranks' in their `TierMirror`s."""

    def __init__(self, pool: KVCachePool, host_bytes: int, disk_path: str | None, disk_bytes: int, seed: int,
                 workers: TPWorkers) -> None:
        n = workers.size
        super().__init__(pool, host_bytes // n, rank_dir(disk_path, 0, n) if disk_path else None, disk_bytes // n,
                         layout_key(seed, pool, (0, n)))
        self.mirror = []
        self.workers = workers
        self._out: list[tuple] = []        # this step's stores and loads for the ranks (engine thread)
        self._held: list[tuple] = []       # ... and for this rank's worker: started after the ranks heard
        self._stores: dict[int, _Waiting] = {}
        self._loads: dict[int, _Waiting] = {}
        self._job_ids = itertools.count(1)
        self._lost = False                 # a rank's pipe closed: the engine is failing
        pipes = [mp.get_context("spawn").Pipe(duplex=False) for _ in range(1, n)]
        self._reports = [reader for reader, _ in pipes]
        try:
            kept = frozenset(self.disk.sizes) if self.disk is not None else frozenset()
            workers.start_tiers([MirrorSpec(rank_dir(disk_path, r, n) if disk_path and self.disk else None,
                                            layout_key(seed, pool, (r, n)), writer, kept)
                                 for r, (_, writer) in enumerate(pipes, start=1)])
        except BaseException:
            self.close()
            raise
        finally:
            for _, writer in pipes:
                writer.close()

    # ---- engine thread ---------------------------------------------------------------------------------------

    def _submit(self, job: tuple) -> None:
        ranks = {0} if self._lost else set(range(self.workers.size))
        if job[0] == "store":
            self._stores[job[1]] = _Waiting(ranks)
            self._out.append(job)
            self._held.append(job)
            return
        load: TierLoad = job[1]
        load.job = next(self._job_ids)
        self._loads[load.job] = _Waiting(ranks, load, 0 if self._lost else len(load.blocks))
        self._out.append(("load", load.job, load.blocks, load.hashes))
        self._held.append(job)
        self.flush()   # the request waits for it: now, not after the step

    def flush(self) -> None:
        """The ranks hear what this rank's index lost or moved since, then this step's stores and loads; only
        then does this rank's worker start those (what it then evicts reaches the ranks after them)."""
        with self._lock:
            assert self.mirror is not None
            ops, self.mirror = self.mirror + self._out, []
        self._out = []
        if ops and not self._lost:
            try:
                self.workers.tell_tiers(ops)
            except OSError:   # a rank is gone: the next step fails naming it
                pass
        for job in self._held:
            self._jobs.put(job)
        self._held = []

    def _finished(self, timeout: float) -> TierPoll:
        """The copies whose every part is in: this rank's and the other ranks' reports combined."""
        if timeout > 0 and any(w.ranks - {0} for w in itertools.chain(self._stores.values(), self._loads.values())):
            wait(self._reports, timeout)   # (the ranks copy as long as this one: wait for them)
            timeout = 0
        done = TierPoll()
        local = super()._finished(timeout)
        for b in local.stored:
            self._part_stored(0, b, done)
        for load in local.loaded:
            self._part_loaded(0, load.job, load.done, done)
        for rank, conn in enumerate(self._reports, start=1):
            try:
                while conn.poll(0):
                    report: _Report = conn.recv()
                    for b in report.stored:
                        self._part_stored(rank, b, done)
                    for job, n in report.loaded:
                        self._part_loaded(rank, job, n, done)
                    if report.disk_error and self.disk is not None:
                        self.disk_failed(self.disk, f"tensor-parallel rank {rank}: {report.disk_error}")
            except (EOFError, OSError):
                self._lose(done)
        self.flush()
        return done

    def _part_stored(self, rank: int, block: int, done: TierPoll) -> None:
        waiting = self._stores[block]
        waiting.ranks.discard(rank)
        if not waiting.ranks:
            del self._stores[block]
            done.stored.append(block)

    def _part_loaded(self, rank: int, job: int, n: int, done: TierPoll) -> None:
        waiting = self._loads[job]
        waiting.fewest = min(waiting.fewest, n)
        waiting.ranks.discard(rank)
        if not waiting.ranks:
            self._end_load(job, done)

    def _end_load(self, job: int, done: TierPoll) -> None:
        waiting = self._loads.pop(job)
        load = waiting.load
        assert load is not None
        if waiting.fewest < load.done:   # another rank's slice of a block this rank copied is missing or corrupt
            self.stats.failed_loads += 1
        load.done = waiting.fewest
        if load.done < len(load.hashes) and not self._lost:
            self._forget(load.hashes[load.done])
        done.loaded.append(load)

    def _forget(self, h: int) -> None:
        """A block some rank could not give back leaves every rank's tiers."""
        with self._lock:
            if self.host.drop(h):
                self._event(EVICTED, HOST, h)
                self._tell("drop", h)
            disk = self.disk
            if disk is not None and h in disk.sizes:
                disk.delete(h)
                self._event(EVICTED, DISK, h)
                self._tell("unlink", h)

    def _lose(self, done: TierPoll) -> None:
        """A rank's pipe closed (it died): every copy ends without it, loads with nothing loaded."""
        self._lost = True
        for b, waiting in list(self._stores.items()):
            waiting.ranks &= {0}
            if not waiting.ranks:
                del self._stores[b]
                done.stored.append(b)
        for job, waiting in list(self._loads.items()):
            waiting.fewest = 0
            waiting.ranks &= {0}
            if not waiting.ranks:
                self._end_load(job, done)

    def close(self) -> None:
        super().close()
        for conn in self._reports:
            conn.close()


class TierMirror:
    """Rank r's slice of the blocks rank 0's tiers hold, in rank r's process: a dict of host copies and a
    directory of files, changed only as rank 0 says (`on_message`, from the rank's main thread between steps),
    by one thread of its own that reports each message's stores and loads back to rank 0."""

    def __init__(self, spec: MirrorSpec, pool: Callable[[], KVCachePool]) -> None:
        self.pool = pool   # the rank's pool now (a KV agent may move it as it starts)
        self.host: dict[int, torch.Tensor] = {}
        self.disk = DiskTier(spec.disk_path, 0, spec.key) if spec.disk_path else None
        if self.disk is not None:
            for h in [h for h in self.disk.sizes if h not in spec.keep]:
                self.disk.delete(h)
        self.report = spec.report
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="kv-tiers-mirror", daemon=True)
        self._thread.start()

    def on_message(self, ops: list[tuple]) -> None:
        self._jobs.put(ops)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)
        self.report.close()

    def _work(self) -> None:
        while (ops := self._jobs.get()) is not None:
            report = _Report()
            for op in ops:
                try:
                    self._run(op, report)
                except Exception:   # rank 0 must hear of the copy all the same: a failed load loaded nothing
                    log.exception("KV tiers: %s failed", op[0])
                    if op[0] == "store":
                        report.stored.append(op[1])
                    elif op[0] == "load":
                        report.loaded.append((op[1], 0))
            if report.stored or report.loaded or report.disk_error:
                try:
                    self.report.send(report)
                except OSError:   # rank 0 is gone
                    return

    def _run(self, op: tuple, report: _Report) -> None:
        kind = op[0]
        if kind == "store":
            _, block, h = op
            if h not in self.host:
                pool = self.pool()
                self.host[h] = copy_out(pool, block, pin=pool.device.type != "cpu")
            report.stored.append(block)
        elif kind == "load":
            _, job, blocks, hashes = op
            report.loaded.append((job, self._load(blocks, hashes)))
        elif kind == "spill":
            copy = self.host.pop(op[1], None)
            if copy is not None and self.disk is not None:
                try:
                    self.disk.write_file(op[1], raw_bytes(copy))
                except OSError as e:
                    log.warning("KV disk tier %s turned off: %s", self.disk.path, e)
                    self.disk, report.disk_error = None, str(e)
        elif kind == "drop":
            self.host.pop(op[1], None)
        elif kind == "unlink" and self.disk is not None:
            self.disk.delete(op[1])

    def _load(self, blocks: list[int], hashes: list[int]) -> int:
        """Copy `hashes` into `blocks` in order; how many leading ones were copied."""
        pool = self.pool()
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            src: torch.Tensor | bytes | None = self.host.get(h)
            if src is None and self.disk is not None:
                src = self.disk.read_file(h, pool.block_bytes)
                if src is None:
                    log.warning("KV disk tier: block %016x unreadable (missing, truncated, corrupt or another "
                                "layout): recomputed", h)
                    self.disk.delete(h)
            if src is None:
                return i
            copy_in(pool, block, src)
        return len(blocks)
