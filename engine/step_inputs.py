"""What one model step needs, built by the model runner on rank 0, and its wire form for the other
tensor-parallel ranks: a msgpack map holding the raw bytes of a few int tensors (no pickling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from pdcluster.engine.attention import AttentionMetadata, PrefillChunk


@dataclass
class StepInputs:
    ids: torch.Tensor          # [T] long
    positions: torch.Tensor    # [T] long
    meta: AttentionMetadata
    sample_rows: list[int]     # rows of the flattened batch whose logits are computed
    # Rank 0 only, not on the wire: after the sampled rows, sample_rows holds prompt rows whose logits give
    # prompt logprobs; per sequence (sequence, index of its first prompt token scored, count), in row order.
    prompt_spans: list[tuple[Any, int, int]] = field(default_factory=list)
    # Rank 0 only: per sequence (sequence, its first row, its row count), in row order
    seq_rows: list[tuple[Any, int, int]] = field(default_factory=list)
    # LoRA (engine/lora/slots.py): each row's adapter slot (-1: the base model), None when no row has one; the
    # slots to fill before the step, as (slot, adapter name, path, content hash)
    lora_slots: torch.Tensor | None = None
    lora_loads: list[tuple[int, str, str, str]] = field(default_factory=list)
    # No row's hidden state is wanted beyond the logits of sample_rows (no hidden-state head, no LoRA, no experts
    # in the last layer): its MLP and the final norm run on those rows alone (`LlamaModel.forward`'s logit_rows)
    logit_rows_only: bool = False

    def to(self, device: torch.device) -> "StepInputs":
        if device.type == "cpu":
            return self

        pin = device.type == "cuda"   # from pinned memory the copy is really asynchronous (pageable: a sync)

        def mv(t):
            return None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=True)

        m = self.meta
        meta = AttentionMetadata(
            slot_mapping=mv(m.slot_mapping), num_decode_tokens=m.num_decode_tokens,
            decode_block_tables=mv(m.decode_block_tables), decode_context_lens=mv(m.decode_context_lens),
            prefills=[PrefillChunk(p.start, p.end, p.num_cached, mv(p.block_table)) for p in m.prefills])
        return StepInputs(mv(self.ids), mv(self.positions), meta, self.sample_rows,
                          logit_rows_only=self.logit_rows_only)


def _pack(t: torch.Tensor | None):
    if t is None:
        return None
    t = t.contiguous()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes()]


def _unpack(v) -> torch.Tensor:
    dtype, shape, data = v
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


def _unpack_optional(v) -> torch.Tensor | None:
    return None if v is None else _unpack(v)


def encode(inputs: StepInputs) -> bytes:
    m = inputs.meta
    return msgpack.packb({
        "t": [_pack(t) for t in (inputs.ids, inputs.positions, m.slot_mapping, m.decode_block_tables,
                                 m.decode_context_lens)],
        "nd": m.num_decode_tokens,
        "pf": [[p.start, p.end, p.num_cached, _pack(p.block_table)] for p in m.prefills],
        "rows": inputs.sample_rows,
        "lora": [_pack(inputs.lora_slots), [list(load) for load in inputs.lora_loads]],
        "lro": inputs.logit_rows_only,
    })


def decode(data: bytes) -> StepInputs:
    d = msgpack.unpackb(data)
    ids, positions, slot_mapping = (_unpack(v) for v in d["t"][:3])
    tables, lens = (_unpack_optional(v) for v in d["t"][3:])
    meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=d["nd"],
                             decode_block_tables=tables, decode_context_lens=lens,
                             prefills=[PrefillChunk(s, e, c, _unpack(t)) for s, e, c, t in d["pf"]])
    lora_slots, loads = d["lora"]
    return StepInputs(ids, positions, meta, d["rows"], lora_slots=_unpack_optional(lora_slots),
                      lora_loads=[tuple(load) for load in loads], logit_rows_only=d["lro"])
