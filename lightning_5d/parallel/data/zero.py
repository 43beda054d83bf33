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

Reduction protocol. Buckets are launched strictly in bucket order on every rank (a
bucket waits for the ones before it), so collectives pair up across ranks even when
ranks use different parameters. The backward that syncs ends with one queued autograd
callback that launches what is left, waits, and places the results, so hooks such as
``on_after_backward`` already see reduced gradients. A parameter that no rank used
keeps ``grad=None`` (as in one process), found with one small all-reduce of a bitmap.

Per-rank model-state bytes (fp32 params, Adam, Ψ parameters, N data ranks):

    stage 0: 4Ψ + 4Ψ + 8Ψ
    stage 1: 4Ψ + 4Ψ + 8Ψ/N          (master slices alias the fp32 parameters and gradients)
    stage 2: 4Ψ + 4Ψ/N + 8Ψ/N        (full gradients freed once reduce-scattered)
    stage 3: (4Ψ + 4Ψ + 8Ψ)/N        (FSDP2)

With low-precision parameters the masters are separate fp32 slices (+4Ψ/N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor, Shard

from lightning_5d.config import ZeroStage
from lightning_5d.mesh import ParallelMesh

# Optimizers whose update of one element reads only that element's state and gradient
# and that create no state before their first step. ZeRO-1/2 hand the optimizer flat
# slices of parameters, which is exact only for these.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
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
    used: bool = False  # had a local gradient when its bucket was launched


@dataclass
class _Bucket:
    index: int
    shards: list[_ParamShard]
    width: int  # elements per rank segment: sum of chunks (stage 1/2) or of numels (stage 0)
    ready: int = 0
    work: dist.Work | None = None
    buffer: torch.Tensor | None = None


@dataclass(frozen=True)
class DataGroups:
    """Where one set of parameters reduces and shards its gradients."""

    average: dist.ProcessGroup  # every rank holding the same parameters (used-flags, stage 0)
    average_size: int
    shard_mesh: object  # DeviceMesh the stage 1/2 slices live on
    replicate: dist.ProcessGroup | None  # HSDP replicas, summed after the reduce-scatter
    divisor: int  # gradients are summed over `average` and divided by this

    @classmethod
    def dense(cls, mesh: ParallelMesh) -> "DataGroups":
        # Averaged over every rank that saw different tokens (dp x cp), sharded over
        # dp_shard x cp, then summed over the replicas (HSDP).
        size = mesh.size("dp_cp")
        return cls(mesh.group("dp_cp"), size, mesh["dp_shard_cp"], _replicas(mesh), size)

    @classmethod
    def experts(cls, mesh: ParallelMesh) -> "DataGroups":
        # An expert's gradient already sums the tokens of its whole ep group (the all-to-all
        # brought them), so the sum over the ranks holding that expert covers all dp x cp
        # ranks once: divide by dp x cp, not by the edp size.
        return cls(mesh.group("edp"), mesh.size("edp"), mesh["edp_shard"], _replicas(mesh), mesh.size("dp_cp"))


def _replicas(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    return mesh.group("dp_replicate") if mesh.size("dp_replicate") > 1 else None


class ZeroDataParallel:
    """Gradient reduction (stages 0-2) and optimizer sharding (stages 1-2) for one module.

    ``owns`` picks the parameters (by name) this instance reduces; with expert parallelism
    one instance takes the dense parameters and another the experts, each on its groups.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: ParallelMesh,
        stage: ZeroStage,
        bucket_size_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        groups: DataGroups | None = None,
        owns: Callable[[str], bool] | None = None,
        accumulate_in_masters: bool = False,
    ) -> None:
        if stage == ZeroStage.PARAMETERS:
            raise ValueError("stage 3 shards parameters: use apply_fsdp")
        self.stage = ZeroStage(stage)
        self._reduce_dtype = reduce_dtype  # None: the master dtype of each bucket
        # fp32 gradient accumulation for bf16 parameters: every micro-batch is reduced into the
        # fp32 master slices and its bf16 gradient freed, as stage 2 always does.
        self.accumulate_in_masters = accumulate_in_masters
        self.require_sync = True
        self.active = True  # False between a Trainer's teardown and the next setup
        self.paused = False  # True while a pipeline schedule runs its many backwards
        groups = groups or DataGroups.dense(mesh)
        self._average_group = groups.average
        self._average_size = groups.average_size
        self._divisor = groups.divisor
        self._shard_mesh = groups.shard_mesh
        self._shard_group = self._shard_mesh.get_group()
        self._shard_size = self._shard_mesh.size()
        self._shard_rank = self._shard_mesh.get_local_rank()
        self._replicate_group = groups.replicate

        named = _unique_trainable(module.named_parameters())
        # With `owns`, parameters another instance reduces pass through this one's optimizer
        # sharding (ZeroSet checks that each belongs to one of them).
        self._shares_optimizer = owns is not None
        if owns is not None:
            named = [(name, p) for name, p in named if owns(name)]
        self._names = {id(p): name for name, p in module.named_parameters()}  # frozen ones too
        self._shards = [self._make_shard(p) for _, p in named]
        self._shard_of = {id(s.param): s for s in self._shards}  # masters are added as they are made
        self._buckets = self._make_buckets(self._shards, int(bucket_size_mb * 2**20))
        self._bucket_of = {id(s.param): b for b in self._buckets for s in b.shards}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named]
        self._optimizer_hooks: list = []
        self._optimizer_buckets: dict[int, list[_Bucket]] = {}
        self._next = 0  # the next bucket to launch; identical order on every rank
        self._backward_id = 0  # counts backwards started through the strategy
        self._synced_id = -1  # the last backward whose reduction completed
        self._callback_queued = False
        self._aliased = False  # stage 1: master grads are views of the module's grads

    # ------------------------------------------------------------------ layout
    def _make_shard(self, p: nn.Parameter) -> _ParamShard:
        n, world = p.numel(), self._shard_size
        chunk = math.ceil(n / world)
        start = min(self._shard_rank * chunk, n)
        return _ParamShard(param=p, chunk=chunk, start=start, length=min(chunk, n - start))

    def _make_buckets(self, shards: Sequence[_ParamShard], capacity: int) -> list[_Bucket]:
        # Reverse registration order approximates the order gradients become ready.
        groups: list[list[_ParamShard]] = []
        size = 0
        for s in reversed(shards):
            nbytes = s.param.numel() * master_dtype(s.param.dtype).itemsize
            if groups and groups[-1] and (size + nbytes <= capacity and s.param.dtype == groups[-1][0].param.dtype):
                groups[-1].append(s)
                size += nbytes
            else:
                groups.append([s])
                size = nbytes
        return [self._close_bucket(i, group) for i, group in enumerate(groups)]

    def _close_bucket(self, index: int, shards: list[_ParamShard]) -> _Bucket:
        offset = 0
        for s in shards:
            s.offset = offset
            offset += s.param.numel() if self.stage == ZeroStage.NONE else s.chunk
        return _Bucket(index=index, shards=shards, width=offset)

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
        every_microbatch = self.stage == ZeroStage.GRADIENTS or self.accumulate_in_masters
        return self.active and not self.paused and (self.require_sync or every_microbatch)

    def start_backward(self) -> None:
        """Before each backward run by the strategy."""
        self._backward_id += 1
        for bucket in self._buckets:  # nothing may be left over from an interrupted backward
            bucket.ready, bucket.work, bucket.buffer = 0, None, None
        self._next = 0
        if self._aliased:
            # A second synced backward before the optimizer step: the module's gradients
            # must restart from zero, so the reduced slices move out of them first.
            for s in self._shards:
                if s.master is not None and s.master.grad is not None:
                    s.master.grad = self._as_dtensor(s.master.grad._local_tensor.clone(), s)
                s.param.grad = None
            self._aliased = False

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._syncing:
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._bucket_of[id(p)].ready += 1
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if bucket.ready < len(bucket.shards):
                break
            self._launch(bucket)
            self._next += 1

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._sync()

    def finish_gradient_sync(self) -> None:
        """After a backward run by the strategy: sync if no gradient hook did (no parameter got
        a gradient on this rank), so this rank still joins the collectives of the others."""
        if self._syncing and self._synced_id != self._backward_id:
            self._sync()

    def _sync(self) -> None:
        for bucket in self._buckets[self._next :]:
            self._launch(bucket)
        self._next = len(self._buckets)
        used = self._globally_used()
        replicas = []
        for bucket in self._buckets:
            assert bucket.work is not None and bucket.buffer is not None
            bucket.work.wait()
            if self._replicate_group is not None and self.stage != ZeroStage.NONE:
                replicas.append(dist.all_reduce(bucket.buffer, group=self._replicate_group, async_op=True))
        for work in replicas:
            work.wait()
        for bucket in self._buckets:
            for s in bucket.shards:
                if used[id(s.param)]:
                    self._place(bucket, s)
                else:  # no rank used it: leave it out of the step, as one process would
                    s.param.grad = None
            bucket.ready, bucket.work, bucket.buffer = 0, None, None
        self._next = 0
        self._synced_id = self._backward_id

    def _globally_used(self) -> dict[int, bool]:
        if not self._shards:  # e.g. the expert engine when every expert is frozen
            return {}
        # On the parameters' device: NCCL reduces only device tensors.
        flags = torch.tensor([s.used for s in self._shards], dtype=torch.uint8, device=self._shards[0].param.device)
        if self._average_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._average_group)
        return {id(s.param): bool(f) for s, f in zip(self._shards, flags.tolist())}

    def _launch(self, bucket: _Bucket) -> None:
        # Pre-divide so the sum over ranks is the mean over the data ranks.
        scale = 1.0 / self._divisor
        dtype = self._bucket_dtype(bucket)
        device = bucket.shards[0].param.device
        for s in bucket.shards:
            s.used = s.param.grad is not None
        if self.stage == ZeroStage.NONE:
            flat = torch.empty(bucket.width, dtype=dtype, device=device)
            for s in bucket.shards:
                piece = flat[s.offset : s.offset + s.param.numel()]
                piece.copy_(s.param.grad.reshape(-1)) if s.used else piece.zero_()
            flat.mul_(scale)
            bucket.buffer = flat
            bucket.work = dist.all_reduce(flat, group=self._average_group, async_op=True)
            return
        send = torch.empty(self._shard_size, bucket.width, dtype=dtype, device=device)
        for s in bucket.shards:
            _fill_rank_major(send[:, s.offset : s.offset + s.chunk], s.param.grad if s.used else None)
            if self.stage == ZeroStage.GRADIENTS or self.accumulate_in_masters:
                s.param.grad = None  # the whole point of stage 2
        send.mul_(scale)
        out = torch.empty(bucket.width, dtype=dtype, device=device)
        bucket.buffer = out
        bucket.work = dist.reduce_scatter_single(out, send.view(-1), group=self._shard_group, async_op=True)

    def _place(self, bucket: _Bucket, s: _ParamShard) -> None:
        p = s.param
        if self.stage == ZeroStage.NONE:
            reduced = bucket.buffer[s.offset : s.offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = reduced.to(p.dtype, copy=True)
            else:
                p.grad.copy_(reduced)
            return
        master = s.master
        if master is None:
            return  # not handed to any optimizer
        piece = bucket.buffer[s.offset : s.offset + s.length]
        if master.grad is not None:  # accumulating (stage 2 micro-batches, or a 2nd sync)
            master.grad._local_tensor.add_(piece.to(master.dtype))
        elif self.stage == ZeroStage.OPTIMIZER and p.grad is not None and p.grad.dtype == master.dtype:
            # Reuse the full gradient's own slice: ZeRO-1 holds full gradients anyway.
            view = p.grad.view(-1)[s.start : s.start + s.length]
            view.copy_(piece)
            master.grad = self._as_dtensor(view, s)
            self._aliased = True
        else:
            master.grad = self._as_dtensor(piece.to(master.dtype, copy=True), s)

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
        if self._optimizer_buckets:
            # Lightning's toggle_optimizer flips requires_grad on the optimizer's parameters,
            # which here are the slices, not the module's parameters: it would silently do nothing.
            raise RuntimeError(
                f"zero={int(self.stage)} supports one optimizer; this module configures several. "
                f"Use zero=0 or zero=3 for several optimizers."
            )
        if optimizer.state:
            raise RuntimeError("shard_optimizer must run before the optimizer's first step.")
        for group in optimizer.param_groups:
            group["params"] = [self._master_for(p) for p in group["params"]]
        masters = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._optimizer_buckets[id(optimizer)] = [
            b for b in self._buckets if any(s.master is not None and id(s.master) in masters for s in b.shards)
        ]
        layout = _group_layout(optimizer)
        self._optimizer_hooks += [
            optimizer.register_step_pre_hook(lambda opt, *_: _check_unchanged(opt, layout)),
            optimizer.register_step_post_hook(lambda opt, *_: self.gather_parameters(opt)),
        ]

    def _master_for(self, p: torch.Tensor) -> torch.Tensor:
        s = self._shard_of.get(id(p))
        if s is None:
            if not p.requires_grad or self._shares_optimizer:
                return p  # frozen: never gets a gradient, so the optimizer never touches it
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter of "
                f"the LightningModule; ZeRO can only shard the module's own parameters."
            )
        if s.master is None:
            flat = s.param.detach().view(-1)[s.start : s.start + s.length]
            wanted = master_dtype(s.param.dtype)
            local = flat if s.param.dtype == wanted else flat.to(wanted)
            s.master = nn.Parameter(self._as_dtensor(local, s))
            self._shard_of[id(s.master)] = s
        return s.master

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of this instance's parameters or master slices."""
        return id(p) in self._shard_of

    def refresh_masters(self) -> None:
        """Copy parameters into separate master slices (after their values were loaded)."""
        for s in self._shards:
            if s.master is not None and s.param.dtype != s.master.dtype:
                s.master._local_tensor.copy_(s.param.detach().view(-1)[s.start : s.start + s.length])

    @torch.no_grad()
    def gather_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        """All-gather the slices ``optimizer`` just updated into the full parameters."""
        pending = []
        for bucket in self._optimizer_buckets[id(optimizer)]:
            dtype = bucket.shards[0].param.dtype
            mine = torch.zeros(bucket.width, dtype=dtype, device=bucket.shards[0].param.device)
            for s in bucket.shards:
                if s.master is not None:
                    mine[s.offset : s.offset + s.length] = s.master._local_tensor
            full = torch.empty(self._shard_size * bucket.width, dtype=dtype, device=mine.device)
            pending.append((bucket, full, dist.all_gather_single(full, mine, group=self._shard_group, async_op=True)))
        for bucket, full, work in pending:
            work.wait()
            rows = full.view(self._shard_size, bucket.width)
            for s in bucket.shards:
                if s.master is None:
                    continue
                s.param.view(-1).copy_(rows[:, s.offset : s.offset + s.chunk].reshape(-1)[: s.param.numel()])
                if self.stage == ZeroStage.OPTIMIZER:
                    s.param.grad = None  # the step consumed it; the next backward starts fresh
        self._aliased = False

    # ------------------------------------------------------------------ checkpoints
    def name_of(self, p: torch.Tensor) -> str:
        """The module parameter name behind an optimizer parameter (a master slice or itself)."""
        return self._names[id(self._param_of(p))]

    def full_value(self, p: torch.Tensor, value: Any) -> Any:
        """One optimizer-state value of ``p`` at the parameter's full shape (collective over dp for slices)."""
        if isinstance(value, DTensor):
            return value.full_tensor().reshape(self._param_of(p).shape)
        return value

    def local_value(self, p: torch.Tensor, value: Any) -> Any:
        """A full-shape optimizer-state value -> the slice ``p`` holds (no communication)."""
        return self._localize(value, p, self._shard_of.get(id(self._param_of(p))))

    def flat_slice(self, p: torch.Tensor) -> tuple[int, int] | None:
        """(start, length) of the flattened parameter a master slice ``p`` holds; None when
        ``p`` holds its parameter whole (stage 0, a frozen parameter)."""
        s = self._shard_of.get(id(p))
        if s is None or p is s.param:
            return None
        return s.start, s.length

    def from_flat(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """This rank's flat slice of an optimizer-state value of ``p`` -> the value ``p``'s state holds."""
        return self._as_dtensor(local, self._shard_of[id(p)])

    def _localize(self, value, p: torch.Tensor, s: _ParamShard | None):
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or s is None or p is s.param:
            return value
        local = value.reshape(-1)[s.start : s.start + s.length].clone()
        return self._as_dtensor(local, s)

    @property
    def shard_size(self) -> int:
        return self._shard_size

    def masters_by_name(self) -> dict[str, torch.Tensor | None]:
        """Name -> master slice (None before the optimizer is sharded) of each parameter at stage 1/2,
        where the averaged gradient is the master's: stage 1 reduces only this rank's chunk of the
        module's ``.grad``, stage 2 (and fp32 accumulation) frees it. With one shard rank
        (``shard_size`` 1) the slice is the whole parameter, flat."""
        if self.stage == ZeroStage.NONE:
            return {}
        return {self._names[id(s.param)]: s.master for s in self._shards}

    def master_names(self) -> dict[int, str]:
        """id of each master slice -> the name of the module parameter it slices."""
        return {id(m): n for n, m in self.masters_by_name().items() if m is not None}

    def _param_of(self, p: torch.Tensor) -> torch.Tensor:
        """The module parameter behind an optimizer parameter (a master slice or itself)."""
        s = self._shard_of.get(id(p))
        return s.param if s is not None else p

    def remove(self) -> None:
        for h in self._hooks + self._optimizer_hooks:
            h.remove()


def _fill_rank_major(rows: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Write a flat gradient into ``rows`` ([N, c]: row r is rank r's chunk), zero-padded."""
    if grad is None:
        rows.zero_()
        return
    flat = grad.reshape(-1)
    world, chunk = rows.shape
    full, rest = divmod(flat.numel(), chunk)
    rows[:full].copy_(flat[: full * chunk].view(full, chunk))
    if full < world:
        rows[full, :rest].copy_(flat[full * chunk :])
        rows[full, rest:].zero_()
        rows[full + 1 :].zero_()


def _unique_trainable(named: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _group_layout(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(g["params"]) for g in optimizer.param_groups]


def _check_unchanged(optimizer: torch.optim.Optimizer, layout: list[int]) -> None:
    if _group_layout(optimizer) != layout:
        raise RuntimeError(
            "the optimizer's parameter groups changed after ZeRO sharded them (e.g. add_param_group "
            "from a fine-tuning callback); those parameters would train on unreduced gradients. "
            "Use zero=0 or zero=3 to change the optimizer's parameters during training."
        )


@torch.no_grad()
def broadcast_module(module: nn.Module, mesh: ParallelMesh) -> None:
    """Make every rank start from rank 0's full parameters and buffers, before any dimension
    cuts them (TP shards and pipeline stages are taken from the same full model)."""
    if mesh.layout.world_size == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)
