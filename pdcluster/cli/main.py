"""The `pdcluster` command. Each subcommand lives with the code it drives; this file only wires them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import typer

from pdcluster.cli.config import KINDS, check_timeouts, flag_parameters, load_config, with_flags
from pdcluster.control.config import DEFAULT_ETCD, CommonConfig, declared_default
from pdcluster.node.config import use_cpu_cores

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="pdcluster: disaggregated prefill/decode LLM serving.")


@app.command()
def demo(
    model: str = typer.Option("", help="HF model dir (or a `pdcluster convert` output); default: "
                              "SmolLM2-135M-Instruct, converted once into ~/.cache/pdcluster/models"),
    prompts: int = typer.Option(8, help="number of demo prompts"),
    max_tokens: int = typer.Option(32, help="tokens to generate per prompt"),
) -> None:
    """Offline generation demo on the engine (no cluster)."""
    from pdcluster.cli.demo import run_demo

    run_demo(model=model or None, num_prompts=prompts, max_tokens=max_tokens)


@app.command()
def convert(
    src: str = typer.Argument(..., help="HF model directory (safetensors or .bin) or a .gguf file"),
    out: str = typer.Argument(..., help="output directory (an earlier conversion there is replaced)"),
    dtype: str = typer.Option("float16", help="float32 | bfloat16 | float16: the weights are cast once, here"),
    tensor_parallel_size: int = typer.Option(1, help="write one pre-sharded file per tensor-parallel rank"),
    enable_expert_parallel: bool = typer.Option(False, help="MoE: shard for engines run with enable_expert_parallel "
                                                "(whole experts per rank)"),
    quantization: str = typer.Option("", help="w8a8 | w8a8_static | w8a16 | w4a16: quantize the decoder layers' "
                                     "linear weights (round-to-nearest) and write them as compressed-tensors"),
    calibration: str = typer.Option("", help="W8A8: 'default' (built-in prompts) or a .jsonl / text file of "
                                    "prompts: SmoothQuant (and w8a8_static's activation scales) calibrated on them"),
    smoothing_strength: float = typer.Option(0.6, help="SmoothQuant's alpha, with --calibration"),
    quantize_lm_head: bool = typer.Option(False, help="quantize the LM head too (a tied one is written untied)"),
) -> None:
    """Convert a checkpoint into the engine's format (safetensors in DTYPE, config, tokenizer, chat template,
    manifest; docs/engine.md). Written to a temp dir and renamed at the end: an interrupted run leaves nothing."""
    from rich.progress import Progress

    from pdcluster.engine.convert import convert_model

    with Progress(transient=True) as bar:
        task = bar.add_task("converting", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total or None, description=name)

        try:
            path = convert_model(src, out, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                 progress=progress, expert_parallel=enable_expert_parallel,
                                 quantization=quantization or None, calibration=calibration or None,
                                 smoothing_strength=smoothing_strength, quantize_lm_head=quantize_lm_head)
        except (ValueError, OSError) as exc:
            typer.echo(f"pdcluster convert: {exc}", err=True)
            raise typer.Exit(2) from None
    quantized = f", {quantization}" if quantization else ""
    quantized += f", calibrated ({calibration})" if calibration or quantization == "w8a8_static" else ""
    quantized += ", LM head quantized" if quantize_lm_head else ""
    typer.echo(f"converted {src} -> {path} ({dtype}{quantized}, tensor_parallel_size {tensor_parallel_size})")


# ---- cluster services: thin wiring; the logic lives in pdcluster.cli.up, router.server and the node packages.
# Their flags are derived from the config declarations (pdcluster.cli.config): every config key is a flag.

def _load(kind: str, config: Path | None, overrides: dict[str, Any]):
    """Validated config (file < env < flags) with logging set up; exits 2 with the reason when invalid."""
    from pdcluster.control.log import setup_logging

    try:
        cfg = load_config(kind, config, overrides)
    except (ValueError, OSError) as exc:
        typer.echo(f"pdcluster {kind}: {exc}", err=True)
        raise typer.Exit(2) from None
    setup_logging(cfg.log_level, cfg.log_format, cfg.node_id)
    return cfg


_CONFIG = typer.Option(None, "--config", help="YAML or TOML config file; every flag below is also a config key "
                       "and an env variable PDCLUSTER_<KEY> (file < env < flag)")


def _router(config: Optional[Path] = _CONFIG, **flags: Any) -> None:
    """Run the OpenAI-compatible router against the nodes registered in etcd."""
    cfg = _load("router", config, flags)
    if cfg.workers > 1:
        from pdcluster.router.workers import serve_workers

        raise typer.Exit(serve_workers(cfg))
    from pdcluster.router.server import run_router

    run_router(cfg)


def _node_command(kind: str):
    def command(config: Optional[Path] = _CONFIG, **flags: Any) -> None:
        cfg = _load(kind, config, flags)
        use_cpu_cores(cfg)   # before the node's modules load torch (and OpenMP, which reads its binding once)
        if kind == "prefill":
            from pdcluster.prefill_node.node import main as serve
        else:
            from pdcluster.decode_node.node import main as serve
        raise typer.Exit(serve(cfg))

    command.__doc__ = f"Run a {kind} node (registers in etcd; SIGTERM drains)."
    return with_flags(command, flag_parameters(KINDS[kind]))


app.command("router")(with_flags(_router, flag_parameters(KINDS["router"])))
app.command("prefill")(_node_command("prefill"))
app.command("decode")(_node_command("decode"))

# `up` passes these on to every node / to the router; the rest of those configs it fills in itself.
_UP_OWN = {f.name for f in dataclasses.fields(CommonConfig)} | {"model", "port", "control_port", "load_port",
                                                                "kv_port"}
_UP_NODE = flag_parameters(KINDS["decode"], skip=_UP_OWN)
_UP_ROUTER = flag_parameters(KINDS["router"], skip=_UP_OWN)


def _up(
    model: Optional[str] = typer.Option(None, help="HF model dir (or a `pdcluster convert` output); default: "
                                        "SmolLM2-135M-Instruct, converted once into ~/.cache/pdcluster/models"),
    prefill: int = typer.Option(1, help="number of prefill nodes"),
    decode: int = typer.Option(1, help="number of decode nodes"),
    port: int = typer.Option(declared_default(KINDS["router"], "port"), help="router HTTP port (0 = any free port)"),
    etcd: Optional[str] = typer.Option(None, help="etcd host:port; started locally when unreachable"),
    cluster: str = typer.Option(declared_default(CommonConfig, "cluster"), help="cluster name"),
    log_level: str = typer.Option(declared_default(CommonConfig, "log_level")),
    smoke: bool = typer.Option(False, "--smoke", help="send one request through the cluster, then stop"),
    **knobs: Any,
) -> None:
    """Start a local cluster: etcd (if none is reachable), one router, N prefill and M decode nodes.
    Engine and node flags apply to every node, router flags to the router (max-model-len to both)."""
    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.cli.up import run_up
    from pdcluster.control.log import setup_logging

    setup_logging(log_level, "text", "up")
    node_config = {p.name: knobs[p.name] for p in _UP_NODE if knobs[p.name] is not None}
    router_config = {p.name: knobs[p.name] for p in _UP_ROUTER if knobs[p.name] is not None}
    if smoke:
        router_config.setdefault("disagg_min_tokens", 0)  # the smoke request takes the disaggregated path
    try:  # refuse bad values here, before any process starts
        check_timeouts(load_config("decode", overrides={**node_config, "model": model or "/model"}, env={}),
                       load_config("router", overrides=router_config, env={}))
    except ValueError as exc:
        typer.echo(f"pdcluster up: {exc}", err=True)
        raise typer.Exit(2) from None
    cluster_ = LocalCluster(model=model, num_prefill=prefill, num_decode=decode, port=port,
                            etcd=etcd or DEFAULT_ETCD, cluster=cluster, log_level=log_level,
                            node_config=node_config, router_config=router_config)
    try:   # the default model is converted now (once), before the cluster starts
        cluster_.resolve_model()
    except (ValueError, OSError) as exc:
        typer.echo(f"pdcluster up: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        code = run_up(cluster_, smoke=smoke)
    except ValueError as exc:   # e.g. KV pools that do not fit this host, found before any process started
        typer.echo(f"pdcluster up: {exc}", err=True)
        code = 2
    raise typer.Exit(code)


app.command("up")(with_flags(_up, _UP_NODE + [p for p in _UP_ROUTER if p.name not in {q.name for q in _UP_NODE}]))


# ---- admin commands: the logic lives in pdcluster.cli.admin

_ADMIN_ETCD = typer.Option(None, "--etcd", help="etcd endpoints host:port[,host:port] (env PDCLUSTER_ETCD)")
_ADMIN_CLUSTER = typer.Option(None, "--cluster", help="cluster name (env PDCLUSTER_CLUSTER; default 'default')")


def _etcd_flags(command):
    """Give an admin command the services' etcd TLS / auth knobs as flags: --etcd-ca, --etcd-cert, --etcd-key,
    --etcd-user, --etcd-password-file (env PDCLUSTER_ETCD_CA, ...); they arrive in its **etcd_security."""
    from pdcluster.control.config import ETCD_SECURITY

    common = {f.name for f in dataclasses.fields(CommonConfig)}
    return with_flags(command, flag_parameters(CommonConfig, skip=common - set(ETCD_SECURITY)))


def _admin(coro_fn, *args: Any) -> Any:
    """Run one admin coroutine; an AdminError is printed and exits 1."""
    import asyncio

    from pdcluster.cli.admin import AdminError

    try:
        return asyncio.run(coro_fn(*args))
    except AdminError as exc:
        typer.echo(f"pdcluster: {exc}", err=True)
        raise typer.Exit(1) from None


def _target(etcd: Optional[str], cluster: Optional[str], security: dict[str, Any]) -> tuple[list[str], str, Any]:
    """(endpoints, cluster name, EtcdCredentials) of an admin command; exit 2 when a value is bad."""
    from pdcluster.cli.admin import AdminError, cluster_name, etcd_credentials, etcd_endpoints

    try:
        return etcd_endpoints(etcd), cluster_name(cluster), etcd_credentials(security)
    except AdminError as exc:
        typer.echo(f"pdcluster: {exc}", err=True)
        raise typer.Exit(2) from None


def _console():
    """A rich console; piped output gets wide lines instead of rich's 80-column default."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _print_json(data: Any) -> None:
    import json

    typer.echo(json.dumps(data, indent=2))


