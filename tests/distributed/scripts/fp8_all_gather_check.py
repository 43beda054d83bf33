"""FP8 all-gather of FSDP2 parameters on 2 gloo ranks, against references written out here.

Usage: fp8_all_gather_check.py --out DIR

Cases (every rank runs all of them; mismatches are collected and raised at the end on
every rank; on success rank 0 writes DIR/result.json with what was measured):

- exact: a model of linears (37 and 23 rows: uneven shards over 2 ranks) whose linears
  quantize-dequantize their weight tensorwise in forward (straight-through backward),
  trained 5 AdamW steps with and without FP8 all-gather. Every forward sees exactly
  dequant(quant(full fp32 weight)); the all-gathers move 1 byte per weight element
  (bytes per call written out by hand from the shapes); the two runs agree to 1e-6.
- sgd: the same with SGD + momentum for 3 steps.
- hsdp: 2 replicas x 1 shard (FSDP2's world-size-1 path): exact weights, the replicas agree.
- bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the gathered weight is
  still fp32 and still exactly dequant(quant(full fp32 weight)); and what FSDP2 does when
  one unit mixes an fp8-gathered weight with a bf16 bias.
- state: state_dict / full_tensor / get_model_state_dict are plain tensors; a DCP
  checkpoint round-trips into a fresh FP8-all-gather model and into a plain one.
"""

import argparse
import json
import math
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_5d.collectives import CollectiveCounter
from lightning_5d.fp8.fsdp_all_gather import Fp8AllGatherWeight, enable_fp8_all_gather, fp8_all_gather_names
from lightning_5d.testing import leave_process_group

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2, "the byte counts below are written out for 2 ranks"
mesh = init_device_mesh("cpu", (world,))
failures: list[str] = []
report: dict = {}


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(f"rank {rank}: {what}")


