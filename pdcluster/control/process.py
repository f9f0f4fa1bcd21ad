"""Child processes that end with their parent.

`with_parent(cmd)` wraps a command so the child asks the kernel for SIGTERM when the process that started
it dies (Linux `PR_SET_PDEATHSIG`), then execs the real command, which keeps the setting. So a supervisor
killed outright (SIGKILL, OOM) takes its children with it: they drain and clean up as on any SIGTERM
instead of holding ports, shared memory and etcd records as orphans. Not preexec_fn: forking a
multi-threaded process and running Python in the child before exec can deadlock.

The kernel sends the signal when the *thread* that started the child exits: start such children from a
thread that lives as long as they should (the main thread).
"""

from __future__ import annotations

import os
import sys

_GUARD = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)   # the parent died before the guard was armed
os.execv(sys.argv[2], sys.argv[2:])
"""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is not a zombie (killed, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # another user's live process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def with_parent(cmd: list[str]) -> list[str]:
    """`cmd` (argv, the first item an executable path) wrapped to receive SIGTERM when this process dies;
    unchanged where the kernel has no such facility."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _GUARD, str(os.getpid()), *cmd]
