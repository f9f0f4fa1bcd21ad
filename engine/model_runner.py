"""Runs one scheduled batch: builds flattened step inputs with a few tensor ops, runs the model over
the paged KV pool, computes logits only where a token is sampled, and samples.

Under tensor parallelism this is rank 0's runner: it hands each step's inputs to the other ranks
(engine/tp_executor.py), runs its own shard of the model with them (the layers' collectives keep the ranks in
step), and samples alone. The other ranks run `execute` with the same inputs (engine/tp_worker.py)."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from pdcluster.engine.attention import AttentionMetadata, PrefillChunk, get_backend_class
from pdcluster.engine.attention.mla import mla_backend
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
from pdcluster.engine.compiled import CompiledBody
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.cpu_decode import DecodePlan
from pdcluster.engine.expert_load import ExpertLoadCounter
from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.layers.moe import FusedMoE
from pdcluster.engine.loader import load_model
from pdcluster.engine.lora.request import LoRAConfig
from pdcluster.engine.lora.slots import LoRASlots
from pdcluster.engine.malloc import keep_freed_memory
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.sampler import Sampler, SampleRequest, gather_logprobs
from pdcluster.engine.scheduler import ScheduledBatch
from pdcluster.engine.sequence import Sequence
from pdcluster.engine.step_inputs import StepInputs
from pdcluster.engine.tp_shards import local_kv_heads

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention_backend: str | None = None, seed: int = 0, weight_pool=None, tp: TPGroup | None = None,
                 workers=None, enforce_eager: bool = True, lora: LoRAConfig | None = None) -> None:
        """`tp`: this process's tensor-parallel rank; `workers` (rank 0 of a group: a `TPWorkers`): the other
        ranks, which get every step's inputs from here. `enforce_eager` False: the model body runs compiled
        (engine/compiled.py) on a single rank. `lora`: serve LoRA adapters (engine/lora/), eagerly."""
        self.config = config
        self.dtype = dtype
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()   # each step's large temporaries: reused heap, not fresh pages (engine/malloc.py)
        self.tp = tp or TPGroup()
        self.workers = workers
        backend_cls = get_backend_class(attention_backend, device.type)
        if config.mla is not None:   # latent KV: the MLA backend of the same device (engine/attention/mla.py)
            self.attn_backend = mla_backend(config, self.tp.size, backend_cls.name)
        else:
            self.attn_backend = backend_cls(config.num_heads // self.tp.size, local_kv_heads(config, self.tp.size),
                                            config.head_dim)
        self.model = load_model(model_dir, config, dtype, device, self.attn_backend, weight_pool, self.tp)
        self.expert_load = ExpertLoadCounter(self.model, enabled=self.tp.rank == 0)
        # The last layer's MLP may skip the rows no logit needs (StepInputs.logit_rows_only), unless it routes
        # experts: their load counts every token the router sees (engine/expert_load.py)
        self.cut_last_layer = not any(isinstance(m, FusedMoE) for m in self.model.model.layers[-1].modules())
        self.lora = LoRASlots(self.model, config, lora, dtype, device, self.tp) if lora is not None else None
        self.compiled: CompiledBody | None = None
        # the compiled body's opaque attention op is the regular backend's; MLA runs eagerly
        # tp > 1 all-reduces in Python; quantized layers call their kernels eagerly
        if not enforce_eager and self.tp.size == 1 and config.mla is None and config.quantization is None \
                and lora is None:
            body = self.model.model
            self.compiled = CompiledBody(lambda ids, positions: body(ids, positions, None),
                                         self.model.attention_layers())
        # decode steps as flat native kernel calls where the model and device allow (engine/cpu_decode.py)
        self.decode_plan = DecodePlan.build(self.model, self.attn_backend) if self.lora is None \
            and self.tp.size == 1 and self.compiled is None else None
        self.sampler = Sampler(seed=seed)
        # A hidden-state head (engine/speculative/heads.py) takes each step's last hidden states (or the
        # residual stream entering the layers `capture_layers` names, concatenated) of its tokens
        self.feature_sink: Callable[[Sequence, int, torch.Tensor], None] | None = None
        self.features: torch.Tensor | None = None
        self.kv_pool: KVCachePool | None = None
        self.block_size = 0
        # The torch-path backends (cpu, torch) read a decode row's context through its own table and length, so
        # a verified sequence's rows can be decode rows (`prepare_step`); the others take them as a chunk
        self.drafts_as_decode_rows = isinstance(self.attn_backend, TorchAttentionBackend)
        # (rows, time.perf_counter() at its end) of the last step if it only decoded (or verified drafts): what the
        # draft policy times
        self.last_decode_step: tuple[int, float] | None = None

    def bind_kv_pool(self, pool: KVCachePool) -> None:
        """`pool` holds this rank's slice (pool.tp == 1) or every rank's (CPU: shared with the workers, which
        bind the same pool's other slices). A latent pool binds each layer's one latent plane as k_cache (and
        v_cache None), the same plane for every rank."""
        self.kv_pool = pool
        self.block_size = pool.block_size
        rank = self.tp.rank if pool.tp > 1 else 0
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = pool.layer_views(i, rank)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        inputs, sample_seqs = prepare_step(batch, self.block_size, self.drafts_as_decode_rows)
        if self.lora is not None:
            self.lora.assign(inputs)
        inputs.logit_rows_only = self.cut_last_layer and self.lora is None and self.feature_sink is None
        return inputs, sample_seqs

    @torch.inference_mode()
    def execute(self, inputs: StepInputs,
                layer_done_callback: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """One forward pass; the logits of `inputs.sample_rows` (None if there are none). Every rank runs it
        with the same inputs."""
        if self.lora is not None:
            self.lora.begin_step(inputs.lora_slots, inputs.lora_loads)
        inputs = inputs.to(self.device)
        meta = self.attn_backend.prepare(inputs.meta)
        hidden = None
        aux = self.model.model.capture_layers if self.feature_sink is not None else ()
        # a callback per layer, or capturing layers' inputs, needs the eager loop
        if self.compiled is not None and layer_done_callback is None and not aux:
            try:
                hidden = self.compiled(inputs.ids, inputs.positions, meta)
            except torch._dynamo.exc.TorchDynamoException:   # could not compile: eager from now on (KV rewritten)
                log.exception("compiling the model body failed; running eagerly")
                self.compiled = None
        plan = self.decode_plan
        if hidden is None and plan is not None and layer_done_callback is None and not aux \
                and plan.covers(meta, inputs.ids.shape[0]):
            hidden = plan.forward(inputs.ids, inputs.positions, meta)
        rows = inputs.sample_rows
        logit_rows = None   # set: the model returned only these rows' hidden states, in this order
        if hidden is None:
            if inputs.logit_rows_only and len(rows) < inputs.ids.shape[0]:
                logit_rows = torch.tensor(rows, dtype=torch.long, device=inputs.ids.device)
            hidden = self.model(inputs.ids, inputs.positions, meta, layer_done_callback, logit_rows)
        self.expert_load.accumulate()
        if self.feature_sink is not None:
            self.features = torch.cat(self.model.model.captured, dim=-1) if aux else hidden
        if not rows:
            return None
        if logit_rows is None and (len(rows) < hidden.shape[0] or rows != list(range(len(rows)))):   # else: no gather
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))
        return self.model.compute_logits(hidden)

    def execute_all_ranks(self, inputs: StepInputs,
                          layer_done_callback: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """`execute` here and on the other tensor-parallel ranks (they get `inputs` first)."""
        if self.workers is None:
            return self.execute(inputs, layer_done_callback)
        self.workers.broadcast(inputs)
        try:
            return self.execute(inputs, layer_done_callback)
        except Exception as exc:   # a collective failed or timed out: name the rank behind it
            raise self.workers.failure(exc) from exc

    def run(self, batch: ScheduledBatch, layer_done_callback: Callable[[int], None] | None = None):
        """Returns (sequences that got tokens, their tokens, their logprobs): one token per sequence, or for a
        sequence with drafts the drafts that passed and the token drawn after them (`verify`)."""
        inputs, sample_seqs = self.prepare(batch)
        out = self._run(inputs, sample_seqs, layer_done_callback)
        decoded = all(n == 1 or s.spec_token_ids for s, _, n in inputs.seq_rows)
        self.last_decode_step = (len(inputs.ids), time.perf_counter()) if decoded else None
        return out

    def _run(self, inputs: StepInputs, sample_seqs: list[Sequence],
             layer_done_callback: Callable[[int], None] | None):
        logits = self.execute_all_ranks(inputs, layer_done_callback)
        if logits is None:
            self._hand_features(inputs, [], [])
            return [], [], []
        requests = []
        for s in sample_seqs:
            requests.append(SampleRequest(s.params, s.prompt_token_ids, s.output_token_ids, s.eos_token_ids,
                                          s.grammar))
            for j in range(1, len(s.spec_token_ids) + 1):   # a row per draft: the output as if they passed
                drafts = s.spec_token_ids[:j]
                requests.append(SampleRequest(s.params, s.prompt_token_ids, s.output_token_ids + drafts,
                                              s.eos_token_ids, s.grammar, drafts))
        with torch.inference_mode():
            if inputs.prompt_spans:
                _add_prompt_logprobs(logits[len(requests):], inputs.prompt_spans)
                logits = logits[:len(requests)]
            if not sample_seqs:
                return [], [], []
            tokens, logprobs = self.sampler(logits, requests)
        token_lists, logprob_lists = verify(sample_seqs, tokens, logprobs)
        self._hand_features(inputs, sample_seqs, token_lists)
        return sample_seqs, token_lists, logprob_lists

    def _hand_features(self, inputs: StepInputs, sampled: list[Sequence], token_lists: list[list[int]]) -> None:
        """Each sequence's features of this step's positions to the sink: every row of a chunk, of a verified
        one the rows of its last token and the drafts kept (the rest saw rejected tokens)."""
        features, sink = self.features, self.feature_sink
        if sink is None or features is None:   # no head: nothing to do on the step's path
            return
        self.features = None
        verified = {id(s): len(t) for s, t in zip(sampled, token_lists, strict=True) if s.spec_token_ids}
        for seq, row, n in inputs.seq_rows:
            sink(seq, seq.num_computed_tokens, features[row:row + verified.get(id(seq), n)])


def prepare_step(batch: ScheduledBatch, block_size: int,
                 drafts_as_decode_rows: bool = False) -> tuple[StepInputs, list[Sequence]]:
    """Flattened inputs (on CPU); decodes (one new token) first, then prefill chunks. Also the sequences
    that get a token this step, in the order of `sample_rows`. `drafts_as_decode_rows`: a sequence with drafts
    is 1 + k decode rows (row j attends to its context through position c + j: its K/V, drafts' included, are
    written before attention reads) instead of a chunk: on CPU a chunk costs a prefill-kernel call per layer and
    sequence (~10 ms a sequence for SmolLM2 at batch 8, docs/speculative_decoding.md)."""
    bs = block_size

    def decodes(i: int) -> bool:
        return batch.num_new_tokens[i] == 1 or (drafts_as_decode_rows and bool(batch.seqs[i].spec_token_ids))

    # Decodes sorted by context length, so that rows of similar length are neighbours (the torch backend
    # gathers decode K/V in groups of rows: TorchAttentionMetadata.decode_groups).
    order = sorted(range(len(batch)), key=lambda i: (not decodes(i), batch.seqs[i].num_computed_tokens))
    seqs = [batch.seqs[i] for i in order]
    counts = [batch.num_new_tokens[i] for i in order]
    num_decode = sum(batch.num_new_tokens[i] for i in order if decodes(i))
    ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    prefills: list[tuple[int, int, int, int]] = []   # (row in batch, start, end, num_cached)
    prompt_rows: list[int] = []
    prompt_spans: list[tuple[Sequence, int, int]] = []
    seq_rows: list[tuple[Sequence, int, int]] = []
    for row, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
        start = len(ids)
        seq_rows.append((seq, start, n))
        c = seq.num_computed_tokens
        drafts = seq.spec_token_ids
        if n == 1:
            ids.append(seq.token_ids[c])
            positions.append(c)
        elif drafts:   # the last token and the drafts after it: decode rows, or a short chunk over the context
            ids.append(seq.token_ids[c])
            ids.extend(drafts)
            positions.extend(range(c, c + n))
            if not drafts_as_decode_rows:
                prefills.append((row, start, start + n, c))
        else:
            ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            prefills.append((row, start, start + n, c))
            if seq.needs_prompt_logprobs:   # the logits at position p score prompt token p + 1
                assert seq.prompt_logprobs is not None
                first, end = max(c + 1, len(seq.prompt_logprobs)), min(c + n, seq.num_prompt_tokens - 1) + 1
                if first < end:
                    prompt_rows.extend(range(start + first - 1 - c, start + end - 1 - c))
                    prompt_spans.append((seq, first, end - first))
        if drafts:   # every row is scored: row j's token is what the model draws after the first j drafts
            sample_rows.extend(range(start, start + n))
            sample_seqs.append(seq)
        elif c + n == seq.num_tokens:
            sample_rows.append(start + n - 1)
            sample_seqs.append(seq)
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                          dtype=torch.int32)
    counts_t = torch.tensor(counts, dtype=torch.long)
    positions_t = torch.tensor(positions, dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), counts_t)
    slots = (tables[seq_of_token, positions_t // bs] * bs + positions_t % bs).to(torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=num_decode)
    if num_decode:
        of_row = seq_of_token[:num_decode]   # a sequence's table once per decode row it has
        dec_blocks = max(len(seqs[i].block_table) for i in set(of_row.tolist()))
        meta.decode_block_tables = tables[of_row, :dec_blocks]
        meta.decode_context_lens = (positions_t[:num_decode] + 1).to(torch.int32)
    for row, start, end, c in prefills:
        nblocks = -(-(c + end - start) // bs)
        meta.prefills.append(PrefillChunk(start, end, c, tables[row, :nblocks]))
    return (StepInputs(torch.tensor(ids, dtype=torch.long), positions_t, meta, sample_rows + prompt_rows,
                       prompt_spans, seq_rows), sample_seqs)


def verify(seqs: list[Sequence], tokens: list[int], logprobs: list) -> tuple[list[list[int]], list[list]]:
    """Per sequence, from its rows' sampled tokens: the leading drafts equal to what the sampler drew in their
    place, then the sampler's token after them. Each row is sampled as if the drafts before it had been the
    output (penalties, grammar, min_tokens, and the seeded draw of its position), so the kept tokens are the
    ones the step-by-step sampler would have drawn: for a proposal that is one token (every proposer here
    drafts greedily), accepting a draft with the target's probability of it and otherwise drawing from the
    rest is the rejection sampling of Leviathan et al. / Chen et al., and the output distribution is the
    target's."""
    token_lists: list[list[int]] = []
    logprob_lists: list[list] = []
    row = 0
    for s in seqs:
        drafts = s.spec_token_ids
        kept = 0
        while kept < len(drafts) and tokens[row + kept] == drafts[kept]:
            kept += 1
        token_lists.append(tokens[row:row + kept + 1])
        logprob_lists.append(logprobs[row:row + kept + 1])
        row += len(drafts) + 1
    return token_lists, logprob_lists


PROMPT_LOGPROB_ROWS = 256   # rows per log-softmax: bounds its fp32 copies of [rows, vocab]


def _add_prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> None:
    """Append to each sequence's `prompt_logprobs` the entries of its prompt tokens scored this step (the
    runner is their one writer): (logprob, top-N) like a sampled token's, N = params.prompt_logprobs."""
    targets: list[int] = []
    tops: list[int] = []
    for seq, first, count in spans:
        targets.extend(seq.prompt_token_ids[first:first + count])
        tops.extend([seq.params.prompt_logprobs or 0] * count)
    entries = []
    for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        raw = torch.log_softmax(logits[i:i + PROMPT_LOGPROB_ROWS].float(), dim=-1)
        entries.extend(gather_logprobs(raw, targets[i:i + PROMPT_LOGPROB_ROWS], tops[i:i + PROMPT_LOGPROB_ROWS]))
    done = 0
    for seq, _, count in spans:
        assert seq.prompt_logprobs is not None
        seq.prompt_logprobs.extend(entries[done:done + count])
        done += count