def quant_dequant(w: torch.Tensor) -> torch.Tensor:
    """Tensorwise E4M3 with scale = 448 / amax, saturating; back to fp32 as q / scale."""
    w = w.float()
    scale = torch.tensor(448.0) / w.abs().max().clamp(min=1e-12)
    q = (w * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.float() / scale


class _QuantDequant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return quant_dequant(w)

    @staticmethod
    def backward(ctx, grad):
        return grad  # straight-through, as FP8 training does for the weight


class FakeFp8Linear(nn.Linear):
    """The consumer: quantizes its weight tensorwise in forward, like an FP8 linear."""

    def forward(self, x):
        self.seen = self.weight.detach().clone()  # the unsharded weight FSDP gave this forward
        return F.linear(x, _QuantDequant.apply(self.weight).to(x.dtype), self.bias)


LINEARS = ["0", "2", "3"]


def make_model(bias_last: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(FakeFp8Linear(16, 37), nn.Tanh(), FakeFp8Linear(37, 23), FakeFp8Linear(23, 7, bias=bias_last))
    with torch.no_grad():
        model[0].weight.mul_(3.0)  # different amaxes per layer
    return model


def shard(model: nn.Module, names=LINEARS, mp_policy=None, on=None) -> nn.Module:
    policy, on = mp_policy or MixedPrecisionPolicy(), on or mesh
    for name in names:
        fully_shard(model.get_submodule(name), mesh=on, mp_policy=policy)
    fully_shard(model, mesh=on, mp_policy=policy)
    return model


def batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 7, generator=g)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def post_all_gather_calls():
    """Counts fsdp_post_all_gather calls with and without out= (the reuse path)."""
    calls = {"new": 0, "out": 0}
    original = Fp8AllGatherWeight.fsdp_post_all_gather

    def counting(self, *a, out=None, **kw):
        calls["out" if out is not None else "new"] += 1
        return original(self, *a, out=out, **kw)

    Fp8AllGatherWeight.fsdp_post_all_gather = counting
    return calls, lambda: setattr(Fp8AllGatherWeight, "fsdp_post_all_gather", original)


def train(model, opt, steps, fp8, dtype=torch.float32):
    """Returns the losses, the all-gather and all-reduce calls of each step, and whether every
    forward saw exactly dequant(quant(full weight))."""
    losses, gathers, reduces, exact = [], [], [], []
    for step in range(steps):
        expected = {n: quant_dequant(model.get_submodule(n).weight.full_tensor()) for n in LINEARS}
        x, y = batch(step, dtype)
        with CollectiveCounter() as counter:
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
        gathers.append([c.tensor_bytes for c in counter.calls if c.op == "all_gather"])
        reduces.append([c.tensor_bytes for c in counter.calls if c.op == "all_reduce"])
        if fp8:
            for n in LINEARS:
                seen = model.get_submodule(n).seen
                exact.append(seen.dtype == torch.float32 and torch.equal(seen, expected[n]))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, gathers, reduces, exact


def rel_error(a: dict, b: dict) -> float:
    diff = sum((a[k].double() - b[k].double()).norm() ** 2 for k in a) ** 0.5
    return float(diff / sum(v.double().norm() ** 2 for v in b.values()) ** 0.5)


def padded_rows(rows: int) -> int:
    return math.ceil(rows / world)


# Bytes each FSDP unit all-gathers (the full output, `world` shards): the weight at 1 byte
# per element with FP8, 4 without; biases always fp32. Padded: 37 rows -> 2 x 19, 23 -> 2 x 12.
SHAPES = {"0": (37, 16, True), "2": (23, 37, True), "3": (7, 23, False)}


def unit_bytes(name: str, weight_bytes: int) -> int:
    rows, cols, bias = SHAPES[name]
    return world * padded_rows(rows) * (cols * weight_bytes + (4 if bias else 0))


def case_exact():
    calls, restore = post_all_gather_calls()
    ref = shard(make_model())
    fp8 = make_model()
    check(enable_fp8_all_gather(fp8, LINEARS) == LINEARS, "enable_fp8_all_gather returns the names")
    check(all(isinstance(fp8.get_submodule(n).weight, nn.Parameter) for n in LINEARS), "weights stay Parameters")
    fp8 = shard(fp8)
    check(fp8_all_gather_names(fp8) == [f"{n}.weight" for n in LINEARS], f"names {fp8_all_gather_names(fp8)}")
    local = fp8[0].weight.to_local()
    check(isinstance(local, Fp8AllGatherWeight), f"sharded local tensor is {type(local)}")
    check(local.shape == (19 - rank, 16), f"uneven shard of 37 rows: {tuple(local.shape)}")

    ref_losses, ref_gathers, ref_reduces, _ = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 5, False)
    opt = torch.optim.AdamW(fp8.parameters(), lr=1e-2)
    losses, gathers, reduces, exact = train(fp8, opt, 5, True)
    restore()

    check(all(exact), f"forward weight == dequant(quant(full weight)) per step and layer: {exact}")
    # Same units, same order in both runs: each reference call maps to its unit's fp8 size.
    to_fp8 = {unit_bytes(n, 4): unit_bytes(n, 1) for n in LINEARS}
    for step in range(5):
        want = [to_fp8.get(b) for b in ref_gathers[step]]
        check(gathers[step] == want, f"step {step}: all-gather bytes {gathers[step]}, want {want}")
    # One 4-byte amax all-reduce per fp8 weight per all-gather; none in the reference run.
    check(all(r == [] for r in ref_reduces), f"reference all-reduces {ref_reduces}")
    check(all(len(r) == len(g) and set(r) == {4} for r, g in zip(reduces, gathers)), f"amax reduces {reduces}")
    check(calls["new"] == len(LINEARS) and calls["out"] > 0, f"post_all_gather calls {calls}")
    check(isinstance(fp8[0].weight.to_local(), Fp8AllGatherWeight), "still the subclass after AdamW steps")
    state = opt.state[fp8[0].weight]
    check(all(type(v.to_local()) is torch.Tensor for k, v in state.items() if k != "step"), "plain optimizer states")

    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_err = rel_error(full_params(fp8), full_params(ref))
    check(loss_err <= 1e-6, f"losses differ by {loss_err:.2e} relative: {losses} vs {ref_losses}")
    check(param_err <= 1e-6, f"parameters differ by {param_err:.2e} relative")
    # Consumer-side: the re-quantized fp8 weight of the FP8-all-gather run against the reference's.
    consumer = max(
        float(
            (quant_dequant(fp8.get_submodule(n).seen) - quant_dequant(ref.get_submodule(n).seen)).abs().max()
            / ref.get_submodule(n).seen.abs().max()
        )
        for n in LINEARS
    )
    report["exact"] = {
        "gather_bytes_per_step_fp8": sum(gathers[0]),
        "gather_bytes_per_step_fp32": sum(ref_gathers[0]),
        "gather_calls_per_step": len(gathers[0]),
        "gather_bytes_fp8": gathers[0],
        "gather_bytes_fp32": ref_gathers[0],
        "amax_all_reduces_per_step": len(reduces[0]),
        "post_all_gather_calls": calls,
        "forward_weight_exact": all(exact),
        "loss_rel_error": loss_err,
        "param_rel_error": param_err,
        "last_step_weight_max_diff_after_requant": consumer,
    }


