"""KV between pools whose engines split the same KV heads over different numbers of tensor-parallel ranks.

A pool holds each rank's heads in that rank's K and V planes (layout.py); rank r holds the model's heads
`KVLayout.rank_heads(r)`. Between a sender of one split and a receiver of another, each receiver (rank, head)
slot takes its head from one sender rank that holds it: `pieces` lists those as runs of consecutive heads,
the same for every layer, K and V. Either pool may be one rank's slice of its engine (layout.py `rank_slices`,
kv_transfer/per_rank/): the heads are mapped between the engines (`engine_layout`) and a slice keeps its own rank's
pieces, so a pair of pools moves the heads it has in common (a whole pool sends a receiving slice just its heads,
row by row over tcp: `tiles`; a sending slice fills part of a receiving pool, whose checksum then covers just the
slots it fills: `fills`). A receiving pool takes each head once, from the first sender rank holding it; where the
model has fewer KV heads than slices, the receiving pools holding copies of a head take it from the sender ranks
holding it in turn (engines sliced alike: rank r from rank r), so a sending slice holding a copy that another sends
into that pool sends nothing there and is no writer of it (`writers`, `writer_count`). Who moves the heads
(docs/kv_transfer.md "Heterogeneous tensor parallelism"):

- shm (`copy`): the sender writes the receiver's layout straight into the mapped pool, one strided torch copy
  per (piece, K/V, run) covering the write's layers; no staging.
- tcp (`wire_views` → `scatter_views`): the wire carries the sender's planes as they are (only the ranks the
  receiver needs: a rank that holds a copy of a head another rank already sends stays home), sent from the pool
  with no staging; the receiver reads each (token, piece) straight into its slot (scatter `recvmsg_into`), so
  no byte is copied twice. A receiver with more ranks than the model has KV heads holds copies: the one read
  off the wire is copied to the others (`replicate`), an in-pool copy of those heads only.
- tcp+int8 (`land`): the receiver already stages (it dequantizes the payload); the dequantized sender-layout
  tensor is copied into the slots instead of into the same planes.
- the collective channels (gloo, nccl, hccl: `wire_planes` / `land`): a collective moves contiguous tensors only,
  and a receiving plane interleaves the heads of several sending ranks per token, so the wire carries the sending
  ranks' whole planes (`wire_planes`; straight from the pool, no staging on the sender) into one staging tensor
  per write on the receiver's device, which `land` copies into the slots: a device-local copy of the write, never
  a host hop.
- cuda_ipc (`copy`): the receiver copies from the sender's mapped pool straight into its slots, as shm does.

Checksum: a write's checksum is, per block (weighted as checksum.py does), the sum over the receiver's slots of
their bytes as words no wider than one (token, head) row (`checksum.row_words`), so it does not depend on the
split: the receiver sums what landed as usual (over row words), the sender sums its rows once per slot they go
to (`sent_checksum`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdcluster.device import rank_kv_heads
from pdcluster.kv_transfer.checksum import Words, checksum_runs, weighted
from pdcluster.kv_transfer.errors import LayoutMismatchError
from pdcluster.kv_transfer.layout import KVLayout

if TYPE_CHECKING:
    from pdcluster.kv_transfer.channel import Channel


def regroup_for(channel_cls: "type[Channel]", src: KVLayout, dst: KVLayout) -> "Regroup | None":
    """The regrouping a connection of `channel_cls` from a `src` pool to a compatible `dst` pool needs (None: planes
    move unchanged); LayoutMismatchError when their heads are split otherwise and the channel cannot regroup."""
    if src.same_planes(dst):
        return None
    if not channel_cls.regroups:
        raise LayoutMismatchError(
            f"tensor_parallel_size: sender {src.tensor_parallel_size} vs receiver {dst.tensor_parallel_size}: the "
            f"{channel_cls.name} backend moves KV between pools of the same tensor_parallel_size only (shm, tcp and "
            "tcp+int8 regroup the heads)")
    return Regroup(src, dst)


@dataclass(frozen=True)
class Piece:
    """Receiver rank `dst_rank`'s heads [dst_head, dst_head + n) are sender rank `src_rank`'s [src_head, ...)."""
    dst_rank: int
    dst_head: int
    src_rank: int
    src_head: int
    n: int
    copy_of: "Piece | None" = None   # a replicated head: the piece that read it off the wire (tcp)


class Regroup:
    def __init__(self, src: KVLayout, dst: KVLayout):
        """Between two pools: each a whole engine's KV, or one rank's slice of it (layout.py `rank_slices`). The
        heads are mapped between the engines (`engine_layout`); a pool that is a slice keeps the pieces of its own
        rank only (ranks renumbered from 0: its planes), so a sender slice moves just the heads the receiving pool
        takes from it, and a receiving slice takes just its heads. LayoutMismatchError when they share none."""
        self.src, self.dst = src, dst
        se, de = src.engine_layout(), dst.engine_layout()
        holders: dict[int, list[tuple[int, int]]] = {}   # model head -> every (sender rank, index there) holding it
        for r in range(se.tensor_parallel_size):
            for i, head in enumerate(se.rank_heads(r)):
                holders.setdefault(head, []).append((r, i))
        takers: dict[int, list[int]] = {}   # model head -> the receiving pools holding it (a rank of a sliced engine)
        for r in range(de.tensor_parallel_size):
            for head in de.rank_heads(r):
                if _pool(dst, r) not in takers.setdefault(head, []):
                    takers[head].append(_pool(dst, r))
        pieces: list[Piece] = []
        for r in range(de.tensor_parallel_size):
            for i, head in enumerate(de.rank_heads(r)):
                # the c-th of a head's k receiving pools takes it from the c * len(held) // k-th sender rank holding
                # it: the first for one pool, each receiving slice's copy its own sender (sliced alike: rank r's)
                held, took = holders[head], takers[head]
                sr, si = held[took.index(_pool(dst, r)) * len(held) // len(took)]
                last = pieces[-1] if pieces else None
                if last is not None and (last.dst_rank, last.src_rank) == (r, sr) \
                        and (last.dst_head + last.n, last.src_head + last.n) == (i, si):
                    pieces[-1] = Piece(r, last.dst_head, sr, last.src_head, last.n + 1)
                else:
                    pieces.append(Piece(r, i, sr, si, 1))
        s0, d0 = src.own_ranks().start, dst.own_ranks().start
        pieces = [Piece(p.dst_rank - d0, p.dst_head, p.src_rank - s0, p.src_head, p.n) for p in pieces
                  if p.src_rank in src.own_ranks() and p.dst_rank in dst.own_ranks()]
        if not pieces:
            raise LayoutMismatchError(
                f"rank_slice: receiver {dst.rank_slice} of {dst.rank_slices} vs sender {src.rank_slice} of "
                f"{src.rank_slices}: no KV heads in common (the sender's heads go to other ranks' slices)")
        first: dict[tuple[int, int], Piece] = {}
        self.pieces = []
        for p in pieces:
            # a copy only arises with one head per receiver rank (more ranks than heads), so a piece is one head
            primary = first.setdefault((p.src_rank, p.src_head), p)
            self.pieces.append(p if primary is p else Piece(p.dst_rank, p.dst_head, p.src_rank, p.src_head, p.n,
                                                            copy_of=primary))
        self.wire_ranks = sorted({p.src_rank for p in self.pieces})
        # the pieces read off the wire, per sender rank in head order: they tile that rank's heads, or (a pool that
        # takes only some of a sender rank's heads) the wire carries just theirs, row by row (`tiles`)
        self.primary = {r: sorted((p for p in self.pieces if p.src_rank == r and p.copy_of is None),
                                  key=lambda p: p.src_head) for r in self.wire_ranks}
        self.tiles = {r: sum(p.n for p in ps) == src.num_kv_heads for r, ps in self.primary.items()}
        # every receiver slot of every receiver rank filled (else: the other slots are other senders' to fill)
        self.fills = all(sum(p.n for p in self.pieces if p.dst_rank == r) == dst.num_kv_heads
                         for r in range(dst.tensor_parallel_size))

    @property
    def wire_layer_bytes(self) -> int:
        """Bytes of one block's layer on the wire: K and V of the heads read off the wire, of each rank in
        `wire_ranks` (its whole planes when they tile it)."""
        heads = sum(self.src.num_kv_heads if self.tiles[r] else sum(p.n for p in self.primary[r])
                    for r in self.wire_ranks)
        return 2 * heads * self.src.block_size * self.src.row * self.src.element_size

    @property
    def plane_layer_bytes(self) -> int:
        """Bytes of one block's layer when the wire carries the whole planes of each rank in `wire_ranks` (the
        collective channels)."""
        return 2 * len(self.wire_ranks) * self.src.plane_bytes

    def wire_planes(self, layer: int) -> list[int]:
        """The sender's planes of `layer` on the wire, in wire order."""
        return [layer * self.src.kv_planes + 2 * r + kv for r in self.wire_ranks for kv in (0, 1)]

    # ---- shm: the sender writes the receiver's pool ------------------------------------------------------

    def copy(self, dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]], l0: int, l1: int) -> None:
        """dst's slots of layers [l0, l1) of the runs' blocks (dst_start, src_start, n) from src's rows."""
        for p in self.pieces:
            for kv in (0, 1):
                for d, s, n in runs:
                    dst[l0:l1, 2 * p.dst_rank + kv, d:d + n, :, p.dst_head:p.dst_head + p.n].copy_(
                        src[l0:l1, 2 * p.src_rank + kv, s:s + n, :, p.src_head:p.src_head + p.n])

    def sent_checksum(self, src_row_words: Words, src_runs: list[tuple[int, int]], l0: int, l1: int) -> int:
        """The checksum the receiver will sum over its slots, from the sender's rows (`checksum.row_words` of its
        pool, [planes, blocks, block_size, heads, words per row]): each row once per slot it goes to."""
        return _slot_checksum(src_row_words, self.src, [(2 * p.src_rank, p.src_head, p.n) for p in self.pieces],
                              src_runs, l0, l1)

    # ---- tcp: the sender's planes on the wire, scattered into the receiver's slots ----------------------------

    def wire_views(self, src_flat: memoryview, src_runs: list[tuple[int, int]], l0: int,
                   l1: int) -> list[memoryview]:
        """The sender's bytes in wire order: one contiguous view per (wire plane, run) of a rank whose heads the
        wire carries whole, else one per (token, piece), as `scatter_views` lands them."""
        step = self.src.plane_bytes
        plane = self.src.num_blocks * step
        views = []
        for layer in range(l0, l1):
            for r in self.wire_ranks:
                if self.tiles[r]:
                    views += [src_flat[q * plane + s * step:q * plane + (s + n) * step]
                              for q in (layer * self.src.kv_planes + 2 * r, layer * self.src.kv_planes + 2 * r + 1)
                              for s, n in src_runs]
                else:
                    views += _row_views(src_flat, self.src, [(r, p.src_head, p.n) for p in self.primary[r]],
                                        src_runs, layer)
        return views

    def scatter_views(self, dst_flat: memoryview, runs: list[tuple[int, int]], l0: int,
                      l1: int) -> list[memoryview]:
        """Views of the receiver's pool, in wire order, that the wire's bytes land in: one per (token, piece)."""
        views = []
        for layer in range(l0, l1):
            for r in self.wire_ranks:
                views += _row_views(dst_flat, self.dst, [(p.dst_rank, p.dst_head, p.n) for p in self.primary[r]],
                                    runs, layer)
        return views

    def replicate(self, dst: torch.Tensor, runs: list[tuple[int, int]], l0: int, l1: int) -> None:
        """Copy each replicated head from the slot the wire filled to its other slots."""
        for p in self.pieces:
            if p.copy_of is None:
                continue
            q = p.copy_of
            for kv in (0, 1):
                for d, n in runs:
                    dst[l0:l1, 2 * p.dst_rank + kv, d:d + n, :, p.dst_head:p.dst_head + p.n].copy_(
                        dst[l0:l1, 2 * q.dst_rank + kv, d:d + n, :, q.dst_head:q.dst_head + q.n])

    # ---- staged channels (tcp+int8): a sender-layout tensor into the receiver's slots ------------------------

    def land(self, dst: torch.Tensor, wire: torch.Tensor, runs: list[tuple[int, int]], l0: int, l1: int) -> None:
        """wire: [layers, wire ranks, 2, blocks, block_size, sender heads, row] in wire order."""
        for p in self.pieces:
            w = self.wire_ranks.index(p.src_rank)
            for kv in (0, 1):
                i = 0
                for d, n in runs:
                    dst[l0:l1, 2 * p.dst_rank + kv, d:d + n, :, p.dst_head:p.dst_head + p.n].copy_(
                        wire[:, w, kv, i:i + n, :, p.src_head:p.src_head + p.n])
                    i += n

    def landed_checksum(self, dst_row_words: Words, runs: list[tuple[int, int]], l0: int, l1: int) -> int:
        """The checksum of the receiver's slots of the runs that this sender fills (what `sent_checksum`
        announced): every row of the blocks' planes when it fills them all."""
        if not self.fills:
            return _slot_checksum(dst_row_words, self.dst, [(2 * p.dst_rank, p.dst_head, p.n) for p in self.pieces],
                                  runs, l0, l1)
        planes = dst_row_words.reshape(dst_row_words.shape[0], dst_row_words.shape[1], -1)
        r = self.dst.planes(l0, l1)
        return checksum_runs(planes, runs, r.start, r.stop)