@app.command()
@_etcd_flags
def status(
    etcd: Optional[str] = _ADMIN_ETCD, cluster: Optional[str] = _ADMIN_CLUSTER,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    watch: bool = typer.Option(False, "--watch", help="refresh until Ctrl-C"),
    interval: float = typer.Option(2.0, help="seconds between refreshes with --watch"), **etcd_security: Any,
) -> None:
    """Every node in etcd with its live stats (from its Load reports)."""
    from pdcluster.cli import admin

    endpoints, name, creds = _target(etcd, cluster, etcd_security)
    if not watch:
        nodes = _admin(admin.cluster_status, endpoints, name, admin.LOAD_WAIT, creds)
        if as_json:
            _print_json({"cluster": name, "nodes": [n.to_dict() for n in nodes]})
        else:
            _console().print(admin.status_table(nodes, name))
        return
    import time

    from rich.live import Live

    try:
        with Live(admin.status_table([], name), auto_refresh=False) as live:
            while True:
                nodes = _admin(admin.cluster_status, endpoints, name, admin.LOAD_WAIT, creds)
                live.update(admin.status_table(nodes, name), refresh=True)
                time.sleep(max(0.1, interval))
    except KeyboardInterrupt:
        pass


@app.command()
@_etcd_flags
def nodes(
    etcd: Optional[str] = _ADMIN_ETCD, cluster: Optional[str] = _ADMIN_CLUSTER,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"), **etcd_security: Any,
) -> None:
    """The membership list from etcd (no live stats)."""
    import dataclasses

    from pdcluster.cli import admin

    endpoints, name, creds = _target(etcd, cluster, etcd_security)
    listed = _admin(admin.cluster_status, endpoints, name, 0.0, creds)
    if as_json:
        _print_json({"cluster": name, "nodes": [dict(dataclasses.asdict(n.info), admin_state=n.admin.state)
                                                for n in listed]})
    else:
        _console().print(admin.nodes_table(listed, name))


