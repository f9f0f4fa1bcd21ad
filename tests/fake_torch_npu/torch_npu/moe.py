"""Fused MoE operators: `npu_moe_gating_top_k`, `npu_moe_init_routing_v2`, `npu_grouped_matmul`,
`npu_moe_finalize_routing`.

Each follows its page in Ascend/op-plugin docs/zh/custom_APIs/torch_npu/ (torch_npu 自定义API参考: the function
prototype, the parameter rules, the 等价计算逻辑 reference code) and the argument checks of the op-plugin adapters
(op_plugin/ops/opapi/*KernelNpuOpApi.cpp; argument names from op_plugin/config/op_plugin_functions.yaml). Math in
float32, results in the documented dtype. Output rows the documents call invalid or uninitialized are NaN here (int
outputs: a sentinel), so a caller that reads them fails its comparison instead of passing by luck.

These are the calls of vLLM-Ascend's AllGather MoE path (vllm_ascend/ops/fused_moe/token_dispatcher.py
TokenDispatcherWithAllGather, moe_mlp.py unquant_apply_mlp, router/fused_topk_router.py): gating top-k, routing
(v2, with active_expert_range for expert parallelism), two grouped matmuls around npu_swiglu, and the finalize
(combine). Not emulated (NotImplementedError): quantized modes, drop/pad (capacity) modes, the hash routing of
npu_moe_gating_top_k (input_ids / tid2eid), grouped-matmul bias, k-axis grouping and list[int] group lists.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from torch_npu import _state

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INT32_MAX = 2**31 - 1
UNINITIALIZED_INDEX = INT32_MAX   # what an index output's "未初始化" entries hold here


def _fail(op: str, msg: str) -> None:
    raise RuntimeError(f"{op}: {msg}")


def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index (the reference's stable argsort)."""
    return torch.argsort(-values, dim=-1, stable=True)[..., :k]


# ---- npu_moe_gating_top_k ------------------------------------------------------------------------------

