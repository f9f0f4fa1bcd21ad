"""Step-level engine: add requests, call `step()`, get per-request outputs. Synchronous and
single-threaded; the offline `LLM`, the async engine and the node services each drive it from one loop."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import fields
from typing import Callable

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.config import ModelConfig, parse_dtype
from pdcluster.engine.device import free_memory_bytes, resolve_device
from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.loader import load_eos_token_ids, load_tokenizer
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import CompletionOutput, RequestOutput
from pdcluster.engine.scheduler import ScheduledBatch, Scheduler
from pdcluster.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

CPU_KV_CACHE_CAP = 4 << 30   # on CPU the pool shares RAM with everything else


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.dtype = parse_dtype(args.dtype)
        self.device = resolve_device(args.device)
        self.model_config = ModelConfig.from_pretrained(args.model)
        cfg = self.model_config
        self.tokenizer = load_tokenizer(args.model)
        cfg.eos_token_ids = load_eos_token_ids(args.model, cfg, self.tokenizer)
        if args.max_model_len is not None:
            if args.max_model_len > cfg.max_model_len:
                raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context {cfg.max_model_len}")
            cfg.max_model_len = args.max_model_len
        self.runner = ModelRunner(args.model, cfg, self.dtype, self.device, args.attention_backend, args.seed)
        self.kv_pool = self._make_pool()
        self.runner.bind_kv_pool(self.kv_pool)
        self.block_size = self.kv_pool.block_size
        pool_tokens = self.kv_pool.num_blocks * self.block_size
        if pool_tokens < cfg.max_model_len:
            log.warning("KV pool holds %d tokens < max_model_len %d: capping max_model_len", pool_tokens, cfg.max_model_len)
            cfg.max_model_len = pool_tokens
        self.block_manager = BlockManager(self.kv_pool.num_blocks, self.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   args.enable_chunked_prefill)
        self.requests: dict[str, Sequence] = {}       # waiting, running, and finished-but-held
        # Blocks handed out by reserve_blocks, with multiplicity: two reservations may share a cached prefix block.
        self.reserved: Counter[int] = Counter()
        self._pending: list[RequestOutput] = []
        self.current_batch: ScheduledBatch | None = None
        self._arrivals = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    @classmethod
    def from_args(cls, model: str, **kwargs) -> "LLMEngine":
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(EngineArgs(model=model, **kwargs))

    def _make_pool(self) -> KVCachePool:
        a, cfg = self.args, self.model_config
        per_block = KVCachePool.bytes_per_block(cfg, a.block_size, self.dtype)
        if a.kv_pool_tensor is not None:
            t = a.kv_pool_tensor
            return KVCachePool(t.shape[0], cfg.num_layers, a.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, t.device, tensor=t)
        if a.num_gpu_blocks_override is not None:
            num_blocks = a.num_gpu_blocks_override
        else:
            if a.kv_cache_memory is not None:
                budget = a.kv_cache_memory
            else:
                budget = int(free_memory_bytes(self.device) * a.gpu_memory_utilization)
                if self.device.type == "cpu":
                    budget = min(budget // 2, CPU_KV_CACHE_CAP)
            num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: room for no KV block (one block needs {per_block} bytes)")
        shape = KVCachePool.shape_for(cfg, num_blocks, a.block_size)
        tensor = a.kv_pool_factory(shape, self.dtype) if a.kv_pool_factory is not None else None
        return KVCachePool(num_blocks, cfg.num_layers, a.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                           self.device, tensor=tensor)

    # ---- requests -------------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      hold_blocks: bool = False) -> Sequence:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
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
        seq = self._new_sequence(request_id, prompt_token_ids, params, hold_blocks)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now. Unknown or finished ids are a no-op."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished hold_blocks request (they stay in the prefix cache)."""
        self.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- the step -------------------------------------------------------------------------------

    def step(self, layer_done_callback: Callable[[int], None] | None = None) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        self.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.num_decode_tokens += n
            else:
                self.num_prefill_tokens += n
        self.current_batch = batch   # what a layer_done_callback is being called for
        sampled, tokens, logprobs = self.runner.run(batch, layer_done_callback)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self._register_full_blocks(seq)
        for seq, token, lp in zip(sampled, tokens, logprobs):
            seq.append_token(token, lp)
            if seq.stopped:
                self.scheduler.finish(seq)
                if not seq.hold_blocks:
                    self.requests.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _register_full_blocks(self, seq: Sequence) -> None:
        if self.block_manager.enable_prefix_caching:
            for block_id, h, tokens in seq.new_full_block_hashes(self.block_size):
                self.block_manager.register(block_id, h, tokens)

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_emitted:]
        new_lp = seq.output_logprobs[seq.num_emitted:] if seq.params.logprobs is not None else None
        seq.num_emitted = len(seq.output_token_ids)
        finished = seq.stopped
        cum = None
        if seq.params.logprobs is not None and seq.output_logprobs:
            cum = sum(lp[0] for lp in seq.output_logprobs if lp is not None)
        completion = CompletionOutput(
            index=0, text="", token_ids=list(seq.output_token_ids), cumulative_logprob=cum,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        return RequestOutput(
            request_id=seq.request_id, prompt=None, prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
            finished=finished, new_token_ids=new, logprobs=new_lp, num_cached_tokens=seq.num_cached_tokens,
            block_ids=list(seq.block_table) if seq.hold_blocks else None)

    # ---- decode-node hooks ----------------------------------------------------------------------

    def reserve_blocks(self, num_tokens: int, prompt_token_ids: list[int] | None = None) -> list[int] | None:
        """Fresh blocks for `num_tokens` tokens, outside the scheduler (a remote prefill writes them).
        None when not enough are free. Owned by the caller until `add_prefilled_request` or `free_reserved`."""
        got = self.reserve_blocks_with_prefix(num_tokens, None)
        return None if got is None else got[0]

    def reserve_blocks_with_prefix(self, num_tokens: int, prompt_token_ids: list[int] | None
                                   ) -> tuple[list[int], int] | None:
        """Like `reserve_blocks`, but leading blocks already in the prefix cache for `prompt_token_ids`
        are shared instead of allocated: returns (block ids, number of leading tokens already cached).
        The remote prefill then only needs to write tokens from that index on."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        needed = -(-num_tokens // self.block_size)
        hits: list[int] = []
        if prompt_token_ids:
            hits, _ = self.block_manager.match_prefix(list(prompt_token_ids), (min(num_tokens, len(prompt_token_ids)) - 1) // self.block_size)
        fresh = needed - len(hits)
        if fresh + self.block_manager.num_reclaimable(hits) > self.block_manager.num_free_blocks:
            return None
        self.block_manager.acquire(hits)
        blocks = hits + self.block_manager.allocate(fresh)
        self.reserved.update(blocks)
        return blocks, len(hits) * self.block_size

    def _unreserve(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.reserved[b] -= 1
            if self.reserved[b] <= 0:
                del self.reserved[b]

    def free_reserved(self, block_ids: list[int]) -> None:
        owned = [b for b in block_ids if b in self.reserved]
        self._unreserve(owned)
        self.block_manager.free(owned)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              block_ids: list[int], first_token: int, first_logprobs=None) -> RequestOutput:
        """Start decoding a request whose prompt KV is already in `block_ids` (from `reserve_blocks`).
        `first_token` becomes its first output token; the returned output reports it (and says whether
        the request already finished on it). The engine owns the blocks from here on."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        needed = -(-seq.num_prompt_tokens // self.block_size)
        if len(block_ids) < needed:
            raise ValueError(f"block_ids: {len(block_ids)} blocks cannot hold a {seq.num_prompt_tokens}-token prompt")
        not_reserved = [b for b in block_ids if b not in self.reserved]
        if not_reserved:
            raise ValueError(f"block_ids: {not_reserved[:8]} were not reserved with reserve_blocks")
        self._unreserve(block_ids)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._register_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        seq.append_token(int(first_token), first_logprobs)
        self.requests[request_id] = seq
        self.scheduler.running.append(seq)
        if seq.stopped:
            self.scheduler.finish(seq)
            self.requests.pop(request_id, None)
        return self._output(seq)

    # ---- stats ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.block_manager.prefix_hit_tokens

    @property
    def prefix_cache_query_tokens(self) -> int:
        return self.block_manager.prefix_query_tokens

    def get_stats(self) -> dict[str, int]:
        return {
            "num_free_blocks": self.num_free_blocks, "num_total_blocks": self.num_total_blocks,
            "num_reserved_blocks": sum(self.reserved.values()), "num_running": self.num_running,
            "num_waiting": self.num_waiting, "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
            "num_prefill_tokens": self.num_prefill_tokens, "num_decode_tokens": self.num_decode_tokens,
            "num_steps": self.num_steps,
        }