@app.command()
@_etcd_flags
def cordon(node: str = typer.Argument(..., help="node id"), etcd: Optional[str] = _ADMIN_ETCD,
           cluster: Optional[str] = _ADMIN_CLUSTER,
           reason: str = typer.Option("", help="why (kept in the admin record)"), **etcd_security: Any) -> None:
    """Stop sending new requests to NODE (running ones finish; it stays up). Survives restarts."""
    from pdcluster.cli import admin

    endpoints, name, creds = _target(etcd, cluster, etcd_security)
    _admin(admin.set_state, endpoints, name, node, "cordoned", reason, creds)
    typer.echo(f"{node} cordoned")


@app.command()
@_etcd_flags
def uncordon(node: str = typer.Argument(..., help="node id"), etcd: Optional[str] = _ADMIN_ETCD,
             cluster: Optional[str] = _ADMIN_CLUSTER, **etcd_security: Any) -> None:
    """Let NODE take new requests again (after cordon or drain)."""
    from pdcluster.cli import admin

    endpoints, name, creds = _target(etcd, cluster, etcd_security)
    _admin(admin.set_state, endpoints, name, node, "active", "", creds)
    typer.echo(f"{node} uncordoned")


@app.command()
@_etcd_flags
def drain(node: str = typer.Argument(..., help="node id"), etcd: Optional[str] = _ADMIN_ETCD,
          cluster: Optional[str] = _ADMIN_CLUSTER,
          timeout: float = typer.Option(120.0, help="seconds to wait for the node to leave etcd"),
          reason: str = typer.Option("pdcluster drain", help="why (kept in the admin record)"),
          migrate: bool = typer.Option(False, "--migrate/--no-migrate",
                                       help="a decode node moves its running requests to other decode nodes, with "
                                            "their KV, instead of finishing them"),
          **etcd_security: Any) -> None:
    """No new requests to NODE, finish its in-flight ones (or move them: --migrate), wait until it exits and
    leaves etcd. It stays cordoned afterwards: `pdcluster uncordon NODE` once its replacement is up. Exit 1 on
    timeout."""
    from pdcluster.cli import admin

    endpoints, name, creds = _target(etcd, cluster, etcd_security)
    typer.echo(f"draining {node}{' (moving its requests)' if migrate else ''} (timeout {timeout:g} s)...")
    took = _admin(admin.drain_node, endpoints, name, node, timeout, reason, creds, migrate)
    typer.echo(f"{node} drained in {took:.1f} s and left the cluster; it stays cordoned until uncordon")


