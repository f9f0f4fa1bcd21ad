"""Runs one scheduled batch: builds flattened step inputs with a few tensor ops, runs the model over
the paged KV pool, computes logits only where a token is sampled, and samples."""

from __future__ import annotations

from typing import Callable

import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.attention import AttentionMetadata, PrefillChunk, get_backend_class
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.loader import load_model
from pdcluster.engine.sampler import Sampler, SampleRequest
from pdcluster.engine.scheduler import ScheduledBatch
from pdcluster.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention_backend: str | None = None, seed: int = 0, weight_pool=None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        backend_cls = get_backend_class(attention_backend, device.type)
        self.attn_backend = backend_cls(config.num_heads, config.num_kv_heads, config.head_dim)
        self.model = load_model(model_dir, config, dtype, device, self.attn_backend, weight_pool)
        self.sampler = Sampler(seed=seed)
        self.kv_pool: KVCachePool | None = None
        self.block_size = 0

    def bind_kv_pool(self, pool: KVCachePool) -> None:
        self.kv_pool = pool
        self.block_size = pool.block_size
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = pool.layer_views(i)

    def _prepare(self, batch: ScheduledBatch):
        """Flattened inputs; decodes (one new token) first, then prefill chunks."""
        bs = self.block_size
        # Decodes sorted by context length, so that rows of similar length are neighbours (the torch backend
        # gathers decode K/V in groups of rows: TorchAttentionMetadata.decode_groups).
        order = sorted(range(len(batch)),
                       key=lambda i: (batch.num_new_tokens[i] != 1, batch.seqs[i].num_computed_tokens))
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        num_decode = sum(1 for n in counts if n == 1)
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prefills: list[tuple[int, int, int, int]] = []   # (row in batch, start, end, num_cached)
        for row, (seq, n) in enumerate(zip(seqs, counts)):
            start = len(ids)
            c = seq.num_computed_tokens
            if n == 1:
                ids.append(seq.token_ids[c])
                positions.append(c)
            else:
                ids.extend(seq.token_ids[c:c + n])
                positions.extend(range(c, c + n))
                prefills.append((row, start, start + n, c))
            if c + n == seq.num_tokens:
                sample_rows.append(start + n - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                              dtype=torch.long)
        counts_t = torch.tensor(counts, dtype=torch.long)
        positions_t = torch.tensor(positions, dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), counts_t)
        slot_blocks = tables[seq_of_token, positions_t // bs]
        meta = AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=positions_t % bs, num_decode_tokens=num_decode)
        if num_decode:
            dec_blocks = max(len(s.block_table) for s in seqs[:num_decode])
            meta.decode_block_tables = tables[:num_decode, :dec_blocks]
            meta.decode_context_lens = (positions_t[:num_decode] + 1).to(torch.int32)
        for row, start, end, c in prefills:
            nblocks = -(-(c + end - start) // bs)
            meta.prefills.append(PrefillChunk(start, end, c, tables[row, :nblocks]))
        ids_t = torch.tensor(ids, dtype=torch.long)
        if self.device.type != "cpu":
            ids_t = ids_t.to(self.device, non_blocking=True)
            positions_t = positions_t.to(self.device, non_blocking=True)
            meta = _to_device(meta, self.device)
        return ids_t, positions_t, meta, sample_rows, sample_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, layer_done_callback: Callable[[int], None] | None = None):
        """Returns (sequences that got a token, tokens, logprobs)."""
        ids, positions, meta, sample_rows, sample_seqs = self._prepare(batch)
        hidden = self.model(ids, positions, self.attn_backend.prepare(meta), layer_done_callback)
        if not sample_seqs:
            return [], [], []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        requests = [SampleRequest(s.params, s.prompt_token_ids, s.output_token_ids, s.eos_token_ids)
                    for s in sample_seqs]
        tokens, logprobs = self.sampler(logits, requests)
        return sample_seqs, tokens, logprobs

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits for every position of one prompt computed from scratch into `block_table` (testing aid)."""
        seq = Sequence("_logits", token_ids, SamplingParams(max_tokens=1), [], len(token_ids) + 1, 0)
        seq.block_table = list(block_table)
        ids, positions, meta, _, _ = self._prepare(ScheduledBatch([seq], [len(token_ids)]))
        return self.model.compute_logits(self.model(ids, positions, self.attn_backend.prepare(meta))).float()


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def mv(t):
        return None if t is None else t.to(device, non_blocking=True)

    return AttentionMetadata(
        slot_blocks=mv(meta.slot_blocks), slot_offsets=mv(meta.slot_offsets), num_decode_tokens=meta.num_decode_tokens,
        decode_block_tables=mv(meta.decode_block_tables), decode_context_lens=mv(meta.decode_context_lens),
        prefills=[PrefillChunk(p.start, p.end, p.num_cached, mv(p.block_table)) for p in meta.prefills])
