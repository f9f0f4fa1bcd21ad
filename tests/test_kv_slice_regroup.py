"""KV between pools sliced per tensor-parallel rank over different numbers of ranks, and between a slice and a whole
(one-pool) engine (issue #34 item 3, pools of kv_transfer/per_rank/): the pair-level transfer.

Each (sender pool, receiver pool) pair moves the heads the two have in common, and only those: the sender's slice
holds the heads of its rank of the sending engine, the receiver's the heads of its rank of the receiving one, and
regroup.py maps them between the engines (`KVLayout.engine_layout`) keeping the pair's own ranks. Over tcp the
wire carries only the pair's heads (row by row when the receiver takes some of a sender rank's heads), over shm the
sender writes the receiver's slots; the checksum of each pair covers just the slots it fills, so a receiver slice
filled by two sender slices (prefill TP 2 -> decode TP 1) verifies each part on its own. After every pair moved,
each receiving pool holds exactly what a whole pool of its engine would, and a pair with no heads in common is
refused at the handshake naming both slices. A model with fewer KV heads (2) than a side's slices (4): each
receiving pool reserves for, and takes each head once from, one sending slice holding it (a copy beside it stays
home), into every slot holding a copy, over every channel that regroups (tcp, shm, tcp+int8, gloo, cuda_ipc's host
path), byte-exact with the writers' checksums adding up to what landed.

Then driven by rank 0 (per_rank/sender.py plans one part per receiving pool, from the one sending rank holding its
heads): a one-rank engine into two slices, TP 2 into TP 4 slices (rank 1 from its own process, layer by layer),
one combined checksum on both sides (TP 2 into one pool, two writers for one reservation:
tests/test_kv_multi_writer.py); and a cluster of a TP 2 prefill node feeding a TP 4 decode node, both sliced,
token-exact with TP 1.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kv_pool_helpers import assert_landed, close_all, model_kv, split

from pdcluster.kv_transfer import KVLayout, KVReceiver, KVSender, LayoutMismatchError, SharedKVPool, TransferError
from pdcluster.kv_transfer.regroup import Regroup

pytestmark = pytest.mark.timeout(300)

SRC, DST = [0, 1, 5, 6], [7, 8, 2, 3]
# (model KV heads, sender ranks, receiver ranks, sender sliced, receiver sliced)
PAIRINGS = [
    (4, 2, 1, True, False),   # device TP 2 prefill -> TP 1 decode (one whole pool)
    (4, 2, 1, True, True),    # ... into a pool sliced over one rank
    (4, 1, 2, False, True),   # TP 1 prefill -> device TP 2 decode
    (4, 2, 4, True, True),
    (4, 4, 2, True, True),
    (2, 1, 4, True, True),    # fewer KV heads than receiver ranks: each receiver slice holds a copy of one
    (2, 4, 1, True, False),   # ... than sender ranks: the copies stay home
]


def _pools(kv: torch.Tensor, tp: int, sliced: bool) -> list[torch.Tensor]:
    whole = split(kv, tp)
    return [whole[:, 2 * r:2 * r + 2].contiguous() for r in range(tp)] if sliced else [whole]


def _layouts(pools: list[torch.Tensor], total: int, tp: int, sliced: bool) -> list[KVLayout]:
    if not sliced:
        return [KVLayout.of(pools[0], total)]
    return [KVLayout.of(p).sliced(r, tp, total) for r, p in enumerate(pools)]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("total, src_tp, dst_tp, src_sliced, dst_sliced", PAIRINGS)
def test_every_pair_moves_its_common_heads_and_the_receiving_pools_hold_the_whole_kv(
        backend, total, src_tp, dst_tp, src_sliced, dst_sliced):
    dtype = torch.float32
    kv = model_kv(total * 7 + src_tp, total, dtype)
    src_pools = _pools(kv, src_tp, src_sliced)
    src_layouts = _layouts(src_pools, total, src_tp, src_sliced)
    expected = _pools(kv, dst_tp, dst_sliced)
    shms = [SharedKVPool.create(tuple(e.shape), dtype) for e in expected]
    dst_layouts = _layouts([s.tensor for s in shms], total, dst_tp, dst_sliced)
    receivers, senders = [], []
    try:
        for d, shm in enumerate(shms):
            receivers.append(KVReceiver(shm.tensor, shm_name=shm.name, total_kv_heads=None if dst_sliced else total,
                                        rank_slice=(d, dst_tp, total) if dst_sliced else None))
        for p, pool in enumerate(src_pools):
            senders.append(KVSender(pool, backend=backend, total_kv_heads=None if src_sliced else total,
                                    rank_slice=(p, src_tp, total) if src_sliced else None))
        wire, layers = 0, kv.shape[0]
        for d, rx in enumerate(receivers):
            parts = 0
            for p, tx in enumerate(senders):
                try:
                    pair = Regroup(src_layouts[p], dst_layouts[d])
                except LayoutMismatchError as exc:   # no heads in common: the handshake refuses it too
                    assert "no KV heads in common" in str(exc)
                    with pytest.raises(LayoutMismatchError, match="rank_slice: .*no KV heads in common"):
                        tx.send(rx.reserve(f"none-{p}-{d}", DST, timeout_s=20), SRC, timeout=10)
                    asyncio.run(rx.settle(f"none-{p}-{d}", 10))
                    continue
                parts += 1
                rid = f"r-{p}-{d}"   # one sender per reservation: a receiver filled by two takes two in turn
                checksum = tx.send(rx.reserve(rid, DST, timeout_s=20), SRC, timeout=10)
                res = asyncio.run(rx.wait(rid, 10))
                assert res.ok and res.checksum == checksum
                wire += res.nbytes
                assert res.nbytes == len(SRC) * layers * pair.wire_layer_bytes
            assert parts >= 1
        assert_landed([shm.tensor for shm in shms], expected, SRC, DST)
        if backend == "tcp" and total >= max(src_tp, dst_tp):
            # the wire carried every head the receivers hold once, no head a pair does not share
            row = kv.shape[-1] * kv.element_size()
            assert wire == len(SRC) * layers * 2 * kv.shape[3] * total * row
        assert all(rx.num_active_reservations == 0 for rx in receivers)
    finally:
        close_all(senders, receivers, shms)


def test_a_sender_slice_writing_part_of_a_receiver_pool_checks_only_its_slots():
    """Prefill TP 2 -> one whole pool: each sender slice's pair fills half the receiver's heads; its checksum sums
    those slots only (whatever the other half holds), and over tcp its wire carries its own heads only."""
    lay = KVLayout.of(torch.zeros(2, 2, 4, 4, 2, 8))
    whole = KVLayout.of(torch.zeros(2, 2, 4, 4, 4, 8))
    for p in (0, 1):
        pair = Regroup(lay.sliced(p, 2), whole)
        assert [(x.dst_rank, x.dst_head, x.src_rank, x.src_head, x.n) for x in pair.pieces] == [(0, 2 * p, 0, 0, 2)]
        assert not pair.fills and pair.wire_layer_bytes == lay.layer_bytes
    one_to_two = Regroup(whole, lay.sliced(1, 2))   # the whole pool sends rank 1's heads only, row by row
    assert [(x.dst_head, x.src_head, x.n) for x in one_to_two.pieces] == [(0, 2, 2)]
    assert not one_to_two.tiles[0] and one_to_two.fills and one_to_two.wire_layer_bytes == lay.layer_bytes
    assert Regroup(lay.sliced(1, 2), lay.sliced(1, 2, 4)) is not None   # the default model heads: 2 x 2
    with pytest.raises(LayoutMismatchError, match="rank_slice: receiver 0 of 2 vs sender 1 of 2"):
        Regroup(lay.sliced(1, 2), lay.sliced(0, 2))
    with pytest.raises(LayoutMismatchError, match="no KV heads in common"):
        lay.sliced(0, 2).check_compatible(lay.sliced(1, 2))
    with pytest.raises(LayoutMismatchError, match="total_kv_heads: sender 4 vs receiver 8"):
        lay.sliced(0, 4).check_compatible(lay.sliced(0, 2))


def test_latent_slices_are_copies_of_the_whole_latent_and_move_rank_to_rank():
    """An MLA pool under TP on a device: each rank's slice holds every latent row; slices pair plane for plane."""
    from pdcluster.kv_transfer.regroup import regroup_for, writers
    from pdcluster.kv_transfer.tcp_channel import TcpChannel

    latent = KVLayout.of(torch.zeros(2, 1, 4, 4, 1, 40))
    a, b = latent.sliced(1, 2), latent.sliced(1, 2)
    a.check_compatible(b)
    assert a.same_planes(latent.sliced(0, 2)) and regroup_for(TcpChannel, a, b) is None
    assert writers([latent.sliced(0, 2), a], [latent.sliced(0, 2), b]) == [[0], [1]]
    assert writers([latent.sliced(r, 2) for r in (0, 1)], [latent.sliced(r, 4) for r in range(4)]) == \
        [[0], [0], [1], [1]]


