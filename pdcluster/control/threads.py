"""Thread pools of the router and node processes."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads all exist from the start: an idle process's thread count does not depend on
    the most concurrent load it ever saw (the soak test checks it comes back to its idle value)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    ready = threading.Barrier(workers)   # each task holds its thread until all are started
    for _ in range(workers):
        pool.submit(ready.wait, 5.0)
    return pool
