"""Step-level engine: add requests, call `step()`, get per-request outputs. Synchronous and
single-threaded; the offline `LLM`, the async engine and the node services each drive it from one loop."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import fields

import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.config import ModelConfig, resolve_dtype
from pdcluster.engine.device import (
    bind_thread,
    collective_headroom_bytes,
    default_cpu_kv_cache_bytes,
    free_memory_bytes,
    resolve_device,
    with_device_defaults,
)
from pdcluster.engine.kv_cache import KVCachePool, resolve_kv_dtype
from pdcluster.engine.kv_connector import KVConnector, PromptInStep
from pdcluster.engine.loader import load_eos_token_ids, load_tokenizer
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import CompletionOutput, RequestOutput
from pdcluster.engine.parallel import check_tensor_parallel
from pdcluster.engine.scheduler import ScheduledBatch, Scheduler, resolve_batched_tokens
from pdcluster.engine.sequence import Sequence
from pdcluster.engine.stats import EngineStats
from pdcluster.engine.tp_executor import TPWorkers
from pdcluster.engine.tp_shards import local_kv_heads
from pdcluster.engine.weight_pool import SharedWeightPool

log = logging.getLogger(__name__)

RATE_INTERVAL_S = 2.0   # EngineStats.tokens_per_s: generated tokens over about the last this many seconds


class LLMEngine:
    def __init__(self, args: EngineArgs, kv_connector: KVConnector | None = None) -> None:
        self.kv_connector = kv_connector
        self.device = resolve_device(args.device)
        bind_thread(self.device)
        self.args = args = with_device_defaults(args, self.device)
        self.dtype = resolve_dtype(args.dtype, self.device, args.model)
        self.model_config = ModelConfig.from_pretrained(args.model)
        cfg = self.model_config
        self.tokenizer = load_tokenizer(args.model)
        cfg.eos_token_ids = load_eos_token_ids(args.model, cfg, self.tokenizer)
        if args.max_model_len is not None:
            if args.max_model_len > cfg.max_model_len:
                raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context {cfg.max_model_len}")
            cfg.max_model_len = args.max_model_len
        self.tp_size = args.tensor_parallel_size
        check_tensor_parallel(cfg, self.tp_size, self.device, args.weight_pool)
        pool = args.weight_pool
        self.weight_pool = SharedWeightPool.from_spec(pool) if isinstance(pool, str) else pool
        workers = None
        if self.tp_size > 1:
            workers = TPWorkers(args.model, cfg, self.dtype, self.device, args.attention_backend, self.tp_size,
                                args.collective_timeout)
        try:
            self.runner = ModelRunner(args.model, cfg, self.dtype, self.device, args.attention_backend, args.seed,
                                      self.weight_pool, tp=workers.group if workers else None, workers=workers,
                                      enforce_eager=args.enforce_eager)
            if workers is not None:
                workers.wait_ready()
            self.kv_pool, handle = self._make_pool()
            if workers is not None:
                workers.bind_pool(handle)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        self.runner.bind_kv_pool(self.kv_pool)
        self.block_size = self.kv_pool.block_size
        pool_tokens = self.kv_pool.num_blocks * self.block_size
        if pool_tokens < cfg.max_model_len:
            log.warning("KV pool holds %d tokens < max_model_len %d: capping max_model_len", pool_tokens,
                        cfg.max_model_len)
            cfg.max_model_len = pool_tokens
        self.block_manager = BlockManager(self.kv_pool.num_blocks, self.block_size, args.enable_prefix_caching)
        budget = resolve_batched_tokens(args.max_num_batched_tokens, cfg.max_model_len, args.enable_chunked_prefill)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, budget,
                                   args.enable_chunked_prefill, sliding_window=cfg.kv_window)
        if args.streaming_window or args.attention_sinks:
            self.scheduler.enable_streaming(args.attention_sinks, args.streaming_window, self.kv_pool, cfg,
                                            self.tp_size)
        self._arrivals = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        # (monotonic time, generated tokens) after recent steps; the first is the base of tokens_per_s
        self._rate_marks: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    @classmethod
    def from_engine_args(cls, args: EngineArgs, kv_connector: KVConnector | None = None) -> "LLMEngine":
        return cls(args, kv_connector)

    @classmethod
    def from_args(cls, model: str, **kwargs) -> "LLMEngine":
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(EngineArgs(model=model, **kwargs))

    def _make_pool(self) -> tuple[KVCachePool, dict | None]:
        """The KV pool, and for tensor-parallel workers what they need to bind theirs: on CPU the pool holds
        every rank's heads in shared memory (the handle shares it), on a device each rank allocates its own
        slice of the same number of blocks."""
        a, cfg, tp = self.args, self.model_config, self.tp_size
        shared = tp > 1 and self.device.type == "cpu"
        pool_tp = tp if shared else 1
        kv_heads = local_kv_heads(cfg, tp)
        kv_dtype = resolve_kv_dtype(a.kv_cache_dtype, self.dtype)
        per_block = KVCachePool.bytes_per_block(cfg, a.block_size, kv_dtype, pool_tp)
        if a.kv_pool_tensor is not None:
            num_blocks, made = a.kv_pool_tensor.shape[2], a.kv_pool_tensor
        else:
            num_blocks, made = self._num_blocks(per_block), None
            if a.kv_pool_factory is not None:
                made = a.kv_pool_factory(KVCachePool.shape_for(cfg, num_blocks, a.block_size, kv_dtype, pool_tp),
                                         kv_dtype)
        tensor = made.tensor if made is not None and not isinstance(made, torch.Tensor) else made
        if shared:
            if tensor is None:
                made = tensor = torch.zeros(KVCachePool.shape_for(cfg, num_blocks, a.block_size, kv_dtype, tp),
                                            dtype=kv_dtype).share_memory_()
            elif isinstance(made, torch.Tensor) and not made.is_shared():
                raise ValueError("kv_pool_tensor / kv_pool_factory: with tensor_parallel_size > 1 on CPU the pool "
                                 "must be shared memory the worker ranks can map (tensor.share_memory_() or a "
                                 "SharedKVPool)")
        pool = KVCachePool(num_blocks, cfg.num_layers, a.block_size, kv_heads, cfg.head_dim, kv_dtype,
                           self.device, tensor=tensor, tp=pool_tp)
        if tp == 1:
            return pool, None
        if shared:
            return pool, {"kind": "shared", "tensor": made, "block_size": a.block_size, "kv_heads": kv_heads}
        return pool, {"kind": "alloc", "num_blocks": num_blocks, "block_size": a.block_size, "kv_heads": kv_heads,
                      "dtype": str(kv_dtype).removeprefix("torch.")}

    def _num_blocks(self, per_block: int) -> int:
        a = self.args
        if a.num_gpu_blocks_override is not None:
            num_blocks = a.num_gpu_blocks_override
        else:
            if a.kv_cache_memory is not None:
                budget = a.kv_cache_memory
                if self.device.type == "cpu" and budget > free_memory_bytes(self.device):
                    raise ValueError(
                        f"kv_cache_memory: {budget / 2**30:.2f} GiB asked for the KV pool, but this host has "
                        f"{free_memory_bytes(self.device) / 2**30:.2f} GiB of memory available; lower "
                        "kv_cache_memory (--kv-cache-memory) or leave it unset to size the pool from "
                        "gpu_memory_utilization")
            elif self.device.type == "cpu":
                budget = default_cpu_kv_cache_bytes(a.gpu_memory_utilization)
            else:
                budget = int(free_memory_bytes(self.device) * a.gpu_memory_utilization) \
                    - collective_headroom_bytes(self.device)
            num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: room for no KV block (one block needs {per_block} bytes)")
        return num_blocks

    # ---- requests -------------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      hold_blocks: bool = False) -> Sequence:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError("n: the engine runs one sequence per request (n=1); submit n requests instead")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids: the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: every token id must be an int in [0, {vocab})")
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"prompt_token_ids: prompt has {len(ids)} tokens, longer than the model context "
                             f"max_model_len={self.model_config.max_model_len}")
        self._arrivals += 1
        return Sequence(request_id, ids, params, self.model_config.eos_token_ids, self.model_config.max_model_len,
                        self._arrivals, hold_blocks)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    hold_blocks: bool = False) -> None:
        self.scheduler.add(self._new_sequence(request_id, prompt_token_ids, params, hold_blocks))

    def abort(self, request_id: str) -> None:
        """Stop a request (waiting, running, waiting for remote KV, or finished and holding its blocks) and
        free its blocks now. Unknown ids are a no-op."""
        self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished hold_blocks request (they stay in the prefix cache)."""
        self.scheduler.abort(request_id)

    def abort_all(self) -> None:
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel rank died)."""
        workers = self.runner.workers
        if workers is not None and workers.dead is not None:
            raise workers.dead

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (also done at interpreter exit); the engine is unusable after."""
        if self.runner.workers is not None:
            self.runner.workers.close()

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.num_decode_tokens += n
            else:
                self.num_prefill_tokens += n
        connector = self.kv_connector
        if connector is None:
            sampled, tokens, logprobs = self.runner.run(batch)
        else:
            prompts = _prompts_finishing(batch)
            connector.on_step_start(prompts)
            sampled, tokens, logprobs = self.runner.run(batch, connector.on_layer_done)
            for p in prompts:
                connector.on_prompt_done(p.request_id, p.block_ids)
        self.num_generated_tokens += len(sampled)
        self._rate_marks.append((time.monotonic(), self.num_generated_tokens))
        self._drop_old_rate_marks()
        return [_request_output(seq) for seq in self.scheduler.update_from_output(batch, sampled, tokens, logprobs)]

    # ---- remote prefill (decode node) -----------------------------------------------------------

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> tuple[list[int], int] | None:
        """Admit a request whose prompt KV another node computes: blocks for the whole prompt, leading ones
        shared from the prefix cache. Returns (block ids, number of leading prompt tokens already cached:
        the remote side writes from there on), or None when too few blocks are free. The request then waits
        for `add_prefilled` (or `abort`) and is never scheduled before."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if not self.scheduler.reserve(seq):
            return None
        return list(seq.block_table), seq.num_cached_tokens

    def add_prefilled(self, request_id: str, first_token: int, first_logprobs=None) -> RequestOutput:
        """The prompt KV of a `reserve_remote` request is in its blocks: it decodes from `first_token` on.
        The returned output reports that token (and whether the request already finished on it)."""
        seq = self.scheduler.waiting_for_kv.get(request_id)
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV (see reserve_remote)")
        if not 0 <= int(first_token) < self.model_config.vocab_size:
            raise ValueError(f"first_token: {first_token} is not in [0, {self.model_config.vocab_size})")
        self.scheduler.add_prefilled(seq, int(first_token), first_logprobs)
        return _request_output(seq)

    # ---- stats ----------------------------------------------------------------------------------

    def cached_block_hashes(self, limit: int = 4096) -> list[int]:
        """Stable hashes (`pdcluster.control.block_hash`) of blocks in the prefix cache, most recently used
        first: what prefix-aware routing may count on this engine holding."""
        return self.block_manager.cached_hashes(limit)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over about the last RATE_INTERVAL_S (0 once the engine idles that long)."""
        now = self._drop_old_rate_marks()
        then, before = self._rate_marks[0]
        return (self.num_generated_tokens - before) / (now - then) if now > then else 0.0

    def _drop_old_rate_marks(self) -> float:
        now, marks = time.monotonic(), self._rate_marks
        while len(marks) > 1 and marks[1][0] <= now - RATE_INTERVAL_S:
            marks.popleft()
        return now

    def get_stats(self) -> EngineStats:
        sched, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_reserved_blocks=sched.num_reserved_blocks(), num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_waiting_for_kv=len(sched.waiting_for_kv),
            num_preemptions=sched.num_preemptions, prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_query_tokens=bm.prefix_query_tokens, num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens, num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps, max_num_seqs=sched.max_num_seqs, tokens_per_s=self.tokens_per_s())


def _prompts_finishing(batch: ScheduledBatch) -> list[PromptInStep]:
    return [PromptInStep(seq.request_id, list(seq.block_table), seq.num_prompt_tokens)
            for seq, n in zip(batch.seqs, batch.num_new_tokens)
            if seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + n]


def _request_output(seq: Sequence) -> RequestOutput:
    """The output of a sequence that just got one token (every step adds at most one per sequence)."""
    want_lp = seq.params.logprobs is not None
    cum = sum(lp[0] for lp in seq.output_logprobs if lp is not None) if want_lp and seq.output_logprobs else None
    completion = CompletionOutput(
        index=0, text="", token_ids=list(seq.output_token_ids), cumulative_logprob=cum,
        logprobs=list(seq.output_logprobs) if want_lp else None,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
    return RequestOutput(
        request_id=seq.request_id, prompt=None, prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
        finished=seq.stopped, new_token_ids=seq.output_token_ids[-1:],
        logprobs=seq.output_logprobs[-1:] if want_lp else None, num_cached_tokens=seq.num_cached_tokens,
        block_ids=list(seq.block_table) if seq.hold_blocks else None)