# ---- a model of 2 KV heads: slices holding copies of a head beside an engine sliced otherwise ------------------

# (sender ranks, receiver ranks, sender sliced, receiver sliced) of a 2-KV-head model: a side of 4 ranks holds each
# head twice
COPIES = [
    (4, 2, True, True),    # a device's TP 4 prefill -> TP 2 decode: ranks 1 and 3 hold copies ranks 0 and 2 send
    (2, 4, True, True),    # TP 2 -> TP 4: each sending rank fills the two receiving slices holding its head
    (4, 1, True, False),   # TP 4 sliced -> one whole pool: two writers
    (1, 4, False, True),   # one whole pool -> TP 4 slices
    (4, 2, True, False),   # TP 4 sliced -> a CPU TP 2 engine's one pool
    (2, 4, False, True),   # a CPU TP 2 engine's one pool -> TP 4 slices
    (4, 4, True, False),   # TP 4 sliced -> a CPU TP 4 engine's one pool (holding each head twice too)
]
CHANNELS = ["tcp", "shm", "tcp+int8", "gloo", "cuda_ipc"]   # cuda_ipc over host memory (its CPU path)


def _int8_exact(kv: torch.Tensor) -> torch.Tensor:
    """Model KV that the int8 wire compression (one scale per plane, block and head: quant.py) carries exactly:
    multiples of 1/16 whose largest in each (plane, block, head) is 127/16."""
    k = (kv * 40).round().clamp(-126, 126)
    k[:, :, :, 0, :, 0] = 127
    return k / 16


