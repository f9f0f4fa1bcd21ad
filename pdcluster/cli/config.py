"""The config classes of the three process kinds, and the `pdcluster` flags derived from their fields.

Only this top layer sees all three classes (the router and the nodes may not import each other), so the
kind table the loader checks config files against lives here.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from typing import Any, Optional

import typer

from pdcluster.control import config as base
from pdcluster.control.config import CommonConfig, field_type
from pdcluster.node.config import ENGINE_KNOBS, NodeConfig
from pdcluster.router.settings import RouterConfig, RouterSettings

KINDS: dict[str, type] = {"router": RouterConfig, "prefill": NodeConfig, "decode": NodeConfig}
# The flag's annotation by knob type; everything else (and a knob with a parser) is passed on as text.
_FLAG_TYPES: dict[str, Any] = {"bool": Optional[bool], "int": Optional[int], "float": Optional[float]}
_COMMON = {f.name for f in dataclasses.fields(CommonConfig)}
_ROUTER = {f.name for f in dataclasses.fields(RouterSettings)}


def load_config(kind: str, file: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                env: typing.Mapping[str, str] | None = None) -> Any:
    """The validated config of "router", "prefill" or "decode" (defaults < file < env < overrides)."""
    return base.load_config(kind, file, overrides, env, kinds=KINDS)


def check_timeouts(decode: Any, router: Any) -> None:
    """The relations between a decode node's and a router's timeouts (docs/operations.md "Timeouts"):
    the decode node gives up on a prefill node, and hears from it, well before the router gives up on
    the decode node. ValueError naming the knobs when they do not hold."""
    if not decode.prefill_timeout < router.stall_timeout:
        raise ValueError(f"prefill_timeout ({decode.prefill_timeout} s) must be below the router's stall_timeout "
                         f"({router.stall_timeout} s)")
    if not 3 * decode.heartbeat_interval <= router.stall_timeout:
        raise ValueError(f"heartbeat_interval ({decode.heartbeat_interval} s) must be at most a third of the "
                         f"router's stall_timeout ({router.stall_timeout} s)")


def flag_parameters(cls: type, skip: typing.Collection[str] = ()) -> list[inspect.Parameter]:
    """One `--name` option per knob of `cls` (bools: `--name/--no-name`), default None = "not given".
    The loader coerces and validates the values, as it does the file's and the environment's."""
    params = []
    for f in base.settings(cls):
        if f.name in skip:
            continue
        kind, _ = field_type(f)
        flag = "--" + f.name.replace("_", "-")
        choices = f.metadata.get("choices")
        text = f.metadata.get("help", "") + (f" ({' | '.join(choices)})" if choices else "")
        if kind == "bool":
            flag = f"{flag}/--no-{flag[2:]}"
        option = typer.Option(None, flag, help=text, show_default=False, rich_help_panel=_panel(cls, f.name))
        annotation = Optional[str] if f.metadata.get("parse") else _FLAG_TYPES.get(kind or "", Optional[str])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
    return params


def _panel(cls: type, name: str) -> str:
    """The --help group of a flag: the declaration it comes from."""
    if issubclass(cls, RouterSettings) and name in _ROUTER:
        return "Router"
    return "Common" if name in _COMMON else "Engine (vLLM names)" if name in ENGINE_KNOBS else "Node"


def with_flags(command: typing.Callable, params: list[inspect.Parameter]) -> typing.Callable:
    """`command(fixed..., **flags)` with `params` in place of `**flags` in the signature typer reads."""
    fixed = [p for p in inspect.signature(command, eval_str=True).parameters.values()
             if p.kind != inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = inspect.Signature(fixed + params)  # type: ignore[attr-defined]
    return command