def npu_moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None,
                         input_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                         k_group: int = 1, group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                         norm_type: int = 0, out_flag: bool = False, routed_scaling_factor: float = 1.0,
                         eps: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follows torch_npu-npu_moe_gating_top_k.md: norm = softmax (norm_type 0) or sigmoid (1) of x; bias (if
    given) is added for the selection only; with group_count > 1 the experts split into group_count groups, each
    scored by its max (group_select_mode 0) or the sum of its top 2 (1), and only the k_group best groups stay
    selectable; the k best experts are chosen; y = norm at those experts, divided by (sum + eps) for sigmoid only
    (the reference code's `if norm_type == 1`), times routed_scaling_factor. Returns (y in x's dtype, expert_idx
    int32, norm_out float32 [rows, E], written only with out_flag: NaN otherwise).

    Raised, as the document and MoeGatingTopKKernelNpuOpApi.cpp state them: x not 2-D or not float16/bfloat16/
    float32, E > 2048, bias not 1-D [E] of x's dtype, input_ids / tid2eid not both given, 1 <= k <= E /
    group_count * k_group violated, k_group outside [1, group_count], E not divisible by group_count or E /
    group_count <= 2, align32(E / group_count) * group_count > 2048, group_select_mode not 0/1, renorm != 0
    ("当前仅支持0"), norm_type not 0/1.
    """
    op = "npu_moe_gating_top_k"
    _state.record(op)
    if x.dim() != 2:
        _fail(op, "The x should be 2D")
    if x.dtype not in _FLOATS:
        _fail(op, f"float16、float32 or bfloat16 tensor expected but got a tensor with dtype: {x.dtype}")
    rows, experts = x.shape
    if experts > 2048:
        _fail(op, f"the last dim of x (the expert count) must not exceed 2048; got {experts}")
    if bias is not None:
        if bias.dtype != x.dtype:
            _fail(op, "The dtype of x and bias should be same")
        if bias.dim() != 1 or bias.shape[0] != experts:
            _fail(op, f"The bias should be 1D with the size of x's second dim ({experts}); got {tuple(bias.shape)}")
    if (input_ids is None) != (tid2eid is None):
        _fail(op, "input_ids and tid2eid must be both provided or both omitted")
    if input_ids is not None:
        raise NotImplementedError(f"{op}: the hash mode (input_ids / tid2eid) is not emulated")
    if group_count <= 0 or experts % group_count or experts // group_count <= 2:
        _fail(op, f"group_count = {group_count}: must be > 0, divide x's last dim ({experts}), and leave more than 2 "
                  "experts per group")
    per_group = experts // group_count
    if -(-per_group // 32) * 32 * group_count > 2048:
        _fail(op, f"align32(E / group_count) * group_count must not exceed 2048; got {per_group} per group x "
                  f"{group_count}")
    if not 1 <= k_group <= group_count:
        _fail(op, f"k_group must lie in [1, group_count = {group_count}]; got {k_group}")
    if not 1 <= k <= per_group * k_group:
        _fail(op, f"k must lie in [1, x_shape[-1] / group_count * k_group = {per_group * k_group}]; got {k}")
    if group_select_mode not in (0, 1):
        _fail(op, f"group_select_mode must be 0 (group max) or 1 (sum of the group's top 2); got {group_select_mode}")
    if renorm != 0:
        _fail(op, f"renorm: only 0 (norm, then top-k) is supported (当前仅支持0); got {renorm}")
    if norm_type not in (0, 1):
        _fail(op, f"norm_type must be 0 (softmax) or 1 (sigmoid); got {norm_type}")

    x32 = x.float()
    norm = torch.softmax(x32, dim=-1) if norm_type == 0 else torch.sigmoid(x32)
    select = norm if bias is None else norm + bias.float()
    if group_count > 1:
        grouped = select.view(rows, group_count, per_group)
        if group_select_mode == 0:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros(rows, group_count, dtype=torch.bool, device=x.device)
        keep.scatter_(1, _stable_topk(group_score, k_group), True)
        select = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(rows, experts)
    idx = _stable_topk(select, k)
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = norm if out_flag else torch.full_like(norm, float("nan"))
    return y.to(x.dtype), idx.to(torch.int32), norm_out


# ---- npu_moe_init_routing_v2 ---------------------------------------------------------------------------

def npu_moe_init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, *, scale: torch.Tensor | None = None,
                            offset: torch.Tensor | None = None, active_num: int = -1, expert_capacity: int = -1,
                            expert_num: int = -1, drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                            expert_tokens_num_flag: bool = False, quant_mode: int = -1,
                            active_expert_range: list[int] | tuple[int, ...] = (), row_idx_type: int = 0,
                            x_dtype: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follows torch_npu-npu_moe_init_routing_v2.md (its MoeInitRoutingV2CPU reference, dropless branch) and
    MoeInitRoutingV2KernelNpuOpApi.cpp for the output shapes. The NUM_ROWS * K (row, k) pairs, flattened row-major,
    are sorted stably by expert id, ids below expert_start going last; the available_idx_num pairs whose expert lies
    in active_expert_range [expert_start, expert_end) (default [0, expert_num)) come first. Returns:
    - expanded_x [n, H], n = NUM_ROWS * K if active_num <= 0 else min(active_num, NUM_ROWS * K): row i is x[pair // K]
      of the i-th sorted pair, for i < available_idx_num; later rows are not written (NaN here);
    - expanded_row_idx int32 [NUM_ROWS * K]: row_idx_type 0 (gather): entry pair = its row in expanded_x, -1 for
      pairs outside the range; 1 (scatter): entry i = the pair of expanded_x row i, uninitialized past
      available_idx_num (INT32_MAX here);
    - expert_tokens int64 [expert_end - expert_start]: per-expert counts (expert_tokens_num_type 1) or their cumsum
      (0); not written unless expert_tokens_num_flag (-1 here);
    - expanded_scale float32 [n]: scale[pair // K] of the sorted pairs when scale (1-D [NUM_ROWS]) is given, else
      meaningless (NaN here).

    Raised: x not 2-D, expert_idx not 2-D int32 with x's rows, x not float16/bfloat16/float32, active_expert_range
    not 2 values with 0 <= start < end <= expert_num, expert_num outside [0, 10240], expert ids outside [0,
    expert_num) ("专家id不能超过专家数"), active_num < -1, row_idx_type not 0/1, expert_tokens_num_type not 0/1/2.
    Not emulated: quant_mode != -1, drop_pad_mode 1, expert_tokens_num_type 2 (key_value), offset, x_dtype.
    """
    op = "npu_moe_init_routing_v2"
    _state.record(op)
    if quant_mode != -1 or offset is not None or x_dtype is not None:
        raise NotImplementedError(f"{op}: quantized routing (quant_mode {quant_mode}, offset, x_dtype) is not emulated")
    if drop_pad_mode != 0:
        raise NotImplementedError(f"{op}: drop_pad_mode {drop_pad_mode} (capacity) is not emulated")
    if x.dim() != 2:
        _fail(op, f"The x should be 2-Dimension, current is {x.dim()}-Dimension.")
    if expert_idx.dim() != 2:
        _fail(op, f"The expert_idx should be 2-Dimension, current is {expert_idx.dim()}-Dimension.")
    if x.dtype not in _FLOATS:
        _fail(op, f"x: dtype must be float16, bfloat16 or float32 (unquantized); got {x.dtype}")
    if expert_idx.dtype != torch.int32:
        _fail(op, f"expert_idx: dtype must be int32; got {expert_idx.dtype}")
    rows, k = expert_idx.shape
    if rows != x.shape[0]:
        _fail(op, f"expert_idx must have x's NUM_ROWS ({x.shape[0]}) rows; got {rows}")
    if not 0 <= expert_num <= 10240:
        _fail(op, f"expert_num must lie in [0, 10240]; got {expert_num}")
    expert_range = list(active_expert_range) or [0, expert_num]
    if len(expert_range) != 2:
        _fail(op, f"The length of list active_expert_range should be 2, current is {len(expert_range)}.")
    start, end = expert_range
    if not 0 <= start < end <= expert_num:
        _fail(op, f"active_expert_range [{start}, {end}) must satisfy 0 <= start < end <= expert_num = {expert_num}")
    if active_num < -1:
        _fail(op, f"active_num must be >= -1 in the dropless mode; got {active_num}")
    if row_idx_type not in (0, 1):
        _fail(op, f"row_idx_type must be 0 (gather) or 1 (scatter); got {row_idx_type}")
    if expert_tokens_num_type not in (0, 1, 2):
        _fail(op, f"expert_tokens_num_type must be 0 (cumsum), 1 (count) or 2 (key_value); got "
                  f"{expert_tokens_num_type}")
    if expert_tokens_num_type == 2:
        raise NotImplementedError(f"{op}: expert_tokens_num_type 2 (key_value) is not emulated")
    if scale is not None and (scale.dim() != 1 or scale.shape[0] != rows or scale.dtype != torch.float32):
        _fail(op, f"scale: unquantized routing takes a float32 (NUM_ROWS,) = ({rows},) scale; got "
                  f"{tuple(scale.shape)} {scale.dtype}")
    flat = expert_idx.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= expert_num):
        _fail(op, f"expert ids must lie in [0, expert_num = {expert_num}); got [{int(flat.min())}, {int(flat.max())}]")

    pairs = rows * k
    in_range = (flat >= start) & (flat < end)
    available = int(in_range.sum())
    order = torch.argsort(torch.where(flat < start, INT32_MAX, flat), stable=True)
    n_out = pairs if active_num <= 0 else min(active_num, pairs)
    valid = min(available, n_out)
    source_rows = order[:valid] // k

    expanded_x = torch.full((n_out, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    expanded_x[:valid] = x[source_rows]
    if row_idx_type == 0:
        expanded_row_idx = torch.full((pairs,), -1, dtype=torch.int32, device=x.device)
        expanded_row_idx[order[:available]] = torch.arange(available, dtype=torch.int32, device=x.device)
    else:
        expanded_row_idx = torch.full((pairs,), UNINITIALIZED_INDEX, dtype=torch.int32, device=x.device)
        expanded_row_idx[:available] = order[:available].to(torch.int32)
    if expert_tokens_num_flag:
        counts = torch.bincount(flat[in_range] - start, minlength=end - start).to(torch.int64)
        expert_tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    else:
        expert_tokens = torch.full((end - start,), -1, dtype=torch.int64, device=x.device)
    expanded_scale = torch.full((n_out,), float("nan"), dtype=torch.float32, device=x.device)
    if scale is not None:
        expanded_scale[:valid] = scale[source_rows]
    return expanded_x, expanded_row_idx, expert_tokens, expanded_scale


# ---- npu_grouped_matmul --------------------------------------------------------------------------------

INNER_LIMIT = 65536


def _check_weight_layout(op: str, w: torch.Tensor) -> None:
    """A weight may be contiguous or its last two dims transposed ("支持weight转置"); nothing else."""
    if w.is_contiguous() or w.transpose(-1, -2).is_contiguous():
        return
    _fail(op, f"weight: only contiguous or last-two-dims-transposed tensors are supported; got strides {w.stride()}")


def _group_sizes(op: str, group_list: torch.Tensor, group_list_type: int, groups: int, rows: int,
                 max_groups: int) -> list[int]:
    if not isinstance(group_list, torch.Tensor):
        raise NotImplementedError(f"{op}: a List[int] group_list is not emulated (pass a Tensor)")
    if group_list.dtype != torch.int64 or group_list.dim() != 1:
        _fail(op, f"group_list: a 1-D int64 tensor is required; got {group_list.dtype} {tuple(group_list.shape)}")
    if group_list.shape[0] != groups:
        _fail(op, f"group_list: its length must equal the number of weight groups ({groups}); got "
                  f"{group_list.shape[0]}")
    if groups > max_groups:
        _fail(op, f"group_list: at most {max_groups} groups are supported here; got {groups}")
    values = [int(v) for v in group_list.tolist()]
    if group_list_type == 0:
        if any(v < 0 for v in values) or any(b < a for a, b in pairwise(values)):
            _fail(op, f"group_list (group_list_type 0, cumsum) must be non-negative and non-decreasing; got {values}")
        sizes = [b - a for a, b in zip([0] + values[:-1], values, strict=True)]
    elif group_list_type == 1:
        if any(v < 0 for v in values):
            _fail(op, f"group_list (group_list_type 1, counts) must be non-negative; got {values}")
        if len(values) == 1:
            _fail(op, "group_list (group_list_type 1, counts): its length must not be 1 (长度不能为1)")
        sizes = values
    elif group_list_type == 2:
        _fail(op, "group_list_type 2 is supported only for int8 x and weight with group_type 0")
    else:
        _fail(op, f"group_list_type must be 0, 1 or 2; got {group_list_type}")
    # The document wants the groups to cover x exactly; vLLM-Ascend passes expert-parallel routing whose groups
    # cover fewer rows and notes that npu_grouped_matmul "output random values at [num_valid_tokens:]" (its
    # token_dispatcher.py before #2689). Rows past the groups are therefore left unwritten (NaN here).
    if sum(sizes) > rows:
        _fail(op, f"group_list: the groups cover {sum(sizes)} rows but x has {rows}")
    return sizes


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor], *, bias=None, scale=None, offset=None,
                       antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                       group_list: torch.Tensor | None = None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item: int = 0, group_type: int | None = None,
                       group_list_type: int = 0, act_type: int = 0, output_dtype: torch.dtype | None = None,
                       tuning_config=None) -> list[torch.Tensor]:
    """Follows torch_npu-npu_grouped_matmul.md, unquantized (formula 1, y_i = x_i @ weight_i), group_list a
    Tensor. Scenarios (x, weight, y; "单" one tensor, "多" several):
    - group_type -1, 多多多: split_item 0/1, group_list None, y_i = x_i @ weight_i (weight_i 2-D [K, N]);
    - group_type 0 (m-axis), split_item 2/3, one 2-D x split along its rows by group_list, group g times weight g,
      results stacked into one 2-D y: 单单单 (one 3-D weight [g, K, N], at most 1024 groups) or 单多单 (g 2-D
      weights with one N, at most 128 groups). group_list_type 0: cumulative ends; 1: per-group counts.
    Raised: lists longer than 128; dtypes other than float16/bfloat16/float32 or x and weight of different dtypes;
    float32 with several tensors; output_dtype other than None or x's dtype; act_type != 0 (activation only in the
    per-token quantized scenario); a last dim of 65536 or more (InnerLimit); a non-contiguous x ("x不支持转置");
    weights neither contiguous nor transposed; the group_list rules above (non-negative, non-decreasing cumsum,
    counts of length 1, length = number of groups). Not emulated: quantization arguments, bias, group_type 2.
    """
    op = "npu_grouped_matmul"
    _state.record(op)
    quant = {"scale": scale, "offset": offset, "antiquant_scale": antiquant_scale,
             "antiquant_offset": antiquant_offset, "per_token_scale": per_token_scale,
             "activation_input": activation_input, "activation_quant_scale": activation_quant_scale,
             "activation_quant_offset": activation_quant_offset, "tuning_config": tuning_config, "bias": bias}
    given = [name for name, v in quant.items() if v is not None]
    if given:
        raise NotImplementedError(f"{op}: {', '.join(given)} not emulated (unquantized, bias-free calls only)")
    if group_type == 2:
        raise NotImplementedError(f"{op}: group_type 2 (k-axis grouping) is not emulated")
    if act_type != 0:
        _fail(op, f"act_type {act_type}: only the per-token quantized scenario supports an activation")
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        _fail(op, "x and weight must be lists of tensors")
    if not 1 <= len(x) <= 128 or not 1 <= len(weight) <= 128:
        _fail(op, f"x and weight lists hold 1 to 128 tensors; got {len(x)} and {len(weight)}")
    dtype = x[0].dtype
    if dtype not in _FLOATS or any(t.dtype != dtype for t in (*x, *weight)):
        _fail(op, f"unquantized x and weight must share one of float16/bfloat16/float32; got "
                  f"{sorted({str(t.dtype) for t in (*x, *weight)})}")
    if output_dtype is not None and output_dtype != dtype:
        _fail(op, f"output_dtype must be None or x's dtype {dtype} when unquantized; got {output_dtype}")
    for t in x:
        if not t.is_contiguous():
            _fail(op, "x: transposed or non-contiguous tensors are not supported (x不支持转置)")
        if t.shape[-1] >= INNER_LIMIT:
            _fail(op, f"x: the last dim must be below InnerLimit {INNER_LIMIT}; got {t.shape[-1]}")
    for w in weight:
        _check_weight_layout(op, w)
        if w.stride(-1) == 1 and w.shape[-1] >= INNER_LIMIT or w.stride(-1) != 1 and w.shape[-2] >= INNER_LIMIT:
            _fail(op, f"weight: the last (stored) dim must be below InnerLimit {INNER_LIMIT}")

    if group_type is None or group_type == -1:
        if split_item not in (0, 1):
            _fail(op, f"group_type -1 (多多多) supports split_item 0 or 1 only; got {split_item}")
        if group_list is not None:
            _fail(op, "group_type -1: group_list must be None")
        if len(x) != len(weight):
            _fail(op, f"group_type -1: x and weight lists must have one length; got {len(x)} and {len(weight)}")
        if dtype == torch.float32 and len(x) > 1:
            _fail(op, "float32 is supported only when x, weight and y are single tensors")
        out = []
        for xi, wi in zip(x, weight, strict=True):
            if wi.dim() != 2 or not 2 <= xi.dim() <= 6 or xi.shape[-1] != wi.shape[0]:
                _fail(op, f"group_type -1: x_i (2-6 dims) @ weight_i (2-D) shapes do not match: {tuple(xi.shape)} "
                          f"@ {tuple(wi.shape)}")
            out.append((xi.float() @ wi.float()).to(dtype))
        return out
    if group_type != 0:
        _fail(op, f"group_type must be -1, 0 or 2; got {group_type}")

    if split_item not in (2, 3):
        _fail(op, f"group_type 0 with one y supports split_item 2 or 3 only; got {split_item}")
    if len(x) != 1:
        raise NotImplementedError(f"{op}: group_type 0 with several x tensors (多多单) is not emulated")
    xs = x[0]
    if xs.dim() != 2:
        _fail(op, f"group_type 0: x must be 2-D; got {tuple(xs.shape)}")
    if group_list is None:
        _fail(op, "group_type 0 with one x needs group_list")
    if len(weight) == 1:   # 单单单
        w = weight[0]
        if w.dim() != 3:
            _fail(op, f"单单单 (one x, one weight, one y): weight must be 3-D [g, K, N]; got {tuple(w.shape)}")
        groups, max_groups = w.shape[0], 1024
        weights = [w[g] for g in range(groups)]
    else:   # 单多单
        if dtype == torch.float32:
            _fail(op, "float32 is supported only when x, weight and y are single tensors")
        if any(w.dim() != 2 for w in weight) or len({w.shape[1] for w in weight}) != 1:
            _fail(op, "单多单: every weight must be 2-D [K, N] with one N")
        groups, max_groups, weights = len(weight), 128, list(weight)
    if any(w.shape[0] != xs.shape[1] for w in weights):
        _fail(op, f"x's K ({xs.shape[1]}) must equal each weight's K ({weights[0].shape[0]})")
    sizes = _group_sizes(op, group_list, group_list_type, groups, xs.shape[0], max_groups)
    y = torch.full((xs.shape[0], weights[0].shape[1]), float("nan"), dtype=dtype, device=xs.device)
    row = 0
    for size, w in zip(sizes, weights, strict=True):
        if size:
            y[row:row + size] = (xs[row:row + size].float() @ w.float()).to(dtype)
        row += size
    return [y]


