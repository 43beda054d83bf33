"""CollectiveCounter in one process: the wire-byte formulas, patching, and a world of one."""

import pytest
import torch
import torch.distributed as dist

from lightning_5d.collectives import APIS, CollectiveCounter, patched_functions, tensor_nbytes, totals, wire_bytes
from lightning_5d.estimate import Collective, ring_bytes


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_formulas_match_the_planner(n):
    b = 1200
    pairs = [("all_reduce", Collective.ALL_REDUCE), ("reduce_scatter", Collective.REDUCE_SCATTER),
             ("all_gather", Collective.ALL_GATHER), ("all_to_all", Collective.ALL_TO_ALL)]  # fmt: skip
    for op, collective in pairs:
        assert wire_bytes(op, b, n) == pytest.approx(ring_bytes(collective, b, n))
    assert wire_bytes("send", b, n) == b
    assert wire_bytes("recv", b, n) == 0
    assert wire_bytes("broadcast", b, n) == pytest.approx((n - 1) / n * b)


def test_uneven_all_to_all_sends_all_but_its_own_chunk():
    assert wire_bytes("all_to_all", 100, 4, own_bytes=40) == 60


def test_a_group_of_one_sends_nothing():
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"):
        assert wire_bytes(op, 100, 1) == 0


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown collective kind"):
        wire_bytes("gossip", 1, 2)


def test_tensor_nbytes_counts_lists_and_dtypes():
    assert tensor_nbytes(torch.zeros(3, 4)) == 48
    assert tensor_nbytes(torch.zeros(8, dtype=torch.bfloat16)) == 16
    assert tensor_nbytes([torch.zeros(2), torch.zeros(3, dtype=torch.float64)]) == 8 + 24


def test_every_patched_name_is_a_public_torch_distributed_function():
    for name in patched_functions():
        assert callable(getattr(dist, name)), name
    assert set(APIS) <= set(patched_functions())


def test_patching_is_undone_and_nested_counters_share_it():
    originals = {name: getattr(dist, name) for name in patched_functions()}
    outer, inner = CollectiveCounter(), CollectiveCounter()
    with outer:
        assert dist.all_reduce is not originals["all_reduce"]
        assert dist.isend == originals["isend"]  # P2POp's check `op in [isend, irecv]` still holds
        with inner:
            pass
        assert dist.all_reduce is not originals["all_reduce"]  # still patched for the outer one
    assert {name: getattr(dist, name) for name in patched_functions()} == originals
    outer.stop()  # stopping twice is harmless
    assert dist.all_reduce is originals["all_reduce"]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # all_gather_into_tensor is deprecated, still public
def test_counts_calls_in_a_world_of_one(world_of_one):
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(4))
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))  # built on all_gather_single: one call
        dist.broadcast(torch.ones(2), src=0)
    dist.all_reduce(torch.ones(4))  # after stop: not counted
    assert [(c.api, c.op, c.group_size, c.tensor_bytes, c.wire_bytes) for c in counter.calls] == [
        ("all_reduce", "all_reduce", 1, 16, 0.0),
        ("all_gather_into_tensor", "all_gather", 1, 16, 0.0),
        ("broadcast", "broadcast", 1, 8, 0.0),
    ]
    by_op = counter.by_op()
    assert by_op["all_reduce"].calls == 1 and by_op["all_gather"].tensor_bytes == 16
    assert counter.by_op(group_size=2) == {}
    assert totals(counter.calls) == by_op
    counter.reset()
    assert counter.calls == [] and counter.wire_bytes() == 0