def case_sgd():
    ref = shard(make_model())
    fp8 = make_model()
    enable_fp8_all_gather(fp8, LINEARS)
    fp8 = shard(fp8)
    ref_losses, *_ = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), 3, False)
    losses, _, _, exact = train(fp8, torch.optim.SGD(fp8.parameters(), lr=0.05, momentum=0.9), 3, True)
    param_err = rel_error(full_params(fp8), full_params(ref))
    check(all(exact), "SGD: forward weight exact")
    check(param_err <= 1e-6, f"SGD: parameters differ by {param_err:.2e}")
    report["sgd"] = {"param_rel_error": param_err}


def case_hsdp():
    # 2 replicas of 1 shard: FSDP's world-size-1 path (no all-gather; the hooks still run).
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    ref = shard(make_model(), on=hsdp)
    fp8 = make_model()
    enable_fp8_all_gather(fp8, LINEARS)
    fp8 = shard(fp8, on=hsdp)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3, False)
    _, gathers, _, exact = train(fp8, torch.optim.AdamW(fp8.parameters(), lr=1e-2), 3, True)
    check(all(exact), f"HSDP: forward weight exact {exact}")
    check(all(g == [] for g in gathers), f"HSDP with 1 shard all-gathers nothing: {gathers}")
    params = full_params(fp8)
    param_err = rel_error(params, full_params(ref))
    check(param_err <= 1e-6, f"HSDP: parameters differ by {param_err:.2e}")
    theirs: list = [None] * world
    dist.all_gather_object(theirs, params)
    check(all(torch.equal(theirs[0][k], v) for k, v in params.items()), "HSDP replicas diverged")
    report["hsdp"] = {"param_rel_error": param_err, "forward_weight_exact": all(exact)}


