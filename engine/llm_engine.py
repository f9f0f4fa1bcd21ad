"""Step-level engine: add requests, call `step()`, get per-request outputs. Synchronous and
single-threaded; the offline `LLM`, the async engine and the node services each drive it from one loop."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from pdcluster.control.block_hash import hash_seed, lora_hash_seed
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.device import bind_thread
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.config import ModelConfig, resolve_dtype
from pdcluster.engine.device import (
    collective_headroom_bytes,
    default_cpu_kv_cache_bytes,
    free_memory_bytes,
    resolve_device,
    with_device_defaults,
)
from pdcluster.engine.kv_cache import make_pool, resolve_kv_dtype
from pdcluster.engine.kv_connector import KVConnector, PromptInStep
from pdcluster.engine.kv_events import DISK, HOST, POOL, STORED, KVEventLog
from pdcluster.engine.kv_tiers import KVTiers, layout_key
from pdcluster.engine.loader import checkpoint_fingerprint, load_eos_token_ids, load_tokenizer
from pdcluster.engine.lora.request import LoRARequest
from pdcluster.engine.lora.slots import LoRAUnavailable
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import CompletionOutput, RequestOutput
from pdcluster.engine.parallel import check_tensor_parallel
from pdcluster.engine.rank_agent import RankAgentFactory
from pdcluster.engine.rank_tiers import SlicedKVTiers
from pdcluster.engine.scheduler import ScheduledBatch, Scheduler, resolve_batched_tokens
from pdcluster.engine.sequence import Sequence, SequenceStatus
from pdcluster.engine.speculative.head_proposer import HeadProposer
from pdcluster.engine.speculative.policy import DraftPolicy
from pdcluster.engine.speculative.proposer import make_proposer
from pdcluster.engine.stats import EngineStats
from pdcluster.engine.tp_executor import TPWorkers
from pdcluster.engine.weight_pool import SharedWeightPool

if TYPE_CHECKING:
    from pdcluster.engine.structured_output import GrammarCompiler

log = logging.getLogger(__name__)

GRAMMAR_IDLE_WAIT_S = 0.01   # an idle step waits at most this long for a grammar compile
TIER_IDLE_WAIT_S = 0.01      # ... or for a copy of the KV tiers
RATE_INTERVAL_S = 2.0   # EngineStats.tokens_per_s: generated tokens over about the last this many seconds


class LLMEngine:
    def __init__(self, args: EngineArgs, kv_connector: KVConnector | None = None) -> None:
        self.kv_connector = kv_connector
        self.device = resolve_device(args.device)
        bind_thread(self.device)
        self.args = args = with_device_defaults(args, self.device)
        assert args.block_size is not None   # the device's default where unset
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
        if args.enable_expert_parallel and cfg.moe is not None:   # the shards and FusedMoE read it from the config
            cfg.moe = dataclasses.replace(cfg.moe, expert_parallel=True)
        check_tensor_parallel(cfg, self.tp_size, self.device, args.weight_pool)
        pool = args.weight_pool
        self.weight_pool = SharedWeightPool.from_spec(pool) if isinstance(pool, str) else pool
        workers = None
        lora = args.lora_config()
        if self.tp_size > 1:
            workers = TPWorkers(args.model, cfg, self.dtype, self.device, args.attention_backend, self.tp_size,
                                args.collective_timeout, lora)
        try:
            self.runner = ModelRunner(args.model, cfg, self.dtype, self.device, args.attention_backend, args.seed,
                                      self.weight_pool, tp=workers.group if workers else None, workers=workers,
                                      enforce_eager=args.enforce_eager, lora=lora)
            for i, (name, path) in enumerate(args.lora_paths().items(), start=1):   # lora_modules: loaded at start
                self.add_lora(LoRARequest(name, i, path))
            if workers is not None:
                workers.wait_ready()
            kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype)
            self.proposer = make_proposer(args, cfg, self.tokenizer, self.runner, self.dtype, kv_dtype,
                                          self.device)
            spec = args.speculative
            self.draft_policy = DraftPolicy(fixed=spec is not None and spec.draft_policy == "fixed")
            draft_bytes = self.proposer.kv_bytes_per_block(args.block_size) if self.proposer is not None else 0
            self.kv_pool, rank_pools = make_pool(cfg, args.block_size, kv_dtype, self.device, self.tp_size,
                                                 lambda per_block: self._num_blocks(per_block + draft_bytes),
                                                 args.kv_pool_tensor, args.kv_pool_factory, args.kv_pool_per_rank)
            if self.proposer is not None:
                self.proposer.bind(self.kv_pool.num_blocks, self.kv_pool.block_size)
            if workers is not None:
                assert rank_pools is not None   # made for every tensor_parallel_size > 1
                workers.bind_pool(rank_pools)
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
        budget = resolve_batched_tokens(args.max_num_batched_tokens, cfg.max_model_len, args.enable_chunked_prefill)
        self.scheduler = Scheduler(self.kv_pool.num_blocks, self.block_size, args.max_num_seqs, budget,
                                   args.enable_chunked_prefill, args.enable_prefix_caching, cfg.kv_window)
        if args.streaming_window or args.attention_sinks:
            self.scheduler.enable_streaming(args.attention_sinks, args.streaming_window, self.kv_pool, cfg,
                                            self.tp_size)
        # where every block hash chain starts: the checkpoint, dtypes, block size and salt (control/block_hash.py)
        self.hash_seed = hash_seed(checkpoint_fingerprint(args.model), self.dtype, kv_dtype, self.block_size,
                                   args.prefix_cache_salt)
        if lora is not None:
            self.scheduler.max_loras = lora.max_loras
        self.tiers = self._make_tiers()
        self.scheduler.on_reserved = self._reserved_later
        if kv_connector is not None and kv_connector.fetches and self.copies_blocks:
            self.scheduler.fetch = kv_connector.on_fetch
        self._arrivals = 0
        self._grammars: GrammarCompiler | None = None   # made on the first structured-output request
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.num_fetched_blocks = self.num_fetch_missed_blocks = self.num_lent_blocks = 0
        # (monotonic time, generated tokens) after recent steps; the first is the base of tokens_per_s
        self._rate_marks: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def _make_tiers(self) -> KVTiers | None:
        """The host / disk KV tiers when a kv_offload knob asks for them (engine/kv_tiers.py)."""
        a = self.args
        if not (a.kv_offload_host_bytes or a.kv_offload_disk_bytes):
            return None
        if self.proposer is not None and self.proposer.writes_kv:
            raise ValueError("kv_offload_*: not available with a speculative drafter that keeps its own KV "
                             "(draft_model): the tiers would restore the target's KV without the drafter's")
        if not a.enable_prefix_caching or a.streaming_window or a.attention_sinks:
            raise ValueError("kv_offload_*: the KV tiers hold prefix-cached blocks: they need enable_prefix_caching "
                             "(and no StreamingLLM)")
        path = a.kv_offload_disk_path or None
        tiers: KVTiers
        if self.rank_sliced_pool:   # each rank its slice of every block (engine/rank_tiers.py)
            assert self.runner.workers is not None
            tiers = SlicedKVTiers(self.kv_pool, a.kv_offload_host_bytes, path, a.kv_offload_disk_bytes,
                                  self.hash_seed, self.runner.workers)
        else:
            tiers = KVTiers(self.kv_pool, a.kv_offload_host_bytes, path, a.kv_offload_disk_bytes,
                            layout_key(self.hash_seed, self.kv_pool))
        self.scheduler.tiers = tiers
        self.scheduler.block_manager.record_published()
        return tiers

    @property
    def rank_sliced_pool(self) -> bool:
        """Tensor parallelism on a device, or with `kv_pool_per_rank`: each rank's KV pool is its own slice in its
        own process, so rank 0's pool is not the whole KV: it moves rank by rank (each rank's KV agent,
        `start_rank_agents`: P/D, prefix fetch, live migration), and each rank keeps its slice of the KV tiers'
        blocks, rank 0's tiers deciding for all (`_make_tiers`, engine/rank_tiers.py)."""
        return self.tp_size > 1 and (self.device.type != "cpu" or self.args.kv_pool_per_rank)

    @property
    def copies_blocks(self) -> bool:
        """Whether a prefix's blocks may be copied to another node and back exactly (prefix fetch, live
        migration): not with a drafter's own KV or StreamingLLM. A pool sliced per rank copies too, each rank its
        slice over its own channel (the node's RankedSender / RankedReceiver): block ids are the same in every
        slice and only rank 0's scheduler hands them out, so `pin_cached` here holds every rank's (the KV tiers
        store and load a sliced pool's blocks the same way: every rank its slice, rank 0 deciding)."""
        return not (self.proposer is not None and self.proposer.writes_kv) \
            and self.scheduler.block_manager.enable_prefix_caching

    def start_rank_agents(self, factory: RankAgentFactory) -> list[Any]:
        """Run `factory(this rank's KV pool tensor, rank, tensor_parallel_size)` in the process of every tensor-parallel
        rank but 0 (engine/rank_agent.py); each agent's `info`, in rank order ([] without other ranks). Before the
        engine thread starts."""
        workers = self.runner.workers
        return [] if workers is None else workers.start_agents(factory)

    def tell_rank_agent(self, rank: int, message: Any) -> None:
        """Hand `message` to rank `rank`'s agent in order with the steps: it gets it after the steps run before
        this call and before the next one. The engine thread only (it alone writes to the ranks' pipes)."""
        workers = self.runner.workers
        assert workers is not None, "tell_rank_agent: this engine has no other tensor-parallel ranks"
        workers.tell_agent(rank, message)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, kv_connector: KVConnector | None = None) -> "LLMEngine":
        return cls(args, kv_connector)

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
                      hold_blocks: bool = False, lora: LoRARequest | None = None) -> Sequence:
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
        outside = [t for t in params.logit_bias or {} if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {outside[:5]}")
        if params.prompt_logprobs is not None and self.scheduler.streaming_window:
            raise ValueError("prompt_logprobs: not available with StreamingLLM (streaming_window)")
        seed = self.hash_seed
        if lora is not None:   # its KV differs from the base model's and every other adapter's: its own hash chain
            seed = lora_hash_seed(seed, lora.lora_name, self.add_lora(lora))
        self._arrivals += 1
        seq = Sequence(request_id, ids, params, self.model_config.eos_token_ids, self.model_config.max_model_len,
                       self._arrivals, hold_blocks, seed)
        seq.lora = lora
        if params.structured_outputs is not None:
            from pdcluster.engine.structured_output import Grammar  # xgrammar: loaded when first needed
            spec = params.structured_outputs
            seq.grammar = Grammar(self.grammar_compiler().submit(spec), spec.get("after"))
        return seq

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            from pdcluster.engine.structured_output import BitmaskBuffer, GrammarCompiler

            cfg = self.model_config
            self._grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
            self.runner.sampler.bitmask = BitmaskBuffer(cfg.vocab_size)
        return self._grammars

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    hold_blocks: bool = False, remote_kv: bool = False,
                    resumed_output_ids: list[int] | None = None, fetch_blocks: int = 0,
                    lora: LoRARequest | None = None) -> bool:
        """Queue a request. `hold_blocks`: a finished request keeps its blocks (and reports them in
        `block_ids`) until `abort`. `remote_kv`: another node computes the prompt's KV: blocks for the whole
        prompt are reserved now (leading prefix-cache hits shared), `kv_connector.on_remote_reserved` gets them
        before this returns, and the request waits (never scheduled) for `remote_kv_landed` or
        `remote_kv_failed`; False, adding nothing, when too few blocks are free. True otherwise.
        `resumed_output_ids` (a migrated structured-output request): its outputs so far, the tail of the prompt,
        which its grammar accepts before it samples. `fetch_blocks`: another node holds the prompt's first that
        many blocks; those this node lacks are fetched (`KVConnector.on_fetch`) before the prompt is computed
        (or, with `remote_kv`, before its blocks are reserved: `on_remote_reserved` comes later then).
        `lora`: run under that adapter (loaded first if the engine does not hold it yet; `enable_lora`)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, hold_blocks, lora)
        seq.fetch_blocks = max(0, int(fetch_blocks))
        if seq.grammar is not None:   # a migrated request's outputs so far (the tail of its prompt) obey the grammar
            if remote_kv and resumed_output_ids:
                raise ValueError("structured_outputs: a resumed request is prefilled where its grammar runs")
            for token in resumed_output_ids or []:
                seq.grammar.accept(token)
        if remote_kv and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: the prompt's logits are computed where it runs: prefill it here")
        if not remote_kv:
            self.scheduler.add(seq)
            return True
        if not self.scheduler.add_remote(seq):
            return False
        if self.kv_connector is not None and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            try:
                self.kv_connector.on_remote_reserved(request_id, list(seq.block_table), seq.num_cached_tokens)
            except BaseException:
                self.scheduler.abort(request_id)
                raise
        return True

    # ---- LoRA adapters (engine/lora/) ----------------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> str:
        """Load and check an adapter (once per name; ValueError naming what cannot be served); its content
        hash. Requests name it by `LoRARequest` (`add_request(lora=...)`)."""
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the engine runs without enable_lora")
        return self.runner.lora.add(lora)

    def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter (False if unknown); ValueError while a request still runs under it."""
        if self.runner.lora is None:
            return False
        busy = [s.request_id for s in self.scheduler.requests.values() if s.lora and s.lora.lora_name == lora_name]
        if busy:
            raise ValueError(f"LoRA adapter {lora_name!r} is in use by {len(busy)} request(s), e.g. {busy[0]!r}")
        return self.runner.lora.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters this engine holds, by name."""
        known = self.runner.lora.known if self.runner.lora is not None else {}
        return [known[name][0] for name in sorted(known)]

    def _reserved_later(self, seq: Sequence) -> None:
        """A `remote_kv` request's blocks, reserved once its prefix was loaded (in `step`)."""
        if self.kv_connector is not None:
            self.kv_connector.on_remote_reserved(seq.request_id, list(seq.block_table), seq.num_cached_tokens)

    def kv_fetch_done(self, request_id: str, block_ids: list[int], done: int) -> None:
        """A fetch started by `KVConnector.on_fetch` ended with its first `done` blocks intact in `block_ids`
        (0 when it failed): they join the prefix cache and the request is admitted with them as prefix hits; the
        rest of its prompt is computed. The blocks are unpinned (an aborted request's freed)."""
        if not 0 <= done <= len(block_ids):
            raise ValueError(f"done: {done} is not in [0, {len(block_ids)}]")
        self.num_fetched_blocks += done
        self.num_fetch_missed_blocks += len(block_ids) - done
        self.scheduler.prefix_load_done(request_id, list(block_ids), done)

    def prefetch(self, request_id: str, token_ids: list[int], num_blocks: int) -> tuple[int, bool]:
        """A live migration's pre-copy: the first `num_blocks` blocks of `token_ids` (a request running on another
        node, which holds them) into this pool's prefix cache, held under `request_id` until `abort(request_id)`,
        so the request's next attempt here finds them as prefix hits. The blocks this pool lacks are fetched
        (`KVConnector.on_fetch`, then `kv_fetch_done`). Returns (blocks held from this pool, whether a fetch
        started); no fetch when this engine cannot copy blocks or holds them all."""
        seq = self._new_sequence(request_id, token_ids, SamplingParams(max_tokens=1))
        seq.fetch_blocks = max(0, int(num_blocks)) if self.scheduler.fetch is not None else 0
        return self.scheduler.prefetch(seq)

    def pin_cached(self, block_hashes: list[int]) -> list[int]:
        """Pin the pool blocks published under the leading `block_hashes` (for a copy to another node); returns
        them in order, up to the first hash not cached. `unpin` each when the copy is done."""
        bm = self.scheduler.block_manager
        if not self.copies_blocks:
            return []
        blocks = bm.cached_blocks(block_hashes)
        for b in blocks:
            bm.pin(b)
        self.num_lent_blocks += len(blocks)
        return blocks

    def unpin(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.scheduler.block_manager.unpin(b)

    def remote_kv_landed(self, request_id: str, first_token: int, first_logprobs=None,
                         prompt_features: tuple[int, str, bytes] | None = None) -> RequestOutput:
        """The prompt KV of a `remote_kv` request is in its blocks: it runs from `first_token` (sampled by the
        remote side) on. The returned output reports that token (and whether the request finished on it).
        `prompt_features`: the remote side's `RequestOutput.prompt_features`, for a hidden-state head (ignored
        when they do not fit). ValueError when the request is not waiting for remote KV, or the token is outside
        the vocabulary."""
        if not 0 <= int(first_token) < self.model_config.vocab_size:
            raise ValueError(f"first_token: {first_token} is not in [0, {self.model_config.vocab_size})")
        seq = self.scheduler.waiting_for_kv.get(request_id)
        if seq is not None and seq.grammar is not None:
            seq.grammar.matcher_now()   # the remote side compiled it too: a short wait, or its ValueError
        seq = self.scheduler.remote_kv_landed(request_id, int(first_token), first_logprobs)
        if prompt_features is not None and isinstance(self.proposer, HeadProposer) and not seq.stopped:
            self.proposer.accept_prompt_features(seq, *prompt_features)
        return _request_output(seq)

    def remote_kv_failed(self, request_id: str) -> None:
        """The remote prefill of a `remote_kv` request is given up (no write can land any more): its reserved
        blocks are freed and it waits as an ordinary request (a local prefill). Unknown ids are a no-op."""
        self.scheduler.remote_kv_failed(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (waiting, running, waiting for remote KV, or finished and holding its blocks) and
        free its blocks now (full ones stay in the prefix cache). Unknown ids are a no-op."""
        self.scheduler.abort(request_id)

    def abort_all(self) -> None:
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests in any state, or copies of the KV tiers in flight (blocks pinned for them)."""
        return self.scheduler.has_work() or (self.tiers is not None and self.tiers.busy)

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel rank died)."""
        workers = self.runner.workers
        if workers is not None and workers.dead is not None:
            raise workers.dead

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (also done at interpreter exit); the engine is unusable after."""
        if self.runner.workers is not None:
            self.runner.workers.close()
        if self._grammars is not None:
            self._grammars.shutdown()
        if self.tiers is not None:
            self.tiers.close()

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        failed = [_request_output(seq) for seq in self.scheduler.admit_compiled()] \
            if self.scheduler.waiting_for_grammar else []
        if self.tiers is not None:
            self._finish_tier_copies()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.waiting_for_grammar:   # nothing runs but a compile: wait for it, do not spin
                next(iter(self.scheduler.waiting_for_grammar.values())).grammar.wait(GRAMMAR_IDLE_WAIT_S)
            elif self.tiers is not None and self.tiers.busy:   # ... or a tier's copy
                self._finish_tier_copies(TIER_IDLE_WAIT_S)
            return failed
        self.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.num_decode_tokens += n
            else:
                self.num_prefill_tokens += n
        connector = self.kv_connector
        try:
            if connector is None:
                sampled, tokens, logprobs = self.runner.run(batch)
            else:
                prompts = _prompts_finishing(batch)
                connector.on_step_start(prompts)
                sampled, tokens, logprobs = self.runner.run(
                    batch, connector.on_layer_done if connector.layerwise and prompts else None)
                for p in prompts:
                    connector.on_prompt_done(p.request_id, p.block_ids)
        except LoRAUnavailable as exc:   # before the forward pass: nothing of the batch was computed
            return failed + self._end_lora_requests(exc.name, str(exc))
        self.num_generated_tokens += len(sampled)
        self._rate_marks.append((time.monotonic(), self.num_generated_tokens))
        self._drop_old_rate_marks()
        done = self.scheduler.update_from_output(batch, sampled, tokens, logprobs)
        if self.tiers is not None:
            self._offload_published()
        outputs = [_request_output(seq) for seq in done]
        if isinstance(self.proposer, HeadProposer):   # a prefill node's prompt: its features go with its KV
            for seq, out in zip(done, outputs, strict=True):
                if seq.stopped and seq.hold_blocks:
                    out.prompt_features = self.proposer.export_prompt_features(seq)
        return failed + outputs

    def _end_lora_requests(self, name: str, error: str) -> list[RequestOutput]:
        """End every request under adapter `name` with `error` (finish "abort"); the others go on next step."""
        outputs = []
        for seq in [s for s in self.scheduler.requests.values() if s.lora is not None and s.lora.lora_name == name]:
            self.scheduler.abort(seq.request_id)
            seq.error, seq.finish_reason = error, "abort"
            outputs.append(_request_output(seq))
        log.warning("%s: %d request(s) ended", error, len(outputs))
        return outputs

    def _finish_tier_copies(self, timeout: float = 0.0) -> None:
        """Unpin the blocks the KV tiers finished storing; hand finished loads to the scheduler."""
        assert self.tiers is not None
        done = self.tiers.poll(timeout)
        bm = self.scheduler.block_manager
        for b in done.stored:
            bm.unpin(b)
        for load in done.loaded:
            self.scheduler.prefix_load_done(load.request_id, load.blocks, load.done)

    def _offload_published(self) -> None:
        """Blocks this step published in the prefix cache go to the host tier (pinned until copied), unless a tier
        holds them already."""
        assert self.tiers is not None
        bm = self.scheduler.block_manager
        for b, h in bm.take_published():
            if bm.block_hash[b] != h or self.tiers.holds(h):   # evicted since (a load's blocks), or stored already
                continue
            bm.pin(b)
            if not self.tiers.submit_store(b, h):
                bm.unpin(b)
        self.tiers.flush()

    def _propose(self) -> None:
        """Drafts for every sequence that decodes next step, as many as the draft policy gives it
        (engine/speculative/policy.py) within num_speculative_tokens, its max_tokens and the context, none while
        `disable_by_batch_size` or more sequences run; only what its grammar allows, and (a drafter with its own
        KV) only where its blocks could be reserved. A proposer that drafts cheaply (n-gram) drafts the most first
        and the policy picks from the drafts made. A proposer that follows the target's hidden states also gets
        the other running sequences (limit 0)."""
        proposer = self.proposer
        assert proposer is not None
        sched = self.scheduler
        seqs = sched.drafting()
        spec = self.args.speculative
        assert spec is not None
        off = 0 < spec.disable_by_batch_size <= len(sched.running)
        if off:
            for seq in seqs:   # drafts a sequence still holds from a step that did not reach it go too
                sched.set_drafts(seq, [])
        most = spec.num_speculative_tokens
        caps = [0 if off else max(0, min(most, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                                         seq.max_model_len - seq.num_tokens - 1)) for seq in seqs]
        made = proposer.propose(seqs, caps) if proposer.drafts_cheaply else None
        limits = self.draft_policy.choose(seqs, caps if made is None else [len(d) for d in made],
                                          self.runner.last_decode_step, len(sched.running) - len(seqs))
        if made is None:
            for i, (seq, k) in enumerate(zip(seqs, limits, strict=True)):
                if k > 0 and proposer.writes_kv and not sched.reserve_draft_slots(seq, k):
                    limits[i] = 0
            if proposer.follows_target:
                drafting = {id(s) for s in seqs}
                # (not a prefill node's prompts: their features are kept for the decode node's head)
                others = [s for s in sched.running
                          if id(s) not in drafting and s.proposer_state is not None and not s.hold_blocks]
                seqs, limits = seqs + others, limits + [0] * len(others)
            elif off:
                return
            if not seqs:
                return
            made = proposer.propose(seqs, limits)
        for seq, k, drafts in zip(seqs, limits, made, strict=True):
            drafts = drafts[:k]
            if drafts and seq.grammar is not None:
                drafts = drafts[:seq.grammar.valid_drafts(drafts)]
            if k > 0 or seq.spec_token_ids:
                sched.set_drafts(seq, drafts)

    # ---- stats ----------------------------------------------------------------------------------

    def cached_block_hashes(self, limit: int = 4096) -> list[int]:
        """Stable hashes (`pdcluster.control.block_hash`) of blocks in the prefix cache, most recently used
        first: what prefix-aware routing may count on this engine holding."""
        return self.scheduler.block_manager.cached_hashes(limit)

    def kv_events(self, snapshot: bool = False, limit: int = 65536) -> tuple[list[list], bool]:
        """(block-hash events since the last call, whether they are a snapshot): `[[op, tier, [hash, ...]], ...]`
        (engine/kv_events.py). The first call, `snapshot`, and a log that overflowed give a snapshot instead: what
        each tier holds (STORED groups, most recently used first, at most `limit` per tier), after which the events
        continue from there. Call on the engine thread."""
        bm = self.scheduler.block_manager
        if bm.events is None:
            bm.events = KVEventLog()
            if self.tiers is not None:
                self.tiers.events = bm.events
            snapshot = True
        events, lost = bm.events.take()
        if not (snapshot or lost):
            return events, False
        groups = [[STORED, POOL, bm.cached_hashes(limit)]]
        if self.tiers is not None:
            host, disk = self.tiers.snapshot(limit)
            groups += [[STORED, HOST, host], [STORED, DISK, disk]]
        return [g for g in groups if g[2]], True

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
        sched = self.scheduler
        bm = sched.block_manager
        return EngineStats(
            num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_reserved_blocks=sched.num_reserved_blocks(), num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_waiting_for_kv=len(sched.waiting_for_kv),
            num_waiting_for_grammar=len(sched.waiting_for_grammar),
            num_preemptions=sched.num_preemptions, prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_query_tokens=bm.prefix_query_tokens, num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens, num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps, max_num_seqs=sched.max_num_seqs, tokens_per_s=self.tokens_per_s(),
            expert_layers=self.runner.expert_load.layers, expert_tokens=self.runner.expert_load.read(),
            spec_method=self.args.speculative.method if self.args.speculative is not None else "",
            spec_num_drafts=sched.spec.num_drafts, spec_num_draft_tokens=sched.spec.num_draft_tokens,
            spec_num_accepted_tokens=sched.spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(sched.spec.accepted_per_position),
            num_loading_kv=len(sched.loading) + len(sched.fetching), kv_fetched_blocks=self.num_fetched_blocks,
            kv_fetch_missed_blocks=self.num_fetch_missed_blocks, kv_lent_blocks=self.num_lent_blocks,
            **(self.tiers.figures() if self.tiers is not None else {}))


def _prompts_finishing(batch: ScheduledBatch) -> list[PromptInStep]:
    return [PromptInStep(seq.request_id, list(seq.block_table), seq.num_prompt_tokens)
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + n]


def _request_output(seq: Sequence) -> RequestOutput:
    """The output of a sequence after a step: the tokens the step appended (one, or several when drafts passed),
    O(1) in the output length; the whole completion only once the sequence finished."""
    want_lp = seq.params.logprobs is not None
    new = len(seq.output_token_ids) - seq.num_step_tokens
    completions = []
    if seq.stopped:
        completions.append(CompletionOutput(
            index=0, text="", token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if want_lp and seq.output_logprobs else None,
            logprobs=list(seq.output_logprobs) if want_lp else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
    return RequestOutput(
        request_id=seq.request_id, prompt=None, prompt_token_ids=seq.prompt_token_ids, outputs=completions,
        finished=seq.stopped, new_token_ids=seq.output_token_ids[new:],
        logprobs=seq.output_logprobs[new:] if want_lp else None, finish_reason=seq.finish_reason,
        num_cached_tokens=seq.num_cached_tokens, block_ids=list(seq.block_table) if seq.hold_blocks else None,
        prompt_logprobs=seq.prompt_logprobs if new == 0 or seq.stopped else None,
        error=seq.error)