@app.command()
@_etcd_flags
def health(
    etcd: Optional[str] = _ADMIN_ETCD, cluster: Optional[str] = _ADMIN_CLUSTER,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output with reasons"),
    timeout: float = typer.Option(1.5, help="seconds to wait for the nodes' Load reports"), **etcd_security: Any,
) -> None:
    """Exit 0 when etcd answers and at least one decode node is active and answering; else exit 1."""
    import asyncio

    from pdcluster.cli import admin

    endpoints, name, creds = _target(etcd, cluster, etcd_security)
    report = asyncio.run(admin.check_health(endpoints, name, timeout, creds))
    if as_json:
        _print_json(report.to_dict())
    else:
        serving = sum(1 for n in report.nodes if n.state == "serving")
        head = "healthy" if report.healthy else "unhealthy"
        typer.echo(f"{head}: cluster {name!r}, {len(report.nodes)} node(s), {serving} serving")
        for line in report.reasons:
            typer.echo(f"  error: {line}")
        for line in report.notes:
            typer.echo(f"  note: {line}")
    raise typer.Exit(0 if report.healthy else 1)


@app.command()
def cleanup() -> None:
    """Remove the shared-memory KV pools (/dev/shm/pdcluster-kv-*) and weight pools (/dev/shm/pdcluster-weights-*)
    of node processes that are gone. Pools in use stay. Run by the systemd node units after a node stops
    (ExecStopPost)."""
    from pdcluster.engine.weight_pool import sweep_dead_weight_pools
    from pdcluster.kv_transfer.shm import sweep_dead_pools

    removed = sweep_dead_pools()
    for name in removed:
        typer.echo(f"removed /dev/shm/{name} (+ .tags)")
    typer.echo(f"{len(removed)} dead KV pool(s) removed")
    weights = sweep_dead_weight_pools()
    for name in weights:
        typer.echo(f"removed /dev/shm/{name}/")
    typer.echo(f"{len(weights)} unused weight pool(s) removed")


# ---- the cluster secret: the logic lives in pdcluster.control.keys

keys_app = typer.Typer(no_args_is_help=True, help="The cluster secret that authenticates the cluster's connections.")
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(path: str = typer.Argument(..., help="file to write (mode 0600)"),
                  force: bool = typer.Option(False, "--force", help="replace an existing file")) -> None:
    """Write a new cluster secret to PATH. Every router and node of the cluster needs the same file
    (config key cluster_secret); admin commands read it from $PDCLUSTER_CLUSTER_SECRET."""
    from pdcluster.control.keys import SecretError, generate_secret

    try:
        keys = generate_secret(path, force=force)
    except (SecretError, OSError) as exc:
        typer.echo(f"pdcluster keys generate: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {path} (fingerprint {keys.fingerprint}); set cluster_secret: {path} on every router and node")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