def test_each_receiving_pool_takes_each_head_once_from_one_sending_slice():
    """The plan of who writes what (regroup.writers, as RankedSender plans and writer_count reserves): a sending slice
    holding a copy of a head another slice sends into that pool sends nothing there; a receiving slice holding a copy
    takes it from a sending slice holding it (rank r from rank r between engines sliced alike)."""
    from pdcluster.kv_transfer.regroup import writer_count, writers

    one = torch.zeros(2, 2, 4, 4, 1, 8)   # a slice holding one head
    tp4, tp2 = [KVLayout.of(one).sliced(r, 4, 2) for r in range(4)], [KVLayout.of(one).sliced(r, 2) for r in range(2)]
    whole1, whole2 = KVLayout.of(torch.zeros(2, 2, 4, 4, 2, 8)), KVLayout.of(torch.zeros(2, 4, 4, 4, 1, 8))
    whole4 = KVLayout.of(torch.zeros(2, 8, 4, 4, 1, 8), 2)
    assert writers(tp4, tp2) == [[0], [2]]
    assert writers(tp2, tp4) == [[0], [0], [1], [1]]
    assert writers(tp4, [whole1]) == writers(tp4, [whole2]) == writers(tp4, [whole4]) == [[0, 2]]
    assert writers(tp4, tp4) == [[0], [1], [2], [3]]
    assert writers([whole1], tp4) == writers([whole4], tp4) == [[0]] * 4
    assert [writer_count(d, 4) for d in (*tp2, whole1, whole2, whole4)] == [1, 1, 2, 2, 2]
    assert [writer_count(d, 2) for d in tp4] == [1] * 4
    into_whole4 = Regroup(tp4[2], whole4)   # head 1 into both its slots, once on the wire
    assert [(p.dst_rank, p.src_head, p.copy_of is not None) for p in into_whole4.pieces] == [(2, 0, False),
                                                                                             (3, 0, True)]
    assert into_whole4.wire_layer_bytes == tp4[2].layer_bytes and not into_whole4.fills
    with pytest.raises(LayoutMismatchError, match="no KV heads in common"):
        Regroup(tp4[1], tp2[0])   # rank 1's copy of head 0: rank 0 sends it


