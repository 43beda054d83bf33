"""Run each counted collective once on a few ranks and check what CollectiveCounter recorded.

Started by tests/distributed/test_collectives.py under torch.distributed.run. Every
expected number below is written out by hand from the tensor shapes (fp32 = 4 bytes), so
a wrong formula or a missed call fails exactly. Rank 0 writes "OK" to --out at the end.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_5d.collectives import CollectiveCounter

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
assert n == 3, "the expected numbers below are for 3 ranks"
pair = dist.new_group([0, 1])  # a sub-group: group sizes must come from the group, not the world


def check(counter, api, op, group_size, tensor_bytes, wire):
    call = counter.calls[-1]
    got = (call.api, call.op, call.group_size, call.tensor_bytes, call.wire_bytes)
    assert got == (api, op, group_size, tensor_bytes, wire), (rank, got, (api, op, group_size, tensor_bytes, wire))


original = dist.all_reduce
with CollectiveCounter() as counter:
    x = torch.ones(30)  # 120 bytes
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((30,), 3.0))  # the wrapped call still does its job
    check(counter, "all_reduce", "all_reduce", 3, 120, 2 * 2 / 3 * 120)

    dist.all_reduce(x, group=dist.group.WORLD, async_op=True).wait()
    check(counter, "all_reduce", "all_reduce", 3, 120, 160.0)

    out = torch.empty(10)
    dist.reduce_scatter_single(out, torch.ones(30))
    check(counter, "reduce_scatter_single", "reduce_scatter", 3, 120, 80.0)
    dist.reduce_scatter_tensor(out, torch.ones(30))  # built on reduce_scatter_single: counted once
    check(counter, "reduce_scatter_tensor", "reduce_scatter", 3, 120, 80.0)

    full = torch.empty(30)
    dist.all_gather_single(full, torch.ones(10))
    check(counter, "all_gather_single", "all_gather", 3, 120, 80.0)
    dist.all_gather_into_tensor(full, torch.ones(10))
    check(counter, "all_gather_into_tensor", "all_gather", 3, 120, 80.0)
    parts = [torch.empty(10) for _ in range(3)]
    dist.all_gather(parts, torch.ones(10))
    check(counter, "all_gather", "all_gather", 3, 120, 80.0)

    dist.broadcast(torch.ones(6), src=0)  # 24 bytes
    check(counter, "broadcast", "broadcast", 3, 24, 16.0)

    # Uneven all-to-all: rank r sends r+1 rows of 2 floats to each peer and keeps its own.
    splits = [rank + 1] * 3
    a2a_in = torch.ones(sum(splits), 2)
    a2a_out = torch.empty(sum(r + 1 for r in range(3)), 2)
    dist.all_to_all_single(a2a_out, a2a_in, output_split_sizes=[r + 1 for r in range(3)], input_split_sizes=splits)
    own = (rank + 1) * 2 * 4
    check(counter, "all_to_all_single", "all_to_all", 3, a2a_in.numel() * 4, float(a2a_in.numel() * 4 - own))
    dist.all_to_all_single(torch.empty(6), torch.ones(6))  # even: (N-1)/N of 24 bytes
    check(counter, "all_to_all_single", "all_to_all", 3, 24, 16.0)

    if rank < 2:
        dist.all_reduce(torch.ones(5), group=pair)  # 20 bytes over 2 ranks
        check(counter, "all_reduce", "all_reduce", 2, 20, 20.0)
        peer = 1 - rank
        buf = torch.ones(7)  # 28 bytes
        if rank == 0:
            dist.send(buf, dst=peer)
            check(counter, "send", "send", 3, 28, 28.0)
            dist.isend(buf, dst=peer).wait()
            check(counter, "isend", "send", 3, 28, 28.0)
        else:
            dist.recv(buf, src=peer)
            check(counter, "recv", "recv", 3, 28, 0.0)
            dist.irecv(buf, src=peer).wait()
            check(counter, "irecv", "recv", 3, 28, 0.0)
        # batch_isend_irecv: one send and one receive each; torch checks `op is isend` itself.
        ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, torch.empty(3), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert [(c.api, c.wire_bytes) for c in counter.calls[-2:]] == [("isend", 12.0), ("irecv", 0.0)]

    per_op = counter.by_op()
    expected_calls = {"all_reduce": 2, "reduce_scatter": 2, "all_gather": 3, "broadcast": 1, "all_to_all": 2}
    if rank < 2:
        expected_calls["all_reduce"] += 1
        expected_calls["send" if rank == 0 else "recv"] = 2
        expected_calls["send"] = expected_calls.get("send", 0) + 1
        expected_calls["recv"] = expected_calls.get("recv", 0) + 1
    assert {op: t.calls for op, t in per_op.items()} == expected_calls, (rank, per_op)
    assert counter.wire_bytes() == sum(c.wire_bytes for c in counter.calls)

# Outside the counter the real functions are back and nothing more is recorded.
assert dist.all_reduce is original
before = len(counter.calls)
dist.all_reduce(torch.ones(1))
assert len(counter.calls) == before

dist.barrier()
if rank == 0:
    Path(args.out, "result.txt").write_text("OK")
dist.destroy_process_group()
