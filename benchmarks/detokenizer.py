"""The router's detokenizer per token: the byte table (`router/detokenizer.py`) against `tokenizers`' DecodeStream
(what it replaced), in the same run, on the same streams.

300 streams x 64 tokens, one token per `add` as the router streams them, after random 32-id prompts. Token ids
either as the fake decode node of `serving.py --start fake` emits them (`(7 + pos) % 300 + 3`) or random.
DecodeStream failures ("Invalid prefix", vllm-project/vllm#17448) are counted: the router used to fail the
response there.

    python benchmarks/detokenizer.py                         # the test tokenizer (SentencePiece, byte fallback)
    python benchmarks/detokenizer.py --model ~/.cache/pdcluster/models/smollm2-135m-instruct-bfloat16
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def streams(vocab: int, ids: str, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(300):
        prompt = [rng.randrange(3, vocab) for _ in range(32)]
        tokens = ([(7 + pos) % 300 + 3 for pos in range(64)] if ids == "fake-node"
                  else [rng.randrange(3, vocab) for _ in range(64)])
        out.append((prompt, tokens))
    return out


def decode_stream_us(tokenizer, work) -> tuple[float, int]:
    from tokenizers.decoders import DecodeStream

    failures, n, start = 0, 0, time.perf_counter()
    for prompt, tokens in work:
        stream = DecodeStream(ids=prompt[-5:], skip_special_tokens=True)
        for token in tokens:
            try:
                stream.step(tokenizer.tk, token)
            except Exception:
                failures += 1
                stream = DecodeStream(skip_special_tokens=True)
            n += 1
    return (time.perf_counter() - start) / n * 1e6, failures


def byte_table_us(tokenizer, work) -> float:
    from pdcluster.router.detokenizer import IncrementalDetokenizer

    n, start = 0, time.perf_counter()
    for prompt, tokens in work:
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        for token in tokens:
            detokenizer.add([token])
            n += 1
        detokenizer.flush()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir with tokenizer.json (default: the tests' tokenizer)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    own_dir = None
    model = args.model
    if model is None:
        from router_fakes import make_tokenizer_dir

        model = own_dir = make_tokenizer_dir(tempfile.mkdtemp(prefix="pdcluster-bench-tok-"))
    try:
        run(model, args.repeats)
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def run(model: str, repeats: int) -> None:
    from pdcluster.router.tokenizer import Tokenizer

    start = time.perf_counter()
    tokenizer = Tokenizer(model)
    table = tokenizer.byte_table
    print(f"{model}: vocab {tokenizer.vocab_size}, byte table {'built' if table else 'NOT modelled'} in "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms (with loading the tokenizer)")
    for ids in ("fake-node", "random"):
        work = streams(min(tokenizer.vocab_size, 32000), ids)
        base = [decode_stream_us(tokenizer, work) for _ in range(repeats)]
        new = [byte_table_us(tokenizer, work) for _ in range(repeats)]
        base_us, new_us = min(b[0] for b in base), min(new)
        print(f"  ids {ids:9s}: DecodeStream {base_us:5.2f} us/token ({base[0][1]} of {300 * 64} steps raised), "
              f"byte table {new_us:5.2f} us/token: {base_us / new_us:.1f}x")


if __name__ == "__main__":
    main()