def case_bf16():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Units of fp8 weights only (the linears without bias), the biases in the root unit:
    # every unit then reduce-scatters gradients of one dtype.
    model = make_model()
    for n in ("0", "2"):
        model.get_submodule(n).bias = None
    model.append(nn.LayerNorm(7))
    enable_fp8_all_gather(model, LINEARS)
    model = shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, _, _, exact = train(model, opt, 3, True, dtype=torch.bfloat16)
    check(all(exact), f"bf16 policy: gathered weight is fp32 dequant(quant(full weight)): {exact}")
    check(all(math.isfinite(v) for v in losses), f"bf16 losses {losses}")
    sharded_dtype = model[0].weight.to_local().dtype
    check(sharded_dtype == torch.float32, f"sharded weight stays fp32: {sharded_dtype}")

    # A unit mixing an fp8-gathered weight (fp32 gradient) with a bf16 bias: FSDP2 refuses
    # to reduce-scatter gradients of two dtypes in one buffer.
    mixed = make_model()
    enable_fp8_all_gather(mixed, LINEARS)
    mixed = shard(mixed, mp_policy=policy)
    x, y = batch(0, torch.bfloat16)
    error = ""
    try:
        F.mse_loss(mixed(x).float(), y).backward()
    except AssertionError as e:
        error = str(e)
    check("uniform gradient dtype" in error, f"mixed-dtype unit: {error!r}")
    report["bf16"] = {"losses": losses, "forward_weight_exact": all(exact), "mixed_unit_error": error.strip()}


def case_state(out: Path):
    model = make_model()
    enable_fp8_all_gather(model, LINEARS)
    model = shard(model)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 2, True)
    sd = model.state_dict()
    plain = all(type(v.to_local()) is torch.Tensor for v in sd.values())
    check(plain, f"state_dict locals {[type(v.to_local()).__name__ for v in sd.values()]}")
    w = model[0].weight
    check(torch.equal(sd["0.weight"].to_local(), w.to_local()._tensor), "state_dict value is the weight's data")
    check(sd["0.weight"].to_local().data_ptr() == w.to_local()._tensor.data_ptr(), "state_dict shares storage")
    full = w.full_tensor()
    check(type(full) is torch.Tensor and full.shape == (37, 16), f"full_tensor {type(full)} {tuple(full.shape)}")
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # With cpu_offload only rank 0 receives the full state dict.
    if rank == 0:
        check(all(type(v) is torch.Tensor for v in full_sd.values()), "get_model_state_dict(full) plain")
        check(torch.equal(full_sd["0.weight"], full), "full state dict value")
    else:
        check(full_sd == {}, f"rank {rank} full state dict keys {list(full_sd)}")
    reference = full_params(model)

    ckpt = out / "dcp"
    dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)

    fresh = make_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    enable_fp8_all_gather(fresh, LINEARS)
    fresh = shard(fresh)
    fresh_sd = get_model_state_dict(fresh)
    dcp.load(fresh_sd, checkpoint_id=ckpt)
    set_model_state_dict(fresh, fresh_sd)
    got = full_params(fresh)
    check(all(torch.equal(got[k], reference[k]) for k in reference), "DCP round trip into an fp8 model")
    check(fp8_all_gather_names(fresh) == [f"{n}.weight" for n in LINEARS], "fp8 all-gather kept after load")
    _, _, _, exact = train(fresh, torch.optim.SGD(fresh.parameters(), lr=0.0), 1, True)
    check(all(exact), "loaded model gathers dequant(quant(loaded weight))")

    plain_model = shard(make_model())
    plain_sd = get_model_state_dict(plain_model)
    dcp.load(plain_sd, checkpoint_id=ckpt)
    set_model_state_dict(plain_model, plain_sd)
    got = full_params(plain_model)
    check(all(torch.equal(got[k], reference[k]) for k in reference), "DCP round trip into a plain model")
    report["state"] = {"state_dict_plain": plain, "dcp_round_trip": True}


for name, case in [
    ("exact", case_exact),
    ("sgd", case_sgd),
    ("state", lambda: case_state(Path(args.out))),
    ("hsdp", case_hsdp),
    ("bf16", case_bf16),
]:
    try:
        case()
    except Exception:
        failures.append(f"rank {rank}: case {name} raised\n{traceback.format_exc()}")

everyone: list = [None] * world
dist.all_gather_object(everyone, failures)
all_failures = [f for fs in everyone for f in fs]
if all_failures:
    raise AssertionError("\n".join(all_failures))
if rank == 0:
    Path(args.out, "result.json").write_text(json.dumps(report, indent=1))
leave_process_group()
