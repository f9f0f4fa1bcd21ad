"""engine/malloc.py: with glibc's thresholds set, a step's large temporaries reuse the heap (no page faults once
warm); without them (PDCLUSTER_MALLOC_TUNING=0) each is fresh pages; the user's own allocator settings win."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pdcluster.engine import malloc

# A process that builds nothing else: tune (or not), then allocate, fill and free a 40 MiB tensor per "step" (a
# prefill chunk's MLP activations of a larger model; above the 32 MiB glibc's own threshold rises to at most) and
# count the minor faults of the steps after the heap's layout settled.
PROBE = """
import json, resource, torch
from pdcluster.engine.malloc import keep_freed_memory
applied = keep_freed_memory()
def step():
    x = torch.empty(10 << 20, dtype=torch.float32)
    x.fill_(1.0)
    return float(x[-1])
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PDCLUSTER_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_temporaries_are_reused_not_faulted_in_again() -> None:
    tuned, untuned = probe(), probe(PDCLUSTER_MALLOC_TUNING="0")
    assert tuned["applied"] and not untuned["applied"]
    pages = 20 * (40 << 20) // 4096   # what 20 fresh 40 MiB tensors fault in with 4 KiB pages
    assert untuned["faults"] > pages // 2
    assert tuned["faults"] < pages // 20


def test_the_users_own_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("MALLOC_MMAP_THRESHOLD_", "1000000"), ("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4"),
                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"), ("PDCLUSTER_MALLOC_TUNING", "0")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert malloc._user_chose(), name
    for name in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD", "GLIBC_TUNABLES", "PDCLUSTER_MALLOC_TUNING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")   # (not a threshold: ours still apply)
    assert not malloc._user_chose()
