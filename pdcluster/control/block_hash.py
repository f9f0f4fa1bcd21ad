"""Chained block hashes of a token sequence: the shared vocabulary of prefix-aware routing.

Nodes report the hashes of the full blocks in their prefix cache (`Load.cached_block_hashes`);
the router hashes a prompt the same way and counts the leading blocks a node already holds.
Hash i covers tokens [0, (i+1)*block_size): equal hashes mean equal prefixes, not just equal blocks.
A pure function of (seed, token ids, block size), stable across processes and hosts (no Python `hash`).

The chain starts from a seed (`hash_seed`) that covers what else decides a block's content: the model, the KV
dtype and layout, the block size, and a per-cluster salt. Two models, two KV layouts or two clusters never
share a hash, so a block index spanning nodes cannot mix them up; a LoRA adapter's requests chain from
`lora_hash_seed` (the adapter's name and weights on top). Seed 0 is the bare token chain (tests and tools that
compare against it).
"""

from __future__ import annotations

import hashlib
import struct

_MASK63 = (1 << 63) - 1


# Block-hash events (a node's KV cache tells the routers what it stored and evicted: Load.kv_events) name the
# tier a block is in, fastest first, and what happened to it.
POOL, HOST, DISK = 0, 1, 2
TIER_NAMES = ("pool", "host", "disk")
STORED, EVICTED = 0, 1

KV_LAYOUT_VERSION = 1   # bump when a block's bytes change meaning for the same model and dtype


def hash_seed(*parts: object) -> int:
    """The 63-bit chain seed of everything in `parts` (model identity, dtypes, layout, salt), stable across
    processes and hosts."""
    text = "|".join(str(p) for p in (KV_LAYOUT_VERSION, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK63


def lora_hash_seed(seed: int, lora_name: str, content_hash: str) -> int:
    """The chain seed of a request under a LoRA adapter: the engine's `seed` and the adapter's identity (its name
    and a hash of its weights), so KV computed under one adapter is never a prefix hit for another or for the
    base model."""
    return hash_seed(seed, "lora", lora_name, content_hash)


def block_hashes(token_ids: list[int], block_size: int, seed: int = 0) -> list[int]:
    """One 63-bit hash per full block of `token_ids`, chained from `seed`; a trailing partial block is not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    prev = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, token_ids[start:start + block_size])
        hashes.append(prev)
    return hashes


def chain_hash(prev: int, block: list[int]) -> int:
    """Hash of one full block chained on the previous block's hash (the seed for the first block)."""
    digest = hashlib.blake2b(struct.pack(f"<Q{len(block)}q", prev, *block), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def cached_prefix_blocks(prompt_hashes: list[int], cached: set[int] | frozenset[int]) -> int:
    """How many leading blocks of a prompt (given its `block_hashes`) are in `cached`."""
    n = 0
    for h in prompt_hashes:
        if h not in cached:
            break
        n += 1
    return n
