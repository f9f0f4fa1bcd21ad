"""The pre-copy front door on a target decode node (decode_node/pre_copy.py) against bad or unlucky PreCopy: a
holder that is no decode node (or this node), more holds than it keeps at once, a duplicate, a hold whose request
never comes (released at its deadline), a copy that fails. Each answered once, nothing held past its end. The
whole migration, with processes, is tests/test_drain_migrate.py's and tests/test_migration_faults.py's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from pdcluster.control.protocol import PreCopied, PreCopy
from pdcluster.decode_node.pre_copy import MAX_HOLDS, SUFFIX, PreCopies


class FakeEngine:
    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.have = 0          # blocks this pool already has of any prompt
        self.fetching = True   # whether a fetch starts for the rest

    def prefetch(self, key, ids, n):
        self.held[key] = n
        return self.have, self.fetching and self.have < n

    def abort(self, key):
        self.held.pop(key, None)


class FakeThread:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def call(self, fn):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn(self.engine))
        return fut

    def post(self, fn):
        fn(self.engine)


def view(**roles):
    return SimpleNamespace(nodes={n: SimpleNamespace(role=r) for n, r in roles.items()})


def precopies(engine: FakeEngine):
    sent: list[tuple[bytes, PreCopied]] = []
    pc = PreCopies("decode-b", view(**{"decode-a": "decode", "decode-b": "decode", "prefill-a": "prefill"}),
                   FakeThread(engine), lambda who, msg: sent.append((who, msg)) or True,  # type: ignore[arg-type]
                   CollectorRegistry())
    return pc, sent


def ask(rid: str, source: str = "decode-a", timeout_s: float = 30.0) -> PreCopy:
    return PreCopy(rid=rid, token_ids=list(range(100)), kv_source=source, num_blocks=6, timeout_s=timeout_s)


async def test_bad_holders_and_too_many_holds_are_refused_at_once():
    engine = FakeEngine()
    pc, sent = precopies(engine)
    for i, source in enumerate(["prefill-a", "decode-b", "nobody"]):
        pc.handle(b"router", ask(f"bad{i}", source))
    assert [(m.rid, m.num_blocks) for _, m in sent] == [("bad0", 0), ("bad1", 0), ("bad2", 0)]
    assert all("not a decode node" in (m.error or "") for _, m in sent) and not engine.held and not pc.holds
    sent.clear()
    for i in range(MAX_HOLDS + 1):
        pc.handle(b"router", ask(f"r{i}"))
    await asyncio.sleep(0)
    assert len(pc.holds) == MAX_HOLDS and [m.rid for _, m in sent] == [f"r{MAX_HOLDS}"]
    assert "held already" in (sent[0][1].error or "")
    pc.handle(b"router", ask("r0"))   # a duplicate: dropped, the hold stays as it was
    assert len(sent) == 1
    for i in range(MAX_HOLDS):
        pc.release(f"r{i}")
    assert not engine.held and not pc.holds


async def test_a_hold_answers_once_after_its_copy_and_ends_at_its_deadline():
    engine = FakeEngine()
    engine.have = 2
    pc, sent = precopies(engine)
    pc.handle(b"router", ask("m.2", timeout_s=0.2))
    await asyncio.sleep(0)
    assert pc.source_of("m.2" + SUFFIX) == "decode-a" and pc.source_of("m.2") is None and not sent
    pc.fetched("m.2" + SUFFIX, 4, "")
    pc.fetched("m.2" + SUFFIX, 4, "")   # a second end changes nothing
    assert [(who, m.rid, m.num_blocks, m.error) for who, m in sent] == [(b"router", "m.2", 6, None)]
    assert engine.held == {"m.2" + SUFFIX: 6}
    await asyncio.sleep(0.3)   # the request never came: the deadline lets the blocks go
    assert not pc.holds and not engine.held and len(sent) == 1


async def test_a_failed_copy_says_so_and_a_release_before_the_end_answers_too():
    engine = FakeEngine()
    pc, sent = precopies(engine)
    pc.handle(b"router", ask("f.2"))
    await asyncio.sleep(0)
    pc.fetched("f.2" + SUFFIX, 0, "holder decode-a left the cluster")
    assert sent[-1][1].num_blocks == 0 and "left the cluster" in (sent[-1][1].error or "")
    pc.release("f.2")
    pc.handle(b"router", ask("g.2"))
    await asyncio.sleep(0)
    pc.release("g.2")   # the request ended (or the node stops) before the copy did
    assert sent[-1][1].rid == "g.2" and sent[-1][1].num_blocks == 0 and not engine.held and not pc.holds
