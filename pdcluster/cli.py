"""The `pdcluster` command. Each subcommand lives with the code it drives; this file only wires them."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="pdcluster: disaggregated prefill/decode LLM serving.")


@app.command()
def demo(
    model: str = typer.Option("", help="HF model directory; default: a tiny random Llama created in a temp dir"),
    prompts: int = typer.Option(8, help="number of demo prompts"),
    max_tokens: int = typer.Option(32, help="tokens to generate per prompt"),
) -> None:
    """Offline generation demo on the engine (no cluster)."""
    from engine.demo import run_demo

    run_demo(model=model or None, num_prompts=prompts, max_tokens=max_tokens)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
