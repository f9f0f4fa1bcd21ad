"""Live migration between decode nodes of different tensor_parallel_size (issue #34): a stream decoding on a node
whose pool is sliced over 2 ranks (`kv_pool_per_rank` on CPU, as a device's are) moves to a node holding its KV in
one pool (tensor_parallel_size 1), and back the other way, with node processes (real etcd, a router, the official
openai client). The target fetches the stream's history from the source with the heads regrouped on the way (two
writers, one per sending rank, into its one pool; or the one pool's writer into each of its slices), so the drain
recomputes nothing and the stream's tokens equal the offline engine's."""

from __future__ import annotations

import pytest
from migration_helpers import decode_cluster
from migration_sliced_helpers import SLICED, drain_moves_the_stream_with_its_kv, sliced_model

WHOLE = {"tensor_parallel_size": 1, "kv_pool_per_rank": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sliced_model(tmp_path_factory.mktemp("hetero-migrate"))


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("source, target", [(SLICED, WHOLE), (WHOLE, SLICED)], ids=["tp2-sliced-to-tp1",
                                                                                  "tp1-to-tp2-sliced"])
async def test_drain_migrate_between_decode_nodes_of_different_tp_recomputes_nothing(model, tmp_path, source,
                                                                                       target):
    with decode_cluster(model, tmp_path, num_decode=1, node=source) as cluster:
        cluster.start_node("decode", "decode-1", **target)
        cluster.wait_ready(0, 2, timeout=240, nodes={"decode-0", "decode-1"})
        await drain_moves_the_stream_with_its_kv(cluster, model, seed=4)
