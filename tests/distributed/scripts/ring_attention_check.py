"""Ring / all-gather / all-to-all attention on the cp ranks vs full SDPA on the gathered sequence.

Usage: ring_attention_check.py OUT_JSON [--dtypes float32,bfloat16] [--seq GLOBAL_LEN]

Every rank builds the same global q, k, v, grad_out (fixed seed), takes its shard
(zig-zag or contiguous), runs ``ring_attention`` forward and backward, and compares out,
dq, dk, dv with the shard of the fp64 SDPA reference. Ring and all-gather also run with an
ALiBi bias (per-head slopes x token distances; ``bias`` in the record: its form), against
SDPA with the whole sequence's bias as a float mask (the causal mask folded in). Errors are norm-relative
(‖x − ref‖ / ‖ref‖). Rank 0 writes one record per combination, with every rank's work count.
"""

import argparse
import itertools
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_5d.config import SequenceSharding
from lightning_5d.parallel.context.hybrid import hybrid_attention
from lightning_5d.parallel.context.ring import contiguous_shard, ring_attention, zigzag_shard
from lightning_5d.parallel.context.ulysses import alltoall_attention
from lightning_5d.plan.linear_bias import DistanceForm, LinearBias

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--dtypes", default="float32")
parser.add_argument("--seq", type=int, default=None, help="global sequence length (default 8 per rank)")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(cp)))  # a group object, as the strategy will pass one

B, HQ, D = 2, 4, 16
S = args.seq or 8 * cp


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


# hybrid (cp >= 4): Ulysses over pairs of consecutive ranks x ring over the cp/2 pairs
ULYSSES = 2
hybrid_groups = None
if cp >= 4:
    uly, _ = dist.new_subgroups_by_enumeration([list(range(g, g + ULYSSES)) for g in range(0, cp, ULYSSES)])
    ring, _ = dist.new_subgroups_by_enumeration([list(range(u, cp, ULYSSES)) for u in range(ULYSSES)])
    hybrid_groups = (uly, ring)

records = []
MODES = ("ring", "allgather", "alltoall", "hybrid")
SLOPES = tuple(2 ** (-8 * (h + 1) / HQ) for h in range(HQ))  # Press et al.'s slopes for HQ heads


def dense_bias(bias):
    """The whole sequence's bias as SDPA's float mask, -inf above the diagonal when causal."""
    if bias is None:
        return None
    pos = torch.arange(S)
    mask = bias.scores(pos, pos).double()
    return mask.masked_fill(pos[None, :] > pos[:, None], float("-inf")) if bias.causal else mask


def check(dtype_name, mode, causal, zigzag, hkv, bias=None):
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, h, S, D, generator=gen).to(dtype) for h in (HQ, hkv, hkv))
    grad_out = torch.randn(B, HQ, S, D, generator=gen).to(dtype)

    # reference: fp64 SDPA over the whole sequence, from the same (rounded) inputs
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    mask = dense_bias(bias)
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=hkv != HQ)  # fmt: skip
    ref.backward(grad_out.double())
    refs = {"out": ref.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}

    shard = (lambda x: zigzag_shard(x, 2, rank, cp)) if zigzag else (lambda x: contiguous_shard(x, 2, rank, cp))
    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
    stats = {}
    if mode == "alltoall":
        out = alltoall_attention(ql, kl, vl, group, cp, causal=causal, zigzag=zigzag, scale=D**-0.5)
    elif mode == "hybrid":
        out = hybrid_attention(ql, kl, vl, hybrid_groups[0], ULYSSES, hybrid_groups[1], causal=causal,
                               sharding=SequenceSharding.ZIGZAG if zigzag else SequenceSharding.CONTIGUOUS,
                               scale=D**-0.5, stats=stats)  # fmt: skip
    else:
        out = ring_attention(ql, kl, vl, group, causal=causal, mode=mode, sharding="zigzag" if zigzag else "contiguous",
                             stats=stats, bias=bias)  # fmt: skip
    out.backward(shard(grad_out))
    assert out.dtype == dtype and ql.grad.dtype == dtype and kl.grad.dtype == dtype
    mine = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    # norm-relative errors of the gathered sequence: squared errors and norms summed over ranks
    sq = torch.tensor([[((mine[n].double() - shard(refs[n])).norm() ** 2).item(), (shard(refs[n]).norm() ** 2).item()]
                       for n in refs], dtype=torch.float64)  # fmt: skip
    dist.all_reduce(sq)
    errors = {n: (sq[i, 0] / sq[i, 1]).sqrt().item() for i, n in enumerate(refs)}
    units = [None] * cp
    dist.all_gather_object(units, stats)
    records.append({"dtype": dtype_name, "mode": mode, "causal": causal, "zigzag": zigzag, "hkv": hkv, "hq": HQ,
                    "cp": cp, "errors": errors, "units": units, "bias": bias and bias.form.value})  # fmt: skip


combos = itertools.product(args.dtypes.split(","), MODES, (False, True), (False, True), (HQ, HQ // 2))
for dtype_name, mode, causal, zigzag, hkv in combos:
    if mode == "alltoall" and (HQ % cp or hkv % cp):
        continue  # heads must divide over cp (the error is a unit test)
    if mode == "hybrid" and (hybrid_groups is None or hkv % ULYSSES):
        continue
    check(dtype_name, mode, causal, zigzag, hkv)
# ALiBi: causal m·(j − i), and the symmetric −m·|i − j| of an encoder (no mask)
forms = ((DistanceForm.KEY_MINUS_QUERY, True), (DistanceForm.NEGATIVE_ABSOLUTE, False))
for dtype_name, mode, (form, causal), zigzag in itertools.product(args.dtypes.split(","), ("ring", "allgather"),
                                                                  forms, (False, True)):  # fmt: skip
    check(dtype_name, mode, causal, zigzag, HQ // 2, LinearBias(SLOPES, form, causal))

if rank == 0:
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    worst = {}
    for r in records:
        for n, e in r["errors"].items():
            key = (r["dtype"], n)
            worst[key] = max(worst.get(key, 0.0), e)
    for (dt, n), e in sorted(worst.items()):
        print(f"cp={cp} {dt} {n}: worst norm-relative error {e:.2e}")
dist.destroy_process_group()
