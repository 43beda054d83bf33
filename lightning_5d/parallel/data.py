"""Data parallelism with the ZeRO stages of the Ultra-Scale Playbook.

Stage 0-2 keep the module's parameters replicated (plain tensors) and are implemented
here; stage 3 shards parameters with FSDP2 ``fully_shard`` (``apply_fsdp``).

Sharding layout (stage 1/2). Every parameter of ``n`` elements is cut, flat, into
``N`` chunks of ``c = ceil(n / N)`` elements (``N`` = size of ``dp_shard_cp``); rank ``r``
owns elements ``[r*c, min((r+1)*c, n))``. This is the ``Shard(0)`` layout of a 1-D DTensor,
so each rank's slice is handed to the user's optimizer as a DTensor "master" parameter:
optimizer states are created only for that slice, and ``clip_grad_norm_`` over those
DTensors yields the global norm with no extra code. Gradients of a bucket of parameters
are laid out rank-major (``[chunk_0 of p1, chunk_0 of p2, ..., chunk_1 of p1, ...]``) so
one ``reduce_scatter`` hands every rank its chunks of all of them, and one ``all_gather``
after the optimizer step rebuilds the full parameters.

Per-rank model-state bytes (fp32 params, Adam, Ψ parameters, N data ranks):

    stage 0: 4Ψ + 4Ψ + 8Ψ
    stage 1: 4Ψ + 4Ψ + 8Ψ/N          (master slices alias the fp32 parameters)
    stage 2: 4Ψ + 4Ψ/N + 8Ψ/N        (full gradients freed once reduce-scattered)
    stage 3: (4Ψ + 4Ψ + 8Ψ)/N        (FSDP2)

With low-precision parameters the masters are separate fp32 slices (+4Ψ/N).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_5d.config import ZeroStage
from lightning_5d.mesh import ParallelMesh

# Optimizers whose update of one element reads only that element's state and gradient.
# ZeRO-1/2 hand the optimizer flat slices of parameters, which is exact only for these.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)



def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Optimizer math runs in at least fp32 (fp64 parameters stay fp64)."""
    return torch.promote_types(param_dtype, torch.float32)


@dataclass
class _ParamShard:
    param: nn.Parameter
    chunk: int  # c = ceil(n / N), the padded per-rank chunk
    start: int  # this rank's slice of the flat parameter ...
    length: int  # ... [start, start + length), possibly empty
    offset: int = 0  # where this parameter's chunk sits in its bucket's per-rank segment
    master: nn.Parameter | None = None  # DTensor slice the optimizer updates


@dataclass
class _Bucket:
    shards: list[_ParamShard]
    width: int  # elements per rank segment: sum of chunks (stage 1/2) or of numels (stage 0)
    ready: int = 0
    work: dist.Work | None = None
    buffer: torch.Tensor | None = None
    members: set[int] = field(default_factory=set)


