"""Proposer of the heads that read the target's hidden states: EAGLE, EAGLE-3 and DeepSeek MTP
(engine/speculative/heads.py).

The head lags the target by one token: its input at position p is the token at p + 1 with the target's feature
of p, so it can run a position only once the target has computed it and the next token is known. Each step the
runner hands every sequence's features of the positions it computed (`take_features`: the kept ones of a
verified step); the next `propose` runs the head over them (a chunk, like a prefill: this writes the head's KV
at those positions), and for a sequence that may draft, the head's output at the last one gives the first draft,
which with the head's own output feature gives the next, one pass per draft over every drafting sequence. The
KV the head wrote at draft positions is rewritten from the target's features once they are verified.

Under P/D the prefill node's engine keeps the features of a prompt it holds (the last SHIPPED_FEATURE_BYTES'
worth) instead of running its head, and ships them with `PrefillDone`; the decode node's head runs over them
once the prompt's KV has landed (`accept_prompt_features`), like a local prompt's first propose.

The head's KV sits in a pool of its own with the target pool's block count, indexed by the target sequence's
block table (as the draft model's). What the head holds of a sequence is its `HeadState`; a position the target
did not compute here (a prefix-cache hit, a prompt prefilled on another node) leaves the head's KV there stale:
drafts only steer, verification keeps the output the target's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from pdcluster.engine.attention import get_backend_class
from pdcluster.engine.attention.mla import mla_backend
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import KVCachePool, make_pool
from pdcluster.engine.loader import read_tensors
from pdcluster.engine.model_runner import ModelRunner, prepare_step
from pdcluster.engine.models.llama import load_tensor
from pdcluster.engine.scheduler import ScheduledBatch
from pdcluster.engine.sequence import Sequence
from pdcluster.engine.speculative.config import SpeculativeConfig
from pdcluster.engine.speculative.heads import Eagle3Head, EagleHead, MTPHead
from pdcluster.engine.speculative.proposer import StepView

SHIPPED_FEATURE_BYTES = 8 << 20   # a prompt's features a prefill node keeps and sends (its last positions)


@dataclass
class HeadState:
    """The head's KV of a sequence is written below `start`; `features` are the target's of positions `start..`
    that the head has not run yet."""
    start: int = 0
    features: torch.Tensor | None = None


class HeadProposer:
    writes_kv = True
    follows_target = True
    drafts_cheaply = False

    def __init__(self, spec: SpeculativeConfig, target_dir: str, target: ModelConfig, runner: ModelRunner,
                 dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                 attention_backend: str | None = None) -> None:
        self.kv_dtype = kv_dtype
        self.device = device
        backend_cls = get_backend_class(attention_backend, device.type)
        head: EagleHead | Eagle3Head | MTPHead
        shared: dict[str, nn.Module] = {}   # the target's modules the head uses as its own (one rank only)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                if spec.method == "mtp":
                    self.config, head, weights = _mtp_head(target_dir, target, backend_cls.name)
                else:
                    self.config, head, weights = _eagle_head(spec, target, backend_cls)
                    names = {name for name, _ in weights}
                    take = [("embed_tokens", "model.embed_tokens")] if "embed_tokens.weight" not in names else []
                    if "lm_head.weight" not in names:
                        take.append(("lm_head", "lm_head"))
                    shared = _share(head, runner, target_dir, target, take, weights)
        finally:
            torch.set_default_dtype(previous)
        with torch.no_grad():
            if isinstance(head, MTPHead):
                head.load_weights(weights)
            else:
                _load_eagle_weights(head, weights, {f"{name}.weight" for name in shared})
            own = {id(m) for module in shared.values() for m in module.modules()}
            for module in head.modules():
                prepack = getattr(module, "prepack", None)
                if callable(prepack) and id(module) not in own:
                    prepack()
        self.head = head.eval().requires_grad_(False)
        self.head_dtype = dtype
        self.eagle3 = isinstance(head, Eagle3Head)
        self.feature_size = target.hidden_size * (3 if self.eagle3 else 1)
        self.pool: KVCachePool | None = None
        self.block_size = 0
        runner.feature_sink = self.take_features
        if self.eagle3:
            runner.model.model.capture_layers = _aux_layers(spec.model, target)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return KVCachePool.bytes_per_block(self.config, block_size, self.kv_dtype)

    def bind(self, num_blocks: int, block_size: int) -> None:
        self.pool, _ = make_pool(self.config, block_size, self.kv_dtype, self.device, 1, lambda _: num_blocks)
        self.block_size = block_size
        for i, attn in enumerate(self.head.attention_layers()):
            attn.k_cache, attn.v_cache = self.pool.layer_views(i, 0)

    def take_features(self, seq: Sequence, position: int, rows: torch.Tensor) -> None:
        """The target's features of `seq` at positions `position..` (the runner's sink)."""
        state = seq.proposer_state
        if not isinstance(state, HeadState):
            state = seq.proposer_state = HeadState(position)
        if state.features is not None and state.start + len(state.features) == position:
            state.features = torch.cat((state.features, rows))
        else:   # the first, or after a gap: the head's KV below `position` is what it is
            state.start, state.features = position, rows
        if seq.hold_blocks:   # a prefill node's prompt: kept for its decode node, the last ones only
            keep = max(1, SHIPPED_FEATURE_BYTES // (rows.shape[-1] * rows.element_size()))
            if len(state.features) > keep:
                state.start += len(state.features) - keep
                state.features = state.features[-keep:]

    def export_prompt_features(self, seq: Sequence) -> tuple[int, str, bytes] | None:
        """(first position, dtype name, raw rows) of the features a prefill node ships for `seq`'s prompt."""
        state = seq.proposer_state
        if not isinstance(state, HeadState) or state.features is None:
            return None
        rows = state.features.detach().to("cpu").contiguous()
        return state.start, str(rows.dtype).removeprefix("torch."), rows.view(torch.uint8).numpy().tobytes()

    def accept_prompt_features(self, seq: Sequence, start: int, dtype: str, raw: bytes) -> bool:
        """A prefill node's features of `seq`'s prompt (positions `start..` up to its end), for the head's
        first run; False, taking nothing, when they do not fit (another model, a wrong length)."""
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point or not raw:
            return False
        row_bytes = self.feature_size * torch.empty(0, dtype=torch_dtype).element_size()
        rows = len(raw) // row_bytes
        if len(raw) % row_bytes or start + rows != seq.num_prompt_tokens:
            return False
        features = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype).view(rows, -1)
        seq.proposer_state = HeadState(start, features.to(self.device, self.head_dtype))
        return True

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        views, owners = [], []
        for i, seq in enumerate(seqs):
            state = seq.proposer_state
            if not isinstance(state, HeadState) or state.features is None:
                continue
            end = state.start + len(state.features)
            views.append(StepView(seq.token_ids[1:end + 1], state.start, seq.block_table, state.features))
            owners.append(i)
            state.start, state.features = end, None
        if not views:
            return drafts
        features, tokens = self._run(views, from_target=True)
        # drafting: the features reached the position before the last token (no gap to the next input)
        active = [n for n, i in enumerate(owners)
                  if limits[owners[n]] > 0 and views[n].num_tokens == seqs[i].num_tokens - 1]
        step = 0
        while active:
            for n in active:
                drafts[owners[n]].append(tokens[n])
            step += 1
            active = [n for n in active if step < limits[owners[n]]
                      and seqs[owners[n]].num_tokens + step < self.config.max_model_len]
            if not active:
                break
            step_views = []
            for n in active:
                seq = seqs[owners[n]]
                step_views.append(StepView(seq.token_ids[1:] + drafts[owners[n]], seq.num_tokens - 2 + step,
                                           seq.block_table, features[n:n + 1]))
            out, out_tokens = self._run(step_views, from_target=False)
            for m, n in enumerate(active):
                features[n] = out[m]
                tokens[n] = out_tokens[m]
        return drafts

    def _run(self, views: list[StepView], from_target: bool) -> tuple[torch.Tensor, list[int]]:
        """One head pass over each view's uncomputed tokens: per view (in order) its last row's output feature
        and the greedy draft after it."""
        counts = [v.num_tokens - v.num_computed_tokens for v in views]
        inputs, ordered = prepare_step(ScheduledBatch(views, counts), self.block_size)  # type: ignore[arg-type]
        features = torch.cat([view.features for view, _, _ in inputs.seq_rows]).to(self.device)
        inputs = inputs.to(self.device)
        meta = self.head.attention_layers()[0].backend.prepare(inputs.meta)
        hidden = self.head(inputs.ids, inputs.positions, features, meta, from_target)
        last = hidden.index_select(0, torch.tensor(inputs.sample_rows, dtype=torch.long, device=hidden.device))
        at = {id(v): n for n, v in enumerate(ordered)}
        order = torch.tensor([at[id(v)] for v in views], dtype=torch.long, device=last.device)
        last = last.index_select(0, order)
        return last, self.head.draft_tokens(last).tolist()


