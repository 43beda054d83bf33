"""The communication of tensor and sequence parallelism, as autograd functions.

Names follow the Megatron paper and the Ultra-Scale Playbook. Each forward collective has
its conjugate in backward:

    f   copy into the TP region        fwd: identity          bwd: all-reduce
    g   reduce out of the TP region    fwd: all-reduce        bwd: identity
    f*  gather into the TP region (SP) fwd: all-gather (seq)  bwd: reduce-scatter (seq)
    g*  reduce-scatter out of it (SP)  fwd: reduce-scatter    bwd: all-gather (seq)
    sum a statistic over the columns   fwd: all-reduce        bwd: all-reduce

and, at the two ends of the sequence-parallel stretch of the model,

    scatter  enter SP from a replicated tensor   fwd: keep own seq chunk   bwd: all-gather
    gather   leave SP to a replicated tensor     fwd: all-gather           bwd: keep own chunk

Every function takes the TP process group; the sequence dimension is ``seq_dim`` (1 for
the batch-first ``[batch, seq, hidden]`` activations of the models we map).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _check_divisible(x: Tensor, seq_dim: int, n: int) -> None:
    if x.size(seq_dim) % n:
        raise ValueError(
            f"sequence parallelism splits the sequence over tp={n} ranks, but this batch has sequence "
            f"length {x.size(seq_dim)} (tensor shape {tuple(x.shape)}); pad or crop sequences to a "
            f"multiple of {n}, or set sequence_parallel=false."
        )


def all_gather_sequence(x: Tensor, seq_dim: int, group: dist.ProcessGroup) -> Tensor:
    n = _size(group)
    x = x.contiguous()
    # Collectives concatenate along dim 0: gather [n * d0, ...], then move rank r's chunk
    # to positions r*s/n... of the sequence dimension.
    out = torch.empty((n * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(n), dim=seq_dim)


def _reduce_scatter_seq(x: Tensor, seq_dim: int, group: dist.ProcessGroup) -> Tensor:
    n = _size(group)
    _check_divisible(x, seq_dim, n)
    chunks = x.chunk(n, dim=seq_dim)
    send = torch.cat(chunks, dim=0).contiguous()  # rank r's chunk at rows r*d0...
    out = torch.empty(chunks[0].shape, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, send, group=group)
    return out


def _own_chunk(x: Tensor, seq_dim: int, group: dist.ProcessGroup) -> Tensor:
    n = _size(group)
    _check_divisible(x, seq_dim, n)
    return x.chunk(n, dim=seq_dim)[dist.get_rank(group)].contiguous()


def _identity(x: Tensor, seq_dim: int, group: dist.ProcessGroup) -> Tensor:
    return x.view_as(x)


def _sum(x: Tensor, seq_dim: int, group: dist.ProcessGroup) -> Tensor:
    return _all_reduce(x.clone(), group)


def _conjugate_pair(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function running ``forward`` on the activation and ``backward`` on its gradient."""

    def fwd(ctx, x: Tensor, seq_dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.seq_dim, ctx.group = seq_dim, group
        return forward(x, seq_dim, group)

    def bwd(ctx, grad: Tensor):
        return backward(grad, ctx.seq_dim, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


# name, what runs on the activation (forward), what runs on its gradient (backward)
_CopyToTP = _conjugate_pair("_CopyToTP", _identity, _sum)  # f
_ReduceFromTP = _conjugate_pair("_ReduceFromTP", _sum, _identity)  # g
_GatherIntoTP = _conjugate_pair("_GatherIntoTP", all_gather_sequence, _reduce_scatter_seq)  # f*
_ReduceScatterFromTP = _conjugate_pair("_ReduceScatterFromTP", _reduce_scatter_seq, all_gather_sequence)  # g*
_ScatterToSP = _conjugate_pair("_ScatterToSP", _own_chunk, all_gather_sequence)
_GatherFromSP = _conjugate_pair("_GatherFromSP", all_gather_sequence, _own_chunk)
_SumOverTP = _conjugate_pair("_SumOverTP", _sum, _sum)  # a statistic every rank's columns use


def sum_over_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """A sum of per-rank partial statistics that each rank then uses on its own columns (a width
    norm's sum of squares): the gradient of the sum is every rank's part, so backward sums too."""
    return _SumOverTP.apply(x, 1, group)


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """f: the input of column-parallel linears (replicated in, each rank uses all of it)."""
    return _CopyToTP.apply(x, 1, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """g: the output of a row-parallel linear (partial sums over the ranks' input slices)."""
    return _ReduceFromTP.apply(x, 1, group)


def gather_into_tp(x: Tensor, group: dist.ProcessGroup, seq_dim: int = 1) -> Tensor:
    """f*: sequence-sharded activations in, full sequence to the column-parallel linears."""
    return _GatherIntoTP.apply(x, seq_dim, group)


def reduce_scatter_from_tp(x: Tensor, group: dist.ProcessGroup, seq_dim: int = 1) -> Tensor:
    """g*: partial sums of a row-parallel linear out, summed and sharded along the sequence."""
    return _ReduceScatterFromTP.apply(x, seq_dim, group)


def scatter_to_sequence_parallel(x: Tensor, group: dist.ProcessGroup, seq_dim: int = 1) -> Tensor:
    return _ScatterToSP.apply(x, seq_dim, group)


def gather_from_sequence_parallel(x: Tensor, group: dist.ProcessGroup, seq_dim: int = 1) -> Tensor:
    return _GatherFromSP.apply(x, seq_dim, group)