class ZeroDataParallel:
    """Gradient reduction (stages 0-2) and optimizer sharding (stages 1-2) for one module."""

    def __init__(
        self,
        module: nn.Module,
        mesh: ParallelMesh,
        stage: ZeroStage,
        bucket_size_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if stage == ZeroStage.PARAMETERS:
            raise ValueError("stage 3 shards parameters: use apply_fsdp")
        self.stage = ZeroStage(stage)
        self._reduce_dtype = reduce_dtype  # None: the master dtype of each bucket
        self.require_sync = True
        self.comm_bytes: Counter[str] = Counter()
        # Gradients are averaged over every rank that saw different tokens (dp x cp) ...
        self._average_group = mesh.group("dp_cp")
        self._average_size = mesh.size("dp_cp")
        # ... and sharded over dp_shard x cp, then summed over the replicas (HSDP).
        self._shard_mesh = mesh["dp_shard_cp"]
        self._shard_group = self._shard_mesh.get_group()
        self._shard_size = self._shard_mesh.size()
        self._shard_rank = self._shard_mesh.get_local_rank()
        self._replicate_group = mesh.group("dp_replicate") if mesh.size("dp_replicate") > 1 else None

        params = _unique_trainable(module.parameters())
        self._shards = [self._make_shard(p) for p in params]
        self._shard_of = {id(s.param): s for s in self._shards}
        self._buckets = self._make_buckets(self._shards, int(bucket_size_mb * 2**20))
        self._bucket_of = {id(s.param): b for b in self._buckets for s in b.shards}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._gather_hooks: list = []

    # ------------------------------------------------------------------ layout
    def _make_shard(self, p: nn.Parameter) -> _ParamShard:
        n, world = p.numel(), self._shard_size
        chunk = math.ceil(n / world)
        start = min(self._shard_rank * chunk, n)
        return _ParamShard(param=p, chunk=chunk, start=start, length=min(chunk, n - start))

    def _make_buckets(self, shards: Sequence[_ParamShard], capacity: int) -> list[_Bucket]:
        # Reverse registration order approximates the order gradients become ready.
        buckets: list[_Bucket] = []
        current: list[_ParamShard] = []
        size = 0
        for s in reversed(shards):
            nbytes = s.param.numel() * s.param.element_size()
            if current and (size + nbytes > capacity or s.param.dtype != current[0].param.dtype):
                buckets.append(self._close_bucket(current))
                current, size = [], 0
            current.append(s)
            size += nbytes
        if current:
            buckets.append(self._close_bucket(current))
        return buckets

    def _close_bucket(self, shards: list[_ParamShard]) -> _Bucket:
        offset = 0
        for s in shards:
            s.offset = offset
            offset += s.param.numel() if self.stage == ZeroStage.NONE else s.chunk
        return _Bucket(shards=shards, width=offset, members={id(s.param) for s in shards})

    def _bucket_dtype(self, bucket: _Bucket) -> torch.dtype:
        return self._reduce_dtype or master_dtype(bucket.shards[0].param.dtype)

    def _as_dtensor(self, local: torch.Tensor, s: _ParamShard) -> DTensor:
        return DTensor.from_local(
            local, self._shard_mesh, [Shard(0)], run_check=False, shape=(s.param.numel(),), stride=(1,)
        )

    # ------------------------------------------------------------------ backward
    @property
    def _syncing(self) -> bool:
        # Stage 2 frees full gradients as it goes, so it must reduce on every micro-batch.
        return self.require_sync or self.stage == ZeroStage.GRADIENTS

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._syncing:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.shards):
            self._launch(bucket)

    def _grad_or_zeros(self, p: nn.Parameter) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _launch(self, bucket: _Bucket) -> None:
        # Pre-divide so the sum over ranks is the mean over the data ranks.
        scale = 1.0 / self._average_size
        dtype = self._bucket_dtype(bucket)
        if self.stage == ZeroStage.NONE:
            flat = torch.cat([self._grad_or_zeros(s.param).reshape(-1).to(dtype) for s in bucket.shards])
            flat.mul_(scale)
            self.comm_bytes["all_reduce"] += flat.numel() * flat.element_size()
            bucket.buffer = flat
            bucket.work = dist.all_reduce(flat, group=self._average_group, async_op=True)
            return
        world = self._shard_size
        send = torch.zeros(world, bucket.width, dtype=dtype, device=bucket.shards[0].param.device)
        for s in bucket.shards:
            g = self._grad_or_zeros(s.param).reshape(-1)
            padded = torch.zeros(world * s.chunk, dtype=dtype, device=g.device)
            padded[: g.numel()] = g
            send[:, s.offset : s.offset + s.chunk] = padded.view(world, s.chunk)
            if self.stage == ZeroStage.GRADIENTS:
                s.param.grad = None  # the whole point of stage 2
        send.mul_(scale)
        out = torch.empty(bucket.width, dtype=dtype, device=send.device)
        self.comm_bytes["reduce_scatter"] += send.numel() * send.element_size()
        bucket.buffer = out
        bucket.work = dist.reduce_scatter_single(out, send.view(-1), group=self._shard_group, async_op=True)

    def finish_gradient_sync(self) -> None:
        """Wait for this backward's reductions and place the results; call after backward."""
        if not self._syncing:
            return
        for bucket in self._buckets:
            if bucket.work is None:  # parameters that got no gradient this step
                self._launch(bucket)
        for bucket in self._buckets:
            assert bucket.work is not None and bucket.buffer is not None
            bucket.work.wait()
            if self.stage == ZeroStage.NONE:
                self._place_full(bucket)
            else:
                self._place_shard(bucket)
            bucket.work, bucket.buffer, bucket.ready = None, None, 0

    def _place_full(self, bucket: _Bucket) -> None:
        for s in bucket.shards:
            reduced = bucket.buffer[s.offset : s.offset + s.param.numel()].view_as(s.param)
            if s.param.grad is None:
                s.param.grad = reduced.to(s.param.dtype).clone()
            else:
                s.param.grad.copy_(reduced)

    def _place_shard(self, bucket: _Bucket) -> None:
        out = bucket.buffer
        if self._replicate_group is not None:
            self.comm_bytes["all_reduce"] += out.numel() * out.element_size()
            dist.all_reduce(out, group=self._replicate_group)
        for s in bucket.shards:
            master = s.master
            if master is None:
                continue  # not handed to any optimizer
            piece = out[s.offset : s.offset + s.length]
            p = s.param
            if self.stage == ZeroStage.OPTIMIZER and p.grad is not None and p.grad.dtype == master.dtype:
                # Reuse the full gradient's own slice: ZeRO-1 holds full gradients anyway.
                view = p.grad.view(-1)[s.start : s.start + s.length]
                view.copy_(piece)
                master.grad = self._as_dtensor(view, s)
            elif master.grad is None:
                master.grad = self._as_dtensor(piece.to(master.dtype).clone(), s)
            else:  # stage 2 accumulating micro-batches
                master.grad._local_tensor.add_(piece.to(master.dtype))

    # ------------------------------------------------------------------ optimizer
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Swap the optimizer's parameters for this rank's master slices (stage 1/2)."""
        if self.stage == ZeroStage.NONE:
            return
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(
                f"zero={int(self.stage)} gives the optimizer flat slices of each parameter, which is exact "
                f"only for element-wise optimizers ({names}); {type(optimizer).__name__} is not one. "
                f"Use zero=0 or zero=3 (FSDP2 keeps dim-0 shards), or one of those optimizers."
            )
        if optimizer.state:
            raise RuntimeError("shard_optimizer must run before the optimizer's first step.")
        for group in optimizer.param_groups:
            group["params"] = [self._master_for(p) for p in group["params"]]
        self._gather_hooks.append(optimizer.register_step_post_hook(lambda *_: self.gather_parameters()))

    def _master_for(self, p: torch.Tensor) -> nn.Parameter:
        s = self._shard_of.get(id(p))
        if s is None:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a trainable "
                f"parameter of the LightningModule; ZeRO can only shard the module's own parameters."
            )
        if s.master is None:
            flat = s.param.detach().view(-1)[s.start : s.start + s.length]
            wanted = master_dtype(s.param.dtype)
            local = flat if s.param.dtype == wanted else flat.to(wanted)
            s.master = nn.Parameter(self._as_dtensor(local, s))
        return s.master

    def shard_for_master(self, master: torch.Tensor) -> _ParamShard:
        for s in self._shards:
            if s.master is master:
                return s
        raise KeyError("not a master parameter of this engine")

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state with every slice gathered to its parameter's full shape."""
        if self.stage == ZeroStage.NONE:
            return optimizer.state_dict()
        return _full_optimizer_state(self, optimizer)

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if self.stage == ZeroStage.NONE:
            optimizer.load_state_dict(state)
        else:
            _load_full_optimizer_state(self, optimizer, state)

    def refresh_masters(self) -> None:
        """Copy parameters into separate master slices (after a checkpoint load)."""
        for s in self._shards:
            if s.master is not None and s.param.dtype != s.master.dtype:
                s.master._local_tensor.copy_(s.param.detach().view(-1)[s.start : s.start + s.length])

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather updated slices into the full parameters (after each optimizer step)."""
        pending = []
        for bucket in self._buckets:
            dtype = bucket.shards[0].param.dtype
            mine = torch.zeros(bucket.width, dtype=dtype, device=bucket.shards[0].param.device)
            for s in bucket.shards:
                if s.master is not None:
                    mine[s.offset : s.offset + s.length] = s.master._local_tensor
            full = torch.empty(self._shard_size * bucket.width, dtype=dtype, device=mine.device)
            self.comm_bytes["all_gather"] += full.numel() * full.element_size()
            pending.append((bucket, full, dist.all_gather_single(full, mine, group=self._shard_group, async_op=True)))
        for bucket, full, work in pending:
            work.wait()
            rows = full.view(self._shard_size, bucket.width)
            for s in bucket.shards:
                if s.master is None:
                    continue
                values = rows[:, s.offset : s.offset + s.chunk].reshape(-1)[: s.param.numel()]
                s.param.view(-1).copy_(values)
                if self.stage == ZeroStage.OPTIMIZER:
                    s.param.grad = None  # the step consumed it; the next backward starts fresh

    def remove(self) -> None:
        for h in self._hooks + self._gather_hooks:
            h.remove()


def _unique_trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@torch.no_grad()
def broadcast_module(module: nn.Module, mesh: ParallelMesh) -> None:
    """Make every data rank start from the first data rank's parameters and buffers."""
    group = mesh.group("dp_cp")
    if mesh.size("dp_cp") == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, group=group, group_src=0)


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _full_optimizer_state(engine: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    params = _flat_params(optimizer)
    for idx, entry in state["state"].items():
        shape = engine.shard_for_master(params[idx]).param.shape
        for key, value in list(entry.items()):
            if isinstance(value, DTensor):
                entry[key] = value.full_tensor().reshape(shape)
    return state


def _load_full_optimizer_state(engine: ZeroDataParallel, optimizer: torch.optim.Optimizer, state: dict) -> None:
    params = _flat_params(optimizer)
    state = {**state, "state": {idx: dict(entry) for idx, entry in state["state"].items()}}
    for idx, entry in state["state"].items():
        s = engine.shard_for_master(params[int(idx)])
        for key, value in list(entry.items()):
            if isinstance(value, torch.Tensor) and value.numel() == s.param.numel() and value.dim() > 0:
                local = value.reshape(-1)[s.start : s.start + s.length].clone()
                entry[key] = engine._as_dtensor(local, s)
    optimizer.load_state_dict(state)