def _share(head: nn.Module, runner: ModelRunner, target_dir: str, target: ModelConfig,
           take: list[tuple[str, str]], weights: list[tuple[str, torch.Tensor]]) -> dict[str, nn.Module]:
    """The target's embedding / LM head where the head's checkpoint has none: the target's modules themselves on
    one rank, else (they are vocabulary shards there) their whole tensors read from the target's checkpoint."""
    if runner.tp.size == 1:
        shared = {}
        for attr, path in take:
            module = runner.model.get_submodule(path)
            setattr(head, attr, module)
            shared[attr] = module
        return shared
    names = {"model.embed_tokens": "model.embed_tokens.weight",
             "lm_head": "model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"}
    wanted = {names[path]: attr for attr, path in take}
    for name, tensor in read_tensors(target_dir, lambda n: n in wanted):
        weights.append((f"{wanted[name]}.weight", tensor))
    return {}


def _aux_layers(head_dir: str, target: ModelConfig) -> tuple[int, ...]:
    """EAGLE-3: the target layers whose input stream the head reads (its config's
    eagle_aux_hidden_state_layer_ids, else vLLM's default 2, L // 2, L - 3)."""
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    layers = tuple(ids) if ids else (2, n // 2, n - 3)
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in layers):
        raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(layers)} are not three "
                         f"layers of the target's {n}")
    return layers


