"""The KV pool layout both sides must agree on, and byte views of a pool.

Pool shape (engine/kv_cache.py): [num_layers, 2 * tp, num_blocks, block_size, num_kv_heads, row], layer-major:
plane p of a layer is one contiguous cache [num_blocks, block_size, heads, row] (rank p // 2's K for even p,
V for odd p), the layout device kernels take. Block b restricted to layers [l0, l1) is the planes
[2tp·l0, 2tp·l1) of it: one contiguous range per plane, and a run of consecutive blocks is one range per
plane too, so channels move per-plane runs with no staging. The pool of a tensor-parallel engine (CPU) holds
every rank's planes: num_kv_heads is per rank, total_kv_heads the model's, and rank r holds the heads
`device.rank_kv_heads(total_kv_heads, r, tp)` (an equal share, or one replicated head when the model has fewer
KV heads than ranks). Two ends of the same tensor_parallel_size move planes unchanged (rank i's heads land in
rank i's planes); ends of different sizes but the same model heads are compatible too, and the channel regroups
the heads on the way (regroup.py). What is checked is the model's geometry (total_kv_heads, head_dim, dtype,
layers, block size, scale bytes), not the split.
row = head_dim for a float pool; an int8 pool (the engine's `kv_cache_dtype="int8"`) stores each (token, KV
head) row as head_dim int8 values followed by its fp16 scale (`scale_bytes` = 2, row = head_dim + 2): the
scales travel inside the blocks, and the handshake refuses a peer whose dtype or scale bytes differ.
Version 2 is this layer-major layout (version 1 was block-major); a peer of another version is refused.

A latent pool (an MLA model: DeepSeek-V2/V3, `latent`) has ONE plane per layer whatever the tensor-parallel size,
`[num_layers, 1, num_blocks, block_size, 1, row]`: each (token, layer) row is the compressed KV then the roped key
(head_dim here = the model's kv_latent_dim, + 2 scale bytes in an int8 pool). Every rank shares it (it is not
split by heads), so its tensor_parallel_size is 1: a prefill engine of any TP ships its one copy, and only the
latent dim, dtype and block geometry must match. A latent and a per-head pool are refused at the handshake
(`latent: sender True vs receiver False`), as are two latent pools of different dims (`kv_latent_dim: ...`).

A pool sliced per rank (a device rank's, or a CPU rank's with `kv_pool_per_rank`) is one rank's part of its
engine's KV: its layout is that of a one-rank pool of the rank's heads, plus `rank_slices` (how many ranks' slices
the engine's KV is cut into; 1: the whole KV in this pool), `rank_slice` (which one) and `model_kv_heads` (the
model's KV heads; 0: num_kv_heads * rank_slices, no replicated heads). `engine_layout` is the layout of the whole
engine the slice belongs to, `own_ranks` the engine ranks whose planes this pool holds: regroup.py maps heads
between any two pools by them, so a slice moves into the slice of the same rank of an engine cut the same way
unchanged, and into a pool cut otherwise (another number of slices, or a whole pool) regrouped: each pair of pools
moves only the heads they have in common (a pair with none is refused: `rank_slice: ... no KV heads in common`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pdcluster.device import kv_planes, pool_shape, rank_kv_heads, row_scale_bytes
from pdcluster.kv_transfer.errors import LayoutMismatchError

LAYOUT_VERSION = 2
# `KVLayout.sliced`'s arguments, as the KV endpoints take them: (rank, ranks), or (rank, ranks, the model's KV heads),
# needed when the model has fewer KV heads than ranks (each slice then holds a copy of one)
RankSlice = tuple[int, int] | tuple[int, int, int]
# total_kv_heads is compared between the engines' layouts (engine_layout: a slice's model heads); how the heads are
# split (ranks, slices) is regroup.py's concern
_CHECKED_FIELDS = ("version", "dtype", "latent", "num_layers", "block_size", "total_kv_heads", "head_dim",
                   "scale_bytes")
_POSITIVE_FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_dim", "tensor_parallel_size", "num_blocks",
                    "version", "total_kv_heads")


@dataclass(frozen=True)
class KVLayout:
    dtype: str
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    version: int = LAYOUT_VERSION
    tensor_parallel_size: int = 1   # ranks whose heads the pool holds; num_kv_heads is per rank
    scale_bytes: int = 0   # per (token, KV head) row, after its head_dim values: 2 for an int8 pool
    latent: bool = False   # an MLA pool: one plane of latent rows per layer (head_dim = kv_latent_dim, 1 head)
    total_kv_heads: int = 0   # the model's KV heads over all ranks; 0: num_kv_heads * tensor_parallel_size
    rank_slices: int = 1   # a pool sliced per rank: the ranks whose slices make the engine's KV; 1: all of it here
    rank_slice: int = 0    # ... and which of them this pool is
    model_kv_heads: int = 0   # a slice: the model's KV heads (0: num_kv_heads * rank_slices, none replicated)

    def __post_init__(self) -> None:
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads * self.tensor_parallel_size)

    @classmethod
    def of(cls, pool: torch.Tensor, total_kv_heads: int | None = None) -> "KVLayout":
        """The layout of an engine pool; one plane per layer is a latent pool (a per-head one has 2 * tp).
        `total_kv_heads`: the model's KV heads, needed only when it has fewer than ranks (each rank then holds a
        copy of one); default num_kv_heads * tp. ValueError when it does not split over the pool's ranks."""
        if pool.dim() != 6 or not (pool.shape[1] % 2 == 0 or pool.shape[1] == pool.shape[4] == 1):
            raise ValueError(
                f"pool: expected shape [num_layers, 2 * tp, num_blocks, block_size, num_kv_heads, head_dim] or a "
                f"latent pool's [num_layers, 1, num_blocks, block_size, 1, kv_latent_dim], got {list(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise ValueError("pool: must be contiguous (layer-major)")
        nl, kv, nb, bs, nh, row = pool.shape
        scale = row_scale_bytes(pool.dtype)
        if row <= scale:
            raise ValueError(f"pool: an int8 pool's last dim is head_dim + {scale} scale bytes, got {row}")
        latent = kv == 1
        layout = cls(str(pool.dtype).removeprefix("torch."), nb, nl, bs, nh, row - scale,
                     tensor_parallel_size=1 if latent else kv // 2, scale_bytes=scale, latent=latent,
                     total_kv_heads=1 if latent else total_kv_heads or 0)
        layout.check_split()
        return layout

    def check_split(self) -> None:
        """ValueError unless num_kv_heads per rank and tensor_parallel_size multiply out to total_kv_heads the way
        the engine splits heads (device.rank_kv_heads); a latent pool is one shared head of one 'rank'."""
        tp, heads, total = self.tensor_parallel_size, self.num_kv_heads, self.total_kv_heads
        if self.latent:
            ok = tp == heads == total == 1
        else:
            ok = heads == len(rank_kv_heads(total, 0, tp)) and (total % tp == 0 if total >= tp else tp % total == 0)
        if not ok:
            raise ValueError(f"layout: {heads} KV heads per rank x tensor_parallel_size {tp} does not hold "
                             f"total_kv_heads {total}{' (a latent pool is 1 x 1 of 1)' if self.latent else ''}")

    def sliced(self, rank: int, ranks: int, model_kv_heads: int = 0) -> "KVLayout":
        """This layout as rank `rank`'s slice of an engine whose `ranks` ranks each hold their own (ranks 1: as is);
        `model_kv_heads`: the model's KV heads, needed only when it has fewer than ranks (each slice then holds a
        copy of one head; ignored for a latent pool, whose every slice is the whole latent); default
        num_kv_heads * ranks."""
        if not 0 <= rank < ranks:
            raise ValueError(f"rank_slice: expected 0 <= rank < {ranks}, got {rank}")
        named = ranks > 1 and not self.latent and model_kv_heads != self.num_kv_heads * ranks
        sliced = replace(self, rank_slices=ranks, rank_slice=rank, model_kv_heads=model_kv_heads if named else 0)
        sliced.engine_layout()   # ValueError when the heads do not split so
        return sliced

    def engine_layout(self) -> "KVLayout":
        """The layout of the whole engine this pool belongs to: itself, or for a slice a pool of every rank's planes
        (tensor_parallel_size = rank_slices, total_kv_heads = the model's); a latent pool's slice is a copy of the
        whole (every rank holds the same latent rows)."""
        if self.rank_slices == 1:
            return self
        if self.latent:
            return replace(self, rank_slices=1, rank_slice=0, model_kv_heads=0)
        if self.tensor_parallel_size != 1:
            raise ValueError("layout: a pool sliced per rank holds one rank's K and V planes")
        whole = replace(self, tensor_parallel_size=self.rank_slices, rank_slices=1, rank_slice=0, model_kv_heads=0,
                        total_kv_heads=self.model_kv_heads or self.num_kv_heads * self.rank_slices)
        whole.check_split()
        return whole

    def held_heads(self) -> list[int]:
        """The model's KV heads this pool holds (of its own ranks)."""
        whole = self.engine_layout()
        return sorted({h for r in self.own_ranks() for h in whole.rank_heads(r)})

    def own_ranks(self) -> range:
        """The engine ranks (of `engine_layout`) whose planes this pool holds, in plane order."""
        if self.rank_slices > 1 and not self.latent:
            return range(self.rank_slice, self.rank_slice + 1)
        return range(self.tensor_parallel_size)

    def rank_heads(self, rank: int) -> range:
        """The model's KV heads rank `rank`'s planes hold, in plane order."""
        return rank_kv_heads(self.total_kv_heads, rank, self.tensor_parallel_size)

    def same_planes(self, other: "KVLayout") -> bool:
        """Whether blocks move plane for plane between the two (same split of the heads over ranks, the same slice;
        two latent pools always: every slice of one is the whole latent)."""
        if self.latent and other.latent:
            return True

        def split(lay: KVLayout) -> tuple[int, ...]:
            return (lay.tensor_parallel_size, lay.num_kv_heads, lay.rank_slices, lay.rank_slice,
                    lay.engine_layout().total_kv_heads)
        return split(self) == split(other)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (its k and v planes, or its latent plane) of one block, scales included."""
        return self.kv_planes * self.block_size * self.num_kv_heads * self.row * self.element_size

    @property
    def kv_planes(self) -> int:
        """Planes per layer (the pool's second dim): k and v of each tensor-parallel rank, or 1 latent plane."""
        return kv_planes(self.tensor_parallel_size, self.latent)

    @property
    def row(self) -> int:
        """Elements of one (token, KV head) row: head_dim, plus the scale bytes of an int8 pool."""
        return self.head_dim + self.scale_bytes // self.element_size

    @property
    def plane_bytes(self) -> int:
        """Bytes of one block in one plane (one layer's K or V of one rank, or its latent rows)."""
        return self.block_size * self.num_kv_heads * self.row * self.element_size

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return pool_shape(self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads, self.row,
                          planes=self.kv_planes)

    def planes(self, l0: int, l1: int) -> range:
        """The planes (first dim of `plane_view`) holding layers [l0, l1)."""
        return range(l0 * self.kv_planes, l1 * self.kv_planes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        if not isinstance(d, dict):
            raise ValueError("layout: expected a map")
        total = d.get("total_kv_heads", 0)   # absent (older peers): num_kv_heads * tp, no replicated heads
        if "total_kv_heads" in d and (not isinstance(total, int) or isinstance(total, bool) or total <= 0):
            raise ValueError(f"layout.total_kv_heads: expected a positive int, got {total!r}")
        try:
            fields = {k: d[k] for k in ("version", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim",
                                        "num_blocks")}
            # absent from older peers: a float per-head pool of one rank
            layout = cls(**fields, tensor_parallel_size=d.get("tensor_parallel_size", 1),
                         scale_bytes=d.get("scale_bytes", 0), latent=d.get("latent", False),
                         total_kv_heads=total, rank_slices=d.get("rank_slices", 1), rank_slice=d.get("rank_slice", 0),
                         model_kv_heads=d.get("model_kv_heads", 0))
        except KeyError as exc:
            raise ValueError(f"layout: missing field {exc.args[0]!r}") from None
        except TypeError:   # a non-int num_kv_heads or tensor_parallel_size in the default's product
            raise ValueError("layout.num_kv_heads / tensor_parallel_size: expected positive ints") from None
        if not isinstance(layout.scale_bytes, int) or isinstance(layout.scale_bytes, bool) or layout.scale_bytes < 0:
            raise ValueError(f"layout.scale_bytes: expected an int >= 0, got {layout.scale_bytes!r}")
        if not isinstance(layout.latent, bool):
            raise ValueError(f"layout.latent: expected a bool, got {layout.latent!r}")
        if not (isinstance(layout.rank_slice, int) and not isinstance(layout.rank_slice, bool)
                and isinstance(layout.rank_slices, int) and 0 <= layout.rank_slice < layout.rank_slices):
            raise ValueError(f"layout.rank_slice / rank_slices: expected ints 0 <= rank_slice < rank_slices, got "
                             f"{layout.rank_slice!r} / {layout.rank_slices!r}")
        mh = layout.model_kv_heads
        if not isinstance(mh, int) or isinstance(mh, bool) or mh < 0:
            raise ValueError(f"layout.model_kv_heads: expected an int >= 0, got {mh!r}")
        for name in _POSITIVE_FIELDS:
            value = getattr(layout, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"layout.{name}: expected a positive int, got {value!r}")
        if not isinstance(getattr(torch, str(layout.dtype), None), torch.dtype):
            raise ValueError(f"layout.dtype: unknown dtype {layout.dtype!r}")
        layout.check_split()
        layout.engine_layout()
        return layout

    def check_compatible(self, other: "KVLayout", *, mine: str = "receiver", theirs: str = "sender") -> None:
        """Raise LayoutMismatchError naming every field that differs (num_blocks may differ, and so may the split
        of the heads over ranks: tensor_parallel_size and num_kv_heads per rank, rank_slices / rank_slice; the
        model's heads are compared between the engines, `engine_layout`), or naming both slices when the two pools
        hold no KV head in common; between two latent pools head_dim is named kv_latent_dim, what it holds."""
        a, b = self.engine_layout(), other.engine_layout()
        diffs = [
            f"{_label(name, self.latent and other.latent)}: {theirs} {getattr(b, name)!r} vs {mine} "
            f"{getattr(a, name)!r}"
            for name in _CHECKED_FIELDS
            if getattr(a, name) != getattr(b, name)
        ]
        if not diffs and not self.latent and not set(self.held_heads()) & set(other.held_heads()):
            diffs.append(f"rank_slice: {theirs} {other.rank_slice} of {other.rank_slices} vs {mine} {self.rank_slice} "
                         f"of {self.rank_slices}: no KV heads in common")
        if diffs:
            raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))


def _label(field: str, latent: bool) -> str:
    return "kv_latent_dim" if latent and field == "head_dim" else field


def byte_view(pool: torch.Tensor) -> torch.Tensor:
    """[planes = num_layers * kv_planes, num_blocks, plane_bytes] uint8 view sharing the pool's memory."""
    nl, kv, nb = pool.shape[:3]
    return pool.view(torch.uint8).reshape(nl * kv, nb, -1)


def runs(ids: list[int], paired: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Coalesce ids into (start, paired_start, length) runs consecutive in both lists."""
    paired = ids if paired is None else paired
    out: list[tuple[int, int, int]] = []
    for i, p in zip(ids, paired, strict=True):
        if out:
            s, ps, n = out[-1]
            if i == s + n and p == ps + n:
                out[-1] = (s, ps, n + 1)
                continue
        out.append((i, p, 1))
    return out


def blocks_of(pool: torch.Tensor, ids) -> torch.Tensor:
    """Blocks `ids` (an int, a list, a tensor or a slice) of a pool, block first: [n, num_layers, kv_planes,
    block_size, heads, row] (a copy for a list of ids; for checks and tests, not a transfer path)."""
    return pool[:, :, [ids] if isinstance(ids, int) else ids].movedim(2, 0)