@pytest.mark.parametrize("backend", CHANNELS)
@pytest.mark.parametrize("src_tp, dst_tp, src_sliced, dst_sliced", COPIES)
def test_slices_holding_copies_of_a_head_move_into_pools_sliced_otherwise(monkeypatch, backend, src_tp, dst_tp,
                                                                          src_sliced, dst_sliced):
    """Every receiving pool reserves once for the writers the sending engine has there (writer_count) and every
    sending pool holding heads for it writes into that reservation, layer by layer: the pools then hold exactly the
    source's heads (each copy filled), each writer's checksum is acknowledged, and they add up to what landed; over
    tcp each head a receiving pool holds crossed the wire once for it."""
    from pdcluster.kv_transfer import cuda_ipc_channel as ipc
    from pdcluster.kv_transfer.checksum import MASK64
    from pdcluster.kv_transfer.regroup import writer_count, writers

    total, dtype = 2, torch.float32
    if backend == "cuda_ipc":
        monkeypatch.setenv(ipc.CPU_PATH_ENV, "1")   # never picked by auto
    kv = _int8_exact(model_kv(src_tp * 5 + dst_tp, total, dtype))
    src_pools = _pools(kv, src_tp, src_sliced)
    if backend == "cuda_ipc":
        src_pools = [ipc.share_cpu_pool(p) for p in src_pools]
    src_layouts = _layouts(src_pools, total, src_tp, src_sliced)
    expected = _pools(kv, dst_tp, dst_sliced)
    shms = [SharedKVPool.create(tuple(e.shape), dtype) for e in expected]
    dst_layouts = _layouts([s.tensor for s in shms], total, dst_tp, dst_sliced)
    sender_slices = src_tp if src_sliced else 0
    receivers, senders = [], []
    try:
        for d, shm in enumerate(shms):
            receivers.append(KVReceiver(shm.tensor, shm_name=shm.name, total_kv_heads=None if dst_sliced else total,
                                        rank_slice=(d, dst_tp, total) if dst_sliced else None))
        for p, pool in enumerate(src_pools):
            senders.append(KVSender(pool, backend=backend.split("+")[0], quant="int8" if "+" in backend else None,
                                    total_kv_heads=None if src_sliced else total,
                                    rank_slice=(p, src_tp, total) if src_sliced else None))
        layers, wire = kv.shape[0], 0
        for d, (rx, plan) in enumerate(zip(receivers, writers(src_layouts, dst_layouts), strict=True)):
            assert plan and len(plan) == writer_count(dst_layouts[d], sender_slices)
            rid = f"copies-{d}"
            dst = rx.reserve(rid, DST, timeout_s=30, sender_slices=sender_slices)
            transfers = [senders[p].start(dst, SRC) for p in plan]
            for layer in range(layers):
                for t in transfers:
                    t.send_layers(layer, layer + 1)
            with ThreadPoolExecutor(len(transfers)) as finishing:   # each writer announces its done; acked together
                acked = list(finishing.map(lambda t: t.finish(30), transfers))   # each raises unless ack = its sum
            res = asyncio.run(rx.wait(rid, 30))
            assert res.ok and res.checksum == sum(acked) & MASK64
            assert res.nbytes == sum(t.sent_bytes for t in transfers)
            if backend == "tcp":
                assert res.nbytes == len(SRC) * layers * sum(Regroup(src_layouts[p], dst_layouts[d]).wire_layer_bytes
                                                             for p in plan)
            wire += res.nbytes
        assert_landed([shm.tensor for shm in shms], expected, SRC, DST)
        if backend == "tcp":   # every head a receiving pool holds, once for that pool
            row = kv.shape[-1] * kv.element_size()
            assert wire == len(SRC) * layers * 2 * kv.shape[3] * row * sum(len(d.held_heads()) for d in dst_layouts)
        assert all(rx.num_active_reservations == 0 for rx in receivers)
    finally:
        close_all(senders, receivers, shms)


# ---- driven by rank 0: RankedSender into RankedReceiver (ranks >= 1 in processes of their own) ----------------

L, NB, BS, HD = 3, 10, 4, 8   # layers, blocks, block size, head dim of the engines below (4 model KV heads)
SEEDS = (21, 22)   # the sending engine's two rank slices (2 heads each); a one-rank engine holds both, joined


def _slice_shape(heads: int) -> tuple[int, ...]:
    return (L, 2, NB, BS, heads, HD)