def _eagle_head(spec: SpeculativeConfig, target: ModelConfig, backend_cls
                ) -> tuple[ModelConfig, EagleHead | Eagle3Head, list[tuple[str, torch.Tensor]]]:
    path = os.path.join(spec.model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"speculative_config.model: {path} is missing (expected an {spec.method} head)")
    with open(path) as f:
        raw = json.load(f)
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    config = dataclasses.replace(config, max_model_len=target.max_model_len, layer_windows=[])
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the head's vocab_size {config.vocab_size} is not the target's "
                         f"{target.vocab_size}")
    weights = [(_eagle_name(name, spec.method == "eagle3"), t) for name, t in read_tensors(spec.model, lambda n: True)]
    weights = [(name, t) for name, t in weights if name]
    backend = backend_cls(config.num_heads, config.num_kv_heads, config.head_dim)
    if spec.method == "eagle":
        if config.hidden_size != target.hidden_size:
            raise ValueError(f"speculative_config.model: an EAGLE head's hidden_size must be the target's "
                             f"({config.hidden_size} != {target.hidden_size})")
        fc_bias = any(name == "fc.bias" for name, _ in weights)
        return config, EagleHead(config, backend, fc_bias), weights
    draft_vocab = raw.get("draft_vocab_size") or config.vocab_size
    head = Eagle3Head(config, backend, raw.get("target_hidden_size") or target.hidden_size, draft_vocab,
                      bool(raw.get("norm_before_residual", False)))
    return config, head, weights


def _eagle_name(name: str, eagle3: bool) -> str:
    """A head checkpoint's tensor name as the head module's ('' to skip): without a `model.` prefix, EAGLE-3's
    layer 0 as its `midlayer`; `t2d` (the reverse vocabulary map) and rotary caches are not needed."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0.") and eagle3:   # some EAGLE-3 exports name the midlayer as layer 0
        name = "midlayer." + name.removeprefix("layers.0.")
    return "" if name == "t2d" or "rotary_emb" in name else name


def _load_eagle_weights(head: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], shared: set[str]) -> None:
    params = {**dict(head.named_parameters()), **{n: b for n, b in head.named_buffers() if n == "d2t"}}
    missing = set(params) - shared
    for name, tensor in weights:
        load_tensor(head, params, missing, name, tensor, "the head (speculative_config.model)")  # type: ignore[arg-type]
    if missing:
        raise ValueError(f"speculative_config.model: the head's checkpoint lacks {sorted(missing)[:8]}")


def _mtp_head(target_dir: str, target: ModelConfig, backend_name: str
              ) -> tuple[ModelConfig, MTPHead, list[tuple[str, torch.Tensor]]]:
    """DeepSeek's first multi-token-prediction layer (layer num_hidden_layers of the model's checkpoint)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        if not json.load(f).get("num_nextn_predict_layers"):
            raise ValueError("speculative_config.method: mtp needs a model with multi-token-prediction layers "
                             "(num_nextn_predict_layers in its config.json)")
    if target.mla is None:
        raise ValueError("speculative_config.method: mtp is DeepSeek-V3's multi-token prediction (a DeepSeek model)")
    prefix = f"model.layers.{target.num_layers}."
    top = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "shared_head.norm.weight": "model.norm.weight", "shared_head.head.weight": "lm_head.weight",
           "embed_tokens.weight": "model.embed_tokens.weight"}
    weights = [(top.get(name[len(prefix):], "model.layers.0." + name[len(prefix):]), t)
               for name, t in read_tensors(target_dir, lambda n: n.startswith(prefix))]
    if not weights:
        raise ValueError(f"speculative_config.method: mtp: the checkpoint has no tensors of layer {target.num_layers}")
    moe = target.moe
    has_experts = any(".mlp.experts." in name or name.endswith(".mlp.gate.weight") for name, _ in weights)
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=(0,) if has_experts else (), expert_parallel=False)
    config = dataclasses.replace(target, num_layers=1, layer_windows=[], moe=moe, tie_word_embeddings=False)
    backend = mla_backend(config, 1, backend_name)
    return config, MTPHead(config, backend, torch.get_default_dtype()), weights