# ---- npu_moe_finalize_routing --------------------------------------------------------------------------

def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1: torch.Tensor | None,
                             skip2: torch.Tensor | None, bias: torch.Tensor | None, scales: torch.Tensor | None,
                             expanded_src_to_dst_row: torch.Tensor, export_for_source_row: torch.Tensor | None,
                             drop_pad_mode: int = 0, k: int = 1) -> torch.Tensor:
    """Follows torch_npu-npu_moe_finalize_routing.md (its formula and moe_finalize_routing_np reference; argument
    names as op_plugin_functions.yaml spells them, `export_for_source_row` included):
    out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (expanded_permuted_rows[src[pos(i, k)]] + bias[expert[i, k]]),
    pos(i, k) = k * NUM_ROWS + i (drop_pad_mode 0, column order) or i * K + k (2, row order: the layout
    npu_moe_init_routing_v2's gather index has). An index of -1 contributes nothing but scales * bias (the reference:
    `if value == -1: dst_row = 0`). K = scales.shape[1], or `k` without scales. Output [NUM_ROWS, H] in the rows'
    dtype.

    Raised: expanded_permuted_rows not 2-D or not float16/bfloat16/float32; skip1/skip2/bias/scales of another
    dtype; skip2 without skip1; skip shapes other than [NUM_ROWS, H]; bias not [E, H]; scales not [NUM_ROWS, K];
    expanded_src_to_dst_row not 1-D int32 of NUM_ROWS * K, or values outside [-1, rows); export_for_source_row
    not int32 [NUM_ROWS, K] (required with bias) or outside [0, E); drop_pad_mode outside 0-3. Not emulated: the
    drop/pad modes 1 and 3 ((E, C, H) rows).
    """
    op = "npu_moe_finalize_routing"
    _state.record(op)
    if drop_pad_mode not in (0, 1, 2, 3):
        _fail(op, f"drop_pad_mode must lie in [0, 3]; got {drop_pad_mode}")
    if drop_pad_mode in (1, 3):
        raise NotImplementedError(f"{op}: drop_pad_mode {drop_pad_mode} (drop/pad, (E, C, H) rows) is not emulated")
    rows_t = expanded_permuted_rows
    if rows_t.dim() != 2:
        _fail(op, f"expanded_permuted_rows: a 2-D (NUM_ROWS * K, H) tensor is required in drop_pad_mode "
                  f"{drop_pad_mode}; got {tuple(rows_t.shape)}")
    dtype = rows_t.dtype
    if dtype not in _FLOATS:
        _fail(op, f"expanded_permuted_rows: dtype must be float16, bfloat16 or float32; got {dtype}")
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias), ("scales", scales)):
        if t is not None and t.dtype != dtype:
            _fail(op, f"{name}: dtype must be expanded_permuted_rows' ({dtype}); got {t.dtype}")
    if skip1 is None and skip2 is not None:
        _fail(op, "skip2 must be None when skip1 is None")
    src = expanded_src_to_dst_row
    if src.dim() != 1 or src.dtype != torch.int32:
        _fail(op, f"expanded_src_to_dst_row: a 1-D int32 tensor is required; got {src.dtype} {tuple(src.shape)}")
    top_k = scales.shape[1] if scales is not None and scales.dim() == 2 else k
    if top_k < 1 or src.shape[0] % top_k:
        _fail(op, f"expanded_src_to_dst_row ({src.shape[0]}) must hold NUM_ROWS * K entries with K = {top_k}")
    num_rows, hidden = src.shape[0] // top_k, rows_t.shape[1]
    if scales is not None and tuple(scales.shape) != (num_rows, top_k):
        _fail(op, f"scales must be (NUM_ROWS, K) = ({num_rows}, {top_k}); got {tuple(scales.shape)}")
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None and tuple(t.shape) != (num_rows, hidden):
            _fail(op, f"{name} must have the output's shape ({num_rows}, {hidden}); got {tuple(t.shape)}")
    if bias is not None:
        if bias.dim() != 2 or bias.shape[1] != hidden:
            _fail(op, f"bias must be (E, H) with H = {hidden}; got {tuple(bias.shape)}")
        if export_for_source_row is None:
            _fail(op, "bias needs export_for_source_row (the expert of each (row, k))")
    experts = export_for_source_row
    if experts is not None:
        if experts.dtype != torch.int32 or tuple(experts.shape) != (num_rows, top_k):
            _fail(op, f"export_for_source_row must be int32 (NUM_ROWS, K) = ({num_rows}, {top_k}); got "
                      f"{experts.dtype} {tuple(experts.shape)}")
        if bias is not None and experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < bias.shape[0]:
            _fail(op, f"export_for_source_row values must lie in [0, E - 1] = [0, {bias.shape[0] - 1}]")
    idx = src.to(torch.int64)
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= rows_t.shape[0]):
        _fail(op, f"expanded_src_to_dst_row values must lie in [0, {rows_t.shape[0] - 1}] (or -1); got "
                  f"[{int(idx.min())}, {int(idx.max())}]")

    pos = idx.view(top_k, num_rows).t() if drop_pad_mode == 0 else idx.view(num_rows, top_k)   # [NUM_ROWS, K]
    gathered = rows_t.float()[pos.clamp_min(0)]                                                   # [NUM_ROWS, K, H]
    gathered = gathered.masked_fill((pos < 0).unsqueeze(-1), 0.0)
    if bias is not None:
        gathered = gathered + bias.float()[experts.long()]
    weights = scales.float().unsqueeze(-1) if scales is not None else 1.0
    out = (weights * gathered).sum(dim=1)
    for t in (skip1, skip2):
        if t is not None:
            out = out + t.float()
    return out.to(dtype)


__all__ = ["npu_grouped_matmul", "npu_moe_finalize_routing", "npu_moe_gating_top_k", "npu_moe_init_routing_v2"]
