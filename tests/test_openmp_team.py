"""One OpenMP team per node process (engine/openmp.py): the thread that built the engine gives its OpenMP workers
back when the engine thread starts, so libgomp does not fall back to its short spin (which made every engine step
of a 2-thread node 2-3x slower). Fresh interpreters: OpenMP's threads are per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COUNT = '''
import os, time
def threads():
    return len(os.listdir("/proc/self/task"))
def settle(want, timeout=10.0):
    end = time.monotonic() + timeout
    while threads() != want and time.monotonic() < end:
        time.sleep(0.01)
    return threads()
'''


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", COUNT + code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_thread_team_lets_the_calling_threads_workers_exit_until_its_next_parallel_region():
    got = run('''
import json, torch
from pdcluster.engine.openmp import release_thread_team
torch.set_num_threads(3)
alone = threads()
x = torch.ones(1 << 22)   # a parallel region: this thread's team of 3 (2 workers)
team = threads()
released = release_thread_team()
after = settle(team - 2)
x.add_(1)
again = threads()
print(json.dumps({"alone": alone, "team": team, "released": released, "after": after, "again": again}))
''')
    assert got["released"] is True
    assert got["team"] == got["alone"] + 2
    assert got["after"] == got["alone"]
    assert got["again"] == got["team"]


@pytest.mark.parametrize("threads", [2, 3])
def test_the_engine_thread_is_the_only_openmp_team_of_the_process(tiny_llama, threads):
    got = run(f'''
import json, queue, torch
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.engine_thread import EngineThread
from pdcluster.engine.llm_engine import LLMEngine
torch.set_num_threads({threads})
engine = LLMEngine(EngineArgs(model={tiny_llama!r}, num_gpu_blocks_override=64))
big = torch.ones(1 << 22)
big.add_(1)               # the building thread's team exists, as after loading a real model
built = threads()
outputs = queue.Queue()
thread = EngineThread(engine, outputs.put)
thread.start()
thread.post(lambda e: e.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
while not any(o.finished for o in outputs.get(timeout=60)):
    pass
thread.post(lambda e: big.add_(1))   # a parallel region on the engine thread: its team exists too
thread.post(lambda e: outputs.put("ran"))
assert outputs.get(timeout=60) == "ran"
print(json.dumps({{"built": built, "serving": settle(built + 1)}}))
thread.stop()
''')
    # The engine thread and its own workers came in; the building thread's workers went.
    assert got["serving"] == got["built"] + 1