def _pool(layout: KVLayout, rank: int) -> int:
    """Which pool of its engine holds engine rank `rank`'s heads: that rank's own slice, or the one whole pool."""
    return rank if layout.rank_slices > 1 else 0


def _row_views(flat: memoryview, layout: KVLayout, pieces: list[tuple[int, int, int]], runs: list[tuple[int, int]],
               layer: int) -> list[memoryview]:
    """Views of `layout`'s pool, one per (K/V, run, block, token, piece): pieces (rank, first head, heads) of one
    layer's planes, in wire order."""
    bs = layout.block_size
    row = layout.row * layout.element_size
    token = layout.num_kv_heads * row
    tokens = [((d + np.arange(n))[:, None] * bs + np.arange(bs)).ravel() * token for d, n in runs]
    sizes = [n * row for _, _, n in pieces]
    views = []
    for kv in (0, 1):
        starts = np.array([(layer * layout.kv_planes + 2 * r + kv) * layout.num_blocks * bs * token + h * row
                           for r, h, _ in pieces])
        for offsets in tokens:   # per run: (block, token, piece) in wire order
            at = (offsets[:, None] + starts).ravel().tolist()
            views += [flat[a:a + k] for a, k in zip(at, sizes * (len(at) // len(sizes)), strict=True)]
    return views


def _slot_checksum(row_words: Words, layout: KVLayout, slots: list[tuple[int, int, int]],
                   runs: list[tuple[int, int]], l0: int, l1: int) -> int:
    """The checksum (weighted per block, in run order) of the rows of `slots` (K plane, first head, heads) of
    layers [l0, l1) of the runs' blocks."""
    stride = layout.kv_planes
    count = sum(n for _, n in runs)
    on_host = isinstance(row_words, np.ndarray)
    sums: Any = np.zeros(count, dtype=np.int64) if on_host else torch.zeros(count, dtype=torch.int64,
                                                                        device=row_words.device)
    for plane, h, n_heads in slots:
        for kv in (0, 1):
            planes = slice(l0 * stride + plane + kv, l1 * stride, stride)
            i = 0
            for s, n in runs:
                rows = row_words[planes, s:s + n, :, h:h + n_heads]
                if isinstance(rows, np.ndarray):
                    sums[i:i + n] += rows.sum(axis=(2, 3, 4), dtype=np.int64).sum(axis=0, dtype=np.int64)
                else:   # torch sums integers into int64, wrapping modulo 2**64 as numpy does
                    sums[i:i + n] += rows.sum(dim=(2, 3, 4)).sum(dim=0)
                i += n
    return weighted(sums)


def writers(src: list[KVLayout], dst: list[KVLayout]) -> list[list[int]]:
    """For an engine whose pools are `src` (its rank slices in rank order, or its one whole pool) sending to one
    whose pools are `dst`: per receiving pool, the sending pools that fill some of its heads (a `Regroup` of the
    pair has pieces), in rank order; a latent pool (every rank's slice the same latent rows) from one rank: rank r
    into rank r between engines sliced alike."""
    out: list[list[int]] = []
    for i, d in enumerate(dst):
        if d.latent:
            out.append([i * len(src) // len(dst)])
            continue
        found = []
        for p, s in enumerate(src):
            try:
                Regroup(s, d)
            except LayoutMismatchError:
                continue
            found.append(p)
        out.append(found)
    return out


def writer_count(dst: KVLayout, sender_slices: int) -> int:
    """How many pools of a sending engine whose KV is cut into `sender_slices` rank slices (0 or 1: one pool, which
    writes every receiving pool alone) fill some of pool `dst`'s heads: the writers a reservation in it expects. The
    sending slices are those of the model `dst`'s engine holds (its `engine_layout`); ValueError when its heads do
    not split over them."""
    if sender_slices <= 1:
        return 1
    return len(writers(_slices(dst, sender_slices), [dst])[0])


@lru_cache(maxsize=64)
def _slices(like: KVLayout, n: int) -> list[KVLayout]:
    """The n rank slices of an engine of `like`'s model (heads, dims, dtype), sliced per rank."""
    model = like.engine_layout().total_kv_heads
    one = replace(like, tensor_parallel_size=1, num_kv_heads=len(rank_kv_heads(model, 0, n)), total_kv_heads=0,
                  rank_slices=1, rank_slice=0, model_kv_heads=0)
    one = replace(one, total_kv_heads=one.num_kv_heads)
    return [one.sliced(r, n, model) for r in range(n)]
