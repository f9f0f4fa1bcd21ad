"""The engine's hooks for a node that moves prompt KV between engines, called on the engine thread.

Prefill side (a node that ships prompt KV elsewhere while it is computed), during `step()`: which prompts
finish in this step and where their KV lives, each layer as it is done, and each prompt once its KV is
complete. Nothing else of the engine's state is needed to send KV layer by layer.

Decode side (a node whose prompt KV another node computes): `add_request(..., remote_kv=True)` reserves the
blocks and reports them through `on_remote_reserved` (before it returns, or later when the prompt's prefix is
loaded first); the node then tells the engine `remote_kv_landed` or `remote_kv_failed` (llm_engine.py).

Prefix fetch (a node that copies a prompt's leading blocks from another node that holds them, `fetches`): the
scheduler hands the blocks to fill to `on_fetch`; the node copies what it can and reports `kv_fetch_done`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptInStep:
    """A prompt whose last chunk runs in this step."""
    request_id: str
    block_ids: list[int]        # its block table: the prompt's KV is in the first blocks
    num_prompt_tokens: int


class KVConnector:
    """Base class: every hook does nothing. `layerwise`: `on_layer_done` does work, so a step with prompts
    finishing in it runs the eager layer loop (the compiled body has no per-layer hook); otherwise it is not
    called and such a step may run compiled."""

    layerwise = False
    fetches = False   # on_fetch copies blocks from another node

    def on_step_start(self, prompts: list[PromptInStep]) -> None:
        """Before the forward pass; `prompts` may be empty."""

    def on_layer_done(self, layer: int) -> None:
        """Layer `layer` wrote its KV for every token of the step."""

    def on_prompt_done(self, request_id: str, block_ids: list[int]) -> None:
        """The prompt's KV is complete in `block_ids` (after the forward pass, before the step's outputs)."""

    def on_remote_reserved(self, request_id: str, block_ids: list[int], num_cached_tokens: int) -> None:
        """A `remote_kv=True` request holds `block_ids` for its whole prompt; its first `num_cached_tokens`
        tokens are prefix-cache hits already in place, so the remote side writes from there on."""

    def on_fetch(self, request_id: str, block_ids: list[int], block_hashes: list[int]) -> None:
        """Copy the blocks published under `block_hashes` on another node into `block_ids` (pinned, in order),
        then report `LLMEngine.kv_fetch_done` with how many leading ones arrived intact. Only with `fetches`."""