class _Receiving:
    """A receiving engine of `n` ranks sliced per rank (4 model heads): rank 0's slice here, the others' in
    processes."""

    def __init__(self, stack, n: int, shm: bool) -> None:
        from rank_kv_helpers import RankProcess, slice_kv

        from pdcluster.kv_transfer.per_rank import RankedReceiver, RankEndpointSpec, RankLinks

        shape = _slice_shape(4 // n)
        self.procs = [RankProcess(RankEndpointSpec(receive=True, shared_memory=shm), shape, torch.float32, None,
                                  rank=r, size=n) for r in range(1, n)]
        for proc in self.procs:
            stack.callback(proc.close)
        seg = SharedKVPool.create(shape, torch.float32) if shm else None
        if seg is not None:
            stack.callback(seg.close)
        self.rx0 = seg.tensor if seg is not None else slice_kv(shape, torch.float32, None)
        links = RankLinks([p.info["link"] for p in self.procs])
        stack.callback(links.close)
        local = KVReceiver(self.rx0, shm_name=seg.name if seg is not None else None, rank_slice=(0, n))
        stack.callback(local.close)
        self.receiver = RankedReceiver(local, links, [p.info["kv_addr"] for p in self.procs])

    def pools(self) -> list[torch.Tensor]:
        return [self.rx0, *(p.pool() for p in self.procs)]


def _model_kv() -> torch.Tensor:
    from rank_kv_helpers import slice_kv

    return torch.cat([slice_kv(_slice_shape(2), torch.float32, seed) for seed in SEEDS], dim=4)


def _receiving_pools_hold(rx: _Receiving, n: int) -> bool:
    kv, per = _model_kv(), 4 // n
    return all(torch.equal(pool[:, :, DST], kv[:, :, SRC, :, d * per:(d + 1) * per])
               for d, pool in enumerate(rx.pools()))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_one_rank_engine_pushes_into_an_engine_sliced_over_two_ranks(backend):
    """TP 1 prefill -> TP 2 decode sliced per rank: rank 0's sender (no links) writes each receiving slice its
    heads; the decode side completes with the combined checksum the sender computed."""
    from contextlib import ExitStack

    from pdcluster.kv_transfer.per_rank import RankedSender, RankLinks

    with ExitStack() as stack:
        rx = _Receiving(stack, 2, shm=backend == "shm")
        whole = KVSender(_model_kv().contiguous(), backend="auto" if backend == "shm" else "tcp")
        stack.callback(whole.close)
        sender = RankedSender(whole, RankLinks([]), lambda rank, message: None)
        dst = rx.receiver.reserve("w", DST, timeout_s=20)
        sender.connect(dst.to_dict())
        t = sender.start(dst.to_dict(), SRC, connect=False)
        for layer in range(L):
            t.send_layers(layer, layer + 1)
        checksum = t.finish(timeout=20)
        result = asyncio.run(rx.receiver.wait("w", 10))
        assert result.ok and result.checksum == checksum and t.backend == backend
        assert result.nbytes == sender.bytes_sent == len(SRC) * L * 2 * BS * 4 * HD * 4   # every head once
        assert _receiving_pools_hold(rx, 2)
        assert rx.receiver.num_active_reservations == 0


def test_an_engine_sliced_over_two_ranks_pushes_into_one_sliced_over_four():
    """TP 2 -> TP 4, both sliced: each sending rank writes the two receiving slices whose heads it holds (rank 1
    from its own process during its step), one combined checksum on both sides; then sending rank 1 dies
    mid-transfer: both sides fail at once and nothing stays reserved."""
    from contextlib import ExitStack

    from rank_kv_helpers import RankProcess, slice_kv

    from pdcluster.kv_transfer.per_rank import RankedSender, RankEndpointSpec, RankLinks

    with ExitStack() as stack:
        rx = _Receiving(stack, 4, shm=False)
        tx1 = RankProcess(RankEndpointSpec(receive=False, backend="tcp"), _slice_shape(2), torch.float32, SEEDS[1])
        stack.callback(tx1.close)
        links = RankLinks([tx1.info["link"]])
        stack.callback(links.close)
        local = KVSender(slice_kv(_slice_shape(2), torch.float32, SEEDS[0]), backend="tcp", rank_slice=(0, 2))
        stack.callback(local.close)
        sender = RankedSender(local, links, lambda rank, message: tx1.tell(message))
        dst = rx.receiver.reserve("q", DST, timeout_s=20)
        sender.connect(dst.to_dict())
        t = sender.start(dst.to_dict(), SRC, connect=False)
        for layer in range(L):
            t.send_layers(layer, layer + 1)
        assert tx1.step()
        checksum = t.finish(timeout=20)
        result = asyncio.run(rx.receiver.wait("q", 10))
        assert result.ok and result.checksum == checksum
        assert result.nbytes == sender.bytes_sent == len(SRC) * L * 2 * BS * 4 * HD * 4
        assert _receiving_pools_hold(rx, 4)
        assert rx.receiver.num_active_reservations == 0

        # sending rank 1 dies mid-transfer: both sides fail at once (its two receiving slices' parts and rank 0's),
        # the decode side settles, nothing stays reserved on any receiving rank
        dst = rx.receiver.reserve("dead", DST, timeout_s=30)
        sender.connect(dst)
        t = sender.start(dst, SRC, connect=False)
        tx1.kill()
        began = time.monotonic()
        for layer in range(L):
            t.send_layers(layer, layer + 1)
        with pytest.raises(TransferError) as failed:
            t.finish(timeout=20)
        assert failed.value.code in ("lost", "aborted", "cancelled")
        with pytest.raises(TransferError) as landed:
            asyncio.run(rx.receiver.wait("dead", 10))
        assert landed.value.code in ("lost", "aborted", "cancelled")
        assert time.monotonic() - began < 10, "waited for a dead rank"
        assert asyncio.run(rx.receiver.settle("dead", 10))
        assert rx.receiver.num_active_reservations == 0


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tp2_prefill_node_feeds_a_tp4_decode_node_both_sliced_per_rank(tmp_path):
    """CPU ranks sliced per rank (kv_pool_per_rank): prefill TP 2 -> decode TP 4, each prefill rank writing the two
    decode slices of its heads; greedy output is the offline TP 1 engine's, every prompt prefilled remotely, no
    transfer failure, nothing left reserved or in use."""
    import uuid

    from cluster_helpers import total
    from engine_helpers import make_prompts
    from rank_kv_helpers import serve_every_prompt_remotely
    from transformers import AutoTokenizer

    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.control.sampling_params import SamplingParams
    from pdcluster.engine import LLM
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny-gqa"), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    prompts = make_prompts([12, 40, 77], seed=7)
    n = 10
    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    want = [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) for ids in want]
    node = {"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu", "dtype": "float32",
            "tensor_parallel_size": 2, "kv_pool_per_rank": True}
    (tmp_path / "cluster").mkdir()
    with LocalCluster(model=model, work_dir=tmp_path / "cluster", num_prefill=1, num_decode=0, port=0,
                      cluster=f"slice-regroup-{uuid.uuid4().hex[:6]}", lease_ttl=2, threads_per_node=1,
                      node_config=node, router_config={"disagg_min_tokens": 0}) as cluster:
        cluster.start_node("decode", "decode-0", tensor_parallel_size=4)
        cluster.wait_ready(1, 1, timeout=300, serving=True)

        async def slices() -> dict[str, int]:
            from pdcluster.control.etcd_client import close_quietly, connect
            from pdcluster.control.queries import list_nodes

            etcd = await connect([cluster.etcd])
            try:
                return {n.role: n.capacity.kv_rank_slices for n in await list_nodes(etcd, cluster.cluster)
                        if n.role != "router"}
            finally:
                await close_quietly(etcd)

        assert asyncio.run(slices()) == {"prefill": 2, "decode": 4}

        after = serve_every_prompt_remotely(cluster, prompts, n, texts)
        assert total(after, 'pdcluster_node_prefills_total{path="local"}') == 0


@pytest.mark.parametrize("field, value, named", [
    ("model_kv_heads", -1, "model_kv_heads"), ("model_kv_heads", "4", "model_kv_heads"),
    ("model_kv_heads", True, "model_kv_heads"), ("model_kv_heads", 3, "total_kv_heads 3"),
    ("rank_slice", 2, "rank_slice"), ("rank_slices", "2", "rank_slice")])
def test_a_peer_layout_with_bad_slice_fields_is_refused_naming_them(field, value, named):
    """The layout handshake is a peer's message: slice fields of the wrong type, out of range, or model heads that do
    not split over the slices (3 over 2 slices of 2 heads) are a ValueError naming the field, never a pool."""
    good = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32", num_blocks=8)
    sliced = good.sliced(0, 2).to_dict()
    KVLayout.from_dict(sliced)   # the untouched record parses
    with pytest.raises(ValueError, match=named):
        KVLayout.from_dict({**sliced, field: value})
