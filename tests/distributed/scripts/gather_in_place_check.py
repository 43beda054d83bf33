"""ZeRO-3's in-place gather of one-parameter units against FSDP2's own gather, on CPU ranks (tp2: 4).

Each case trains the same model twice from the same initial values, once with FSDP2's default
gather (``gather_in_place`` disabled) and once with it, and rank 0 writes the losses, the final
full parameters (bytes) and how many gathers landed in place. The memory case gathers one 64 MiB
single-tensor unit with and without, and writes the peak RSS above the RSS before the gather
(VmHWM reset through /proc/self/clear_refs just before).

Cases: ``zero3`` (the reference Llama through ``apply_fsdp``, an odd vocabulary so the embedding
and head shards are padded), ``bf16`` (the same under ``param_dtype=bf16``), ``tp2`` (torch's tp
over a 2 x 2 (dp, tp) mesh, every weight a DTensor, units resharded after forward so backward
gathers them again with explicit forward/backward prefetch), ``async`` (``unshard(async_op=True)``
then ``wait()``), ``memory``.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_5d.config import Layout
from lightning_5d.mesh import ParallelMesh
from lightning_5d.models.llama import LlamaConfig, LlamaModel
from lightning_5d.parallel.data import fsdp as fsdp_units
from lightning_5d.parallel.data import gather_in_place as gip
from lightning_5d.testing import leave_process_group

parser = argparse.ArgumentParser()
parser.add_argument("--cases", default="zero3,bf16,tp2,async,memory")
parser.add_argument("--out", required=True)

STEPS = 3
CONFIG = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1)


@contextlib.contextmanager
def default_gather():
    """FSDP2's own gather: ``apply_fsdp`` installs nothing while this lasts."""
    saved = fsdp_units.gather_in_place
    fsdp_units.gather_in_place = lambda units: 0
    try:
        yield
    finally:
        fsdp_units.gather_in_place = saved


def in_place_count(model: nn.Module) -> int:
    return sum(
        g._all_gather_comm.in_place
        for m in model.modules() if isinstance(m, fsdp_units.FSDPModule)
        for g in fully_shard.state(m)._fsdp_param_groups
        if isinstance(g._all_gather_comm, gip.InPlaceAllGather)
    )  # fmt: skip


def full_params(model: nn.Module) -> dict[str, list]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = full.detach().float().flatten().tolist()
    return out


def batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return [torch.randint(0, vocab, (2, 9), generator=g) for _ in range(STEPS)]


def train(model: nn.Module, vocab: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for ids in batches(vocab):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def llama_run(param_dtype, in_place: bool) -> dict:
    torch.manual_seed(0)
    model = LlamaModel(CONFIG)
    mesh = ParallelMesh(Layout(dp_shard=dist.get_world_size()), "cpu")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    with contextlib.nullcontext() if in_place else default_gather():
        units = fsdp_units.apply_fsdp(model, list(model.layers), mesh, policy)
    eligible = sum(gip.eligible(u) is not None for u in units)
    losses = train(model, CONFIG.vocab_size)
    return {"losses": losses, "params": full_params(model), "in_place": in_place_count(model), "eligible": eligible}


class TpModel(nn.Module):
    def __init__(self, vocab: int = 37, hidden: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.head = nn.Linear(2 * hidden, vocab, bias=False)

    def forward(self, ids):
        return self.head(torch.relu(self.up(self.emb(ids))))


def tp_run(in_place: bool) -> dict:
    torch.manual_seed(0)
    model = TpModel()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {
        "emb": RowwiseParallel(input_layouts=Replicate()),  # weight Shard(0) on tp
        "up": ColwiseParallel(),  # weight Shard(0) on tp
        "head": RowwiseParallel(),  # weight Shard(1) on tp
    })  # fmt: skip
    units = [model.emb, model.up, model.head]
    for unit in units:
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"])
    model.emb.set_modules_to_forward_prefetch([model.up])
    model.up.set_modules_to_forward_prefetch([model.head])
    model.head.set_modules_to_backward_prefetch([model.up])
    model.up.set_modules_to_backward_prefetch([model.emb])
    eligible = sum(gip.eligible(u) is not None for u in units)
    if in_place:
        gip.gather_in_place(units)
    losses = train(model, 37)
    return {"losses": losses, "params": full_params(model), "in_place": in_place_count(model), "eligible": eligible}


def async_run(in_place: bool) -> dict:
    torch.manual_seed(0)
    emb = nn.Embedding(37, 16)
    full = emb.weight.detach().clone()
    fully_shard(emb, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if in_place:
        gip.gather_in_place([emb])
    gathered = []
    for _ in range(2):  # the second gather re-allocates the storage the reshard freed
        handle = emb.unshard(async_op=True)
        handle.wait()
        gathered.append(bool(torch.equal(emb.weight, full)))
        emb.reshard()
    return {"equal_to_full": gathered, "in_place": in_place_count(emb)}


def hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def gather_peak(in_place: bool) -> int:
    """Peak RSS above the RSS before gathering one 64 MiB single-tensor unit."""
    torch.manual_seed(0)
    unit = nn.Linear(4096, 4096, bias=False)  # 64 MiB fp32
    fully_shard(unit, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if in_place:
        gip.gather_in_place([unit])
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss_bytes()
    unit.unshard()
    peak = hwm_bytes() - before
    unit.reshard()
    del unit
    return peak


def main() -> None:
    args = parser.parse_args()
    dist.init_process_group("gloo")
    result = {}
    for case in args.cases.split(","):
        if case in ("zero3", "bf16"):
            dtype = torch.bfloat16 if case == "bf16" else None
            result[case] = {"default": llama_run(dtype, False), "in_place": llama_run(dtype, True)}
        elif case == "tp2":
            result[case] = {"default": tp_run(False), "in_place": tp_run(True)}
        elif case == "async":
            result[case] = {"default": async_run(False), "in_place": async_run(True)}
        elif case == "memory":
            # Twice each, alternating, so neither side profits from the other's freed pages.
            peaks = {"default": [], "in_place": []}
            for _ in range(2):
                for side in ("default", "in_place"):
                    peaks[side].append(gather_peak(side == "in_place"))
            result[case] = {side: min(v) for side, v in peaks.items()}
        else:
            raise SystemExit(f"unknown case {case!r}: choose from zero3, bf16, tp2, async, memory")
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result.get("memory"))
    if dist.get_rank() == 0:
        if "memory" in result:
            result["memory"] = {"ranks": per_rank}
        Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    leave_process_group()


if __name__ == "__main__":
    main()
