"""Chained block hashes of a token sequence: the shared vocabulary of prefix-aware routing.

Nodes report the hashes of the full blocks in their prefix cache (`Load.cached_block_hashes`);
the router hashes a prompt the same way and counts the leading blocks a node already holds.
Hash i covers tokens [0, (i+1)*block_size): equal hashes mean equal prefixes, not just equal blocks.
A pure function of (token ids, block size), stable across processes and hosts (no Python `hash`).
"""

from __future__ import annotations

import hashlib
import struct

_MASK63 = (1 << 63) - 1


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """One 63-bit hash per full block of `token_ids`; a trailing partial block is not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    prev = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, token_ids[start:start + block_size])
        hashes.append(prev)
    return hashes


def chain_hash(prev: int, block: list[int]) -> int:
    """Hash of one full block chained on the previous block's hash (0 for the first block)."""
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
