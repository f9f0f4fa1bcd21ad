"""One rank's adapters: the device slot table (`max_loras` slots, least recently used refilled first), the host
cache of loaded adapters (`max_cpu_loras`, LRU; an adapter that left it is read from its path again) and, on
rank 0, the adapters the engine knows (name -> request and content hash).

Rank 0 decides each step which adapter sits in which slot (`assign`, from the step's sequences); every rank then
fills the slots that changed and sets the step's token -> slot map (`begin_step`, from the step inputs), so
tensor-parallel ranks fill their own parts from their own host cache or the adapter's files."""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

import torch
from torch import nn

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.attention import SelfAttention
from pdcluster.engine.layers.mlp import GatedMLP
from pdcluster.engine.lora.adapter import LoRAAdapter, load_adapter
from pdcluster.engine.lora.layers import LoRALayer
from pdcluster.engine.lora.request import LoRAConfig, LoRARequest
from pdcluster.engine.lora.step import LoRAStep
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.step_inputs import StepInputs

# (slot, adapter name, path, content hash): a slot to (re)fill before the step runs
SlotLoad = tuple[int, str, str, str]


class LoRAUnavailable(ValueError):
    """An adapter a step needs cannot be read any more (its files moved, changed, or broke since it was added):
    the engine ends that adapter's requests with this error and serves the others."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(reason if name in reason else f"LoRA adapter {name!r}: {reason}")
        self.name = name


class LoRASlots:
    def __init__(self, model: nn.Module, config: ModelConfig, lora: LoRAConfig, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup) -> None:
        self.config, self.lora, self.tp = config, lora, tp
        self.dtype, self.device = dtype, device
        self.step = LoRAStep()
        # (layer, PEFT module) -> (its LoRA layer, shard index)
        self.targets: dict[tuple[int, str], tuple[LoRALayer, int]] = {}
        self._attach(model)
        self.layers = list({id(layer): layer for layer, _ in self.targets.values()}.values())
        self.kinds = {layer.kind for layer in self.layers}   # the compute paths the step's slots are built for
        self.known: dict[str, tuple[LoRARequest, str]] = {}
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[str, int] = OrderedDict()   # resident adapters, least recently used first
        self.num_slot_loads = 0

    def _attach(self, model: nn.Module) -> None:
        """A LoRA layer on every dense attention and MLP projection (not MLA's, not routed experts')."""
        n, r = self.lora.max_loras, self.lora.max_lora_rank
        hidden = self.config.hidden_size
        for i, layer in enumerate(cast(nn.ModuleList, model.get_submodule("model.layers"))):
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn, SelfAttention):
                qkv = LoRALayer(self.step, hidden, [attn.q_size, attn.kv_size, attn.kv_size], n, r, self.dtype,
                                self.device)
                o = LoRALayer(self.step, attn.q_size, [hidden], n, r, self.dtype, self.device)
                attn.qkv_proj.lora, attn.o_proj.lora = qkv, o
                self.targets.update({(i, "q_proj"): (qkv, 0), (i, "k_proj"): (qkv, 1), (i, "v_proj"): (qkv, 2),
                                     (i, "o_proj"): (o, 0)})
            if isinstance(mlp, GatedMLP):
                inter = mlp.intermediate_size
                gate_up = LoRALayer(self.step, hidden, [inter, inter], n, r, self.dtype, self.device)
                down = LoRALayer(self.step, inter, [hidden], n, r, self.dtype, self.device)
                mlp.gate_up_proj.lora, mlp.down_proj.lora = gate_up, down
                self.targets.update({(i, "gate_proj"): (gate_up, 0), (i, "up_proj"): (gate_up, 1),
                                     (i, "down_proj"): (down, 0)})

    # ---- adapters (rank 0: the engine's add_lora / remove_lora) ------------------------------------

    def add(self, request: LoRARequest) -> str:
        """Check and load `request`'s adapter into the host cache (once per name); its content hash."""
        known = self.known.get(request.lora_name)
        if known is not None:
            if known[0].lora_path != request.lora_path and request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded from {known[0].lora_path}; "
                                 f"remove it before loading another from {request.lora_path}")
            return known[1]
        if not request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded and the request gives no lora_path")
        adapter = self._adapter(request.lora_name, request.lora_path, None)
        self.known[request.lora_name] = (request, adapter.content_hash)
        return adapter.content_hash

    def remove(self, name: str) -> bool:
        """Forget adapter `name` (host cache and slot too); False if it was not loaded."""
        if self.known.pop(name, None) is None:
            return False
        self.host.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            for layer in self.layers:
                layer.clear_slot(slot)
        return True

    def _adapter(self, name: str, path: str, content_hash: str | None) -> LoRAAdapter:
        """From the host cache, or read from `path` (then checked against `content_hash`, the file it was
        added from)."""
        adapter = self.host.get(name)
        if adapter is None or adapter.path != path or content_hash not in (None, adapter.content_hash):
            adapter = load_adapter(name, path, self.config, self.lora.max_lora_rank, self.tp.rank, self.tp.size)
            if content_hash is not None and adapter.content_hash != content_hash:
                raise ValueError(f"LoRA adapter {name!r} ({path}) changed on disk since it was loaded")
            missing = sorted(k for k in adapter.weights if k not in self.targets)
            if missing:
                layer, module = missing[0]
                raise ValueError(f"LoRA adapter {name!r} ({path}): layers.{layer}.{module} has no LoRA-capable "
                                 f"linear layer in this {self.config.architecture} (MLA and routed experts have none)")
            self.host[name] = adapter
        self.host.move_to_end(name)
        while len(self.host) > self.lora.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    # ---- steps ------------------------------------------------------------------------------------

    def assign(self, inputs: StepInputs) -> None:
        """Rank 0: a slot for each adapter of the step's sequences (`inputs.seq_rows`), refilling the least
        recently used slots that this step does not use; sets `inputs.lora_slots` / `lora_loads`."""
        rows = [(seq.lora.lora_name, start, n) for seq, start, n in inputs.seq_rows if seq.lora is not None]
        if not rows:
            return
        names = list(dict.fromkeys(name for name, _, _ in rows))
        if len(names) > self.lora.max_loras:
            raise RuntimeError(f"a step holds {len(names)} LoRA adapters, more than max_loras {self.lora.max_loras}")
        loads: list[SlotLoad] = []
        for name in names:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            request, content_hash = self.known[name]
            try:   # read it now, before any slot changes hands: a failure leaves every slot as it was
                self._adapter(name, request.lora_path, content_hash)
            except ValueError as exc:
                raise LoRAUnavailable(name, str(exc)) from None
            taken = set(self.slot_of.values())
            free = [s for s in range(self.lora.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:   # the least recently used resident adapter not in this step leaves its slot
                victim = next(v for v in self.slot_of if v not in names)
                slot = self.slot_of.pop(victim)
            loads.append((slot, name, request.lora_path, content_hash))
            self.slot_of[name] = slot
        slots = torch.full((inputs.ids.shape[0],), -1, dtype=torch.int32)
        for name, start, n in rows:
            slots[start:start + n] = self.slot_of[name]
        inputs.lora_slots, inputs.lora_loads = slots, loads

    def begin_step(self, slots: torch.Tensor | None, loads: list[SlotLoad]) -> None:
        """Every rank: fill the slots rank 0 assigned, then the step's token -> slot map (`slots` on the host)."""
        for slot, name, path, content_hash in loads:
            adapter = self._adapter(name, path, content_hash)
            for layer in self.layers:
                layer.filled.discard(slot)
            for key, (layer, shard) in self.targets.items():
                a, b = adapter.weights.get(key, (None, None))
                layer.set_slot(slot, shard, a, b)
            self.num_slot_loads += 1
        # (`assign` sets slots only when some row has an adapter)
        self.step.begin(slots, self.kinds, self.lora.max_lora_rank, self.dtype, self.device)
