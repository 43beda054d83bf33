"""Vocabulary-parallel embedding and cross-entropy: the full vocabulary is never on one rank.

Rank ``r`` of ``tp`` owns vocabulary rows ``[r*V/tp, (r+1)*V/tp)`` of the embedding and of
the output head. The embedding looks up the ids it owns, zeroes the others and sums over
the TP group (g). The head's logits stay sharded along the vocabulary and are handed to
the user's code as a ``DTensor`` with placement ``Shard(-1)``, so that
``F.cross_entropy(logits.view(-1, V), labels.view(-1))`` in an unchanged
``training_step`` still sees a ``[N, V]`` tensor. Inside :func:`loss_parallel_region`
that call is answered by :func:`vocab_parallel_cross_entropy` (Megatron's formulation):

    m_i   = max_v z_iv                          (all-reduce MAX over TP)
    S_i   = sum_v exp(z_iv - m_i)               (all-reduce SUM)
    z_iy  = the target's logit, on its owner    (all-reduce SUM, zero elsewhere)
    loss_i = log S_i - (z_iy - m_i)
    dloss_i/dz_iv = softmax_iv - [v == y_i]     (local, no communication)
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.overrides import TorchFunctionMode

from lightning_5d.parallel.tensor.ops import reduce_from_tp
from lightning_5d.parallel.token_mean import CROSS_ENTROPY_ARGS


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    per = vocab_size // size
    return rank * per, (rank + 1) * per


def vocab_parallel_embedding_forward(module: nn.Embedding, ids: Tensor, start: int, group: dist.ProcessGroup) -> Tensor:
    """Forward of an ``nn.Embedding`` whose ``weight`` holds rows ``[start, start + rows)``."""
    rows = module.weight.size(0)
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    padding = module.padding_idx
    if padding is not None:
        padding = padding - start if start <= padding < start + rows else None
    args = (module.weight, padding, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse)
    if module.max_norm is None and not module.scale_grad_by_freq:
        out = F.embedding(local, *args).masked_fill(outside.unsqueeze(-1), 0.0)
    else:
        # Both look at which rows were looked up: ids owned elsewhere must not count as row 0.
        inside = ~outside
        out = module.weight.new_zeros(*ids.shape, module.weight.size(1))
        out[inside] = F.embedding(local[inside], *args)
    return reduce_from_tp(out, group)


class _ParallelLookup(TorchFunctionMode):
    """Answers the ``F.embedding`` calls on ``module.weight`` with the vocabulary-parallel lookup.

    An ``nn.Embedding`` subclass may do more than look up rows (Gemma scales by sqrt(hidden));
    replacing its forward would drop that. Its own forward runs instead, and only the lookup
    inside it (``super().forward`` or ``F.embedding`` on its weight) becomes parallel.
    """

    def __init__(self, module: nn.Embedding, start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.module, self.start, self.group = module, start, group
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.module.weight:
                self.calls += 1
                ids = args[0] if args else kwargs["input"]
                return vocab_parallel_embedding_forward(self.module, ids, self.start, self.group)
        return func(*args, **kwargs)


def vocab_parallel_forward(module: nn.Embedding, start: int, group: dist.ProcessGroup):
    """The forward a vocabulary-sharded ``module`` gets: the plain lookup for an ``nn.Embedding``,
    the subclass's own forward around a parallel lookup otherwise."""
    own = type(module).forward
    if own is nn.Embedding.forward:
        return lambda ids: vocab_parallel_embedding_forward(module, ids, start, group)

    def forward(*args, **kwargs):
        lookup = _ParallelLookup(module, start, group)
        with lookup:
            out = own(module, *args, **kwargs)
        if lookup.calls == 0:
            # Its rows are this rank's vocabulary shard: an index of its own would read wrong rows.
            raise RuntimeError(
                f"tensor parallelism shards the vocabulary of {type(module).__name__}, but its forward looked up "
                f"no rows through F.embedding / nn.Embedding.forward on its weight. Look rows up with "
                f"`super().forward(ids)` (or F.embedding(ids, self.weight)), or use tp=1."
            )
        return out

    return forward


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, start: int, ignore_index: int, group) -> Tensor:
        # At least fp32 (bf16 logits lose the loss), never less than the input (fp64 tests).
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m.unsqueeze(-1)
        exp = z.exp()
        rows = z.size(-1)
        local_t = target - start
        owned = (local_t >= 0) & (local_t < rows) & (target != ignore_index)
        picked = z.gather(-1, local_t.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1) * owned
        sums = torch.stack([exp.sum(dim=-1), picked])
        dist.all_reduce(sums, group=group)  # one collective for both sums
        valid = target != ignore_index
        loss = (sums[0].log() - sums[1]) * valid
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local_t, owned, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local_t, owned, valid = ctx.saved_tensors
        g = softmax.clone()  # saved tensors stay intact for a retained graph
        rows = torch.nonzero(owned).squeeze(-1)
        g[rows, local_t[rows]] -= 1.0
        # where, not a product: a mean over zero targets sends inf, and inf * 0 is nan.
        g = g * torch.where(valid, grad, 0.0).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """``F.cross_entropy`` for logits sharded along the class dimension; a plain tensor out."""
    mesh = logits.device_mesh
    class_dim = 1 if logits.ndim > 1 else 0
    local = logits.to_local()  # differentiable: the gradient comes back as Shard(class_dim)
    if logits.ndim > 2:  # [N, C, d1, ...] -> [N*d1*..., C]
        local = local.movedim(1, -1)
    flat_shape = local.shape[:-1]
    local = local.reshape(-1, local.size(-1))
    flat_target = target.reshape(-1)
    group = mesh.get_group()
    start = mesh.get_local_rank() * (logits.size(class_dim) // mesh.size())
    losses = _VocabParallelCrossEntropy.apply(local, flat_target, start, ignore_index, group)
    losses = losses.to(logits.dtype)
    if reduction == "none":
        return losses.view(flat_shape)
    if reduction == "sum":
        return losses.sum()
    # As F.cross_entropy: mean over non-ignored targets (nan if there are none).
    return losses.sum() / (flat_target != ignore_index).sum().to(losses.dtype)


def _is_vocab_sharded(x: Any) -> bool:
    if not isinstance(x, DTensor) or x.ndim < 1 or x.device_mesh.ndim != 1:
        return False
    class_dim = 1 if x.ndim > 1 else 0
    (placement,) = x.placements
    return (
        isinstance(placement, Shard)
        and placement.dim % x.ndim == class_dim
        and x.size(class_dim) % x.device_mesh.size() == 0
    )




_ARG_REDUCTIONS = (torch.argmax, torch.argmin, Tensor.argmax, Tensor.argmin)


def _with_nonnegative_dim(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """torch 2.13's DTensor argmax/argmin over a sharded dim given as negative (``logits.argmax(-1)``)
    fails when the leading dims are 1 (a batch of one: "shape [1, 32, 2, 2, 32, 1] is invalid"): its
    gather views the result with the unnormalized dim. The same dim counted from the front works."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DTensor):
        return args, kwargs
    if len(args) > 1 and isinstance(args[1], int) and args[1] < 0:
        return (args[0], args[1] % x.ndim, *args[2:]), kwargs
    if isinstance(kwargs.get("dim"), int) and kwargs["dim"] < 0:
        return args, {**kwargs, "dim": kwargs["dim"] % x.ndim}
    return args, kwargs


class _LossParallelMode(TorchFunctionMode):
    warned = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _ARG_REDUCTIONS:
            args, kwargs = _with_nonnegative_dim(args, kwargs)
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            bound = {**dict(zip(CROSS_ENTROPY_ARGS, args)), **kwargs}
            logits, target = bound.get("input"), bound.get("target")
            if _is_vocab_sharded(logits) and not isinstance(target, DTensor):
                if _plain_cross_entropy(bound, target):
                    return vocab_parallel_cross_entropy(
                        logits,
                        target,
                        ignore_index=bound.get("ignore_index", -100),
                        reduction=bound.get("reduction", "mean"),
                    )
                if not _LossParallelMode.warned:
                    _LossParallelMode.warned = True
                    warnings.warn(
                        "cross_entropy with class weights, label smoothing, probability targets or the "
                        "legacy size_average/reduce arguments runs on the gathered full-vocabulary logits "
                        "under tensor parallelism (correct, but every rank holds all logits)."
                    )
                bound["input"] = logits.full_tensor()
                return func(**bound)
        return func(*args, **kwargs)


def _plain_cross_entropy(bound: dict, target: Any) -> bool:
    return (
        isinstance(target, Tensor)
        and not target.is_floating_point()
        and bound.get("weight") is None
        and bound.get("size_average") is None
        and bound.get("reduce") is None
        and not bound.get("label_smoothing", 0.0)
    )


@contextlib.contextmanager
def loss_parallel_region() -> Iterator[None]:
    """Where user code meets vocabulary-sharded logits (training, validation, test and predict steps).

    ``F.cross_entropy`` on them runs vocabulary-parallel, plain tensors combined with them
    (masks, scales) count as replicated instead of raising a mixed-tensor error, and
    ``argmax(-1)`` on a batch of one works (:func:`_with_nonnegative_dim`).
    """
    with implicit_replication(), _LossParallelMode():
        yield
