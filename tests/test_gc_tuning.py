"""The router's and the nodes' start-up heaps leave CPython's garbage collector (pdcluster/control/gc_tuning.py)."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return [int(v) for v in out.stdout.split()]


def test_quiet_gc_freezes_the_start_up_heap_and_collects_the_young_generation_less_often() -> None:
    threshold, frozen = run("import gc; import pdcluster.router.server; from pdcluster.control.gc_tuning import "
                            "quiet_gc; quiet_gc(); print(gc.get_threshold()[0], gc.get_freeze_count())")
    assert threshold == 5000 and frozen > 10000   # the imported app, FastAPI, pydantic: all out of the scans


def test_a_node_process_freezes_its_loaded_heap_before_it_serves() -> None:
    # run_service builds the node (here: something that imports torch, as loading a model does), then serves it;
    # what the build left alive is frozen by then, and a full collection no longer scans it.
    code = """
import gc
from pdcluster.node.service import run_service

class Node:
    exit_code = 7
    async def serve(self):
        print(gc.get_freeze_count(), len(gc.get_objects()), gc.get_threshold()[0])

def build():
    import torch  # noqa: F401
    return Node()

print(gc.get_freeze_count())
print(run_service(build))
"""
    before, frozen, scanned, threshold, exit_code = run(code)
    assert before == 0 and exit_code == 7
    assert frozen > 50000 and scanned < frozen / 10 and threshold == 5000
