"""One backward per piece on both sides: the parameter gradients the verifier compares.

The forward comparison cannot see a plan whose error is in gradients only: a replicated
parameter that sees only this rank's heads (a per-head q/k norm under tp) or sequence shard
(a norm under SP, every parameter under cp) gets this rank's part of its gradient, and
training then needs the sum over those ranks. So each piece also runs one backward:

    parallel:   g_par = d<c(y_par), y_par>/dθ_local   (the live piece run again on its probe
                input, :mod:`.rerun`), then the sums training applies: tp's partial-gradient
                hooks (they fire inside autograd.grad; under ZeRO-3, where training sums those
                gradients after the backward instead, the same sum over tp here) and the sum
                over cp (each cp rank saw its chunk of the sequence); a parameter tp cut keeps
                this rank's shape (:mod:`.shard_compare` compares it with the matching slice
                of g_ref)
    reference:  g_ref = d<c(y_ref), y_ref>/dθ        (the unparallelized piece, fp32)

``c`` is the cotangent: a fixed elementwise function of the output (``cos(3y) + 1/2``). An
elementwise function is cut exactly as the output is (sequence shards, vocabulary shards,
head columns), so every rank holds its slice of one global cotangent without knowing how
its layout cuts the output, and both sides use the same cotangent up to the forward's own
(already checked) difference. The piece's input is detached, so gradients reach only the
piece's own parameters: no earlier piece runs a backward (and no earlier collective fires).

Under ZeRO-3 θ_local are FSDP2's unsharded parameters (gathered over the data ranks for
the piece alone): the gradient before training's reduce-scatter over identical probe
inputs, i.e. the gradient training's mean over data ranks gives.
"""

from __future__ import annotations

import re
from typing import Any, Collection

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode


def cotangent(y: Tensor) -> Tensor:
    """The cotangent of a piece's output ``y`` (elementwise in ``y``; see the module docstring)."""
    return (torch.cos(3.0 * y.detach().float()) + 0.5).to(y.dtype)


def _local(y: Any) -> Tensor | None:
    if isinstance(y, DTensor):
        return y.to_local()
    return y if isinstance(y, Tensor) else None


def first_tensor(value: Any) -> Tensor | None:
    """The first tensor in ``value`` (a tensor, or tuples/lists/dicts of them): a piece's output."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            found = first_tensor(v)
            if found is not None:
                return found
    if isinstance(value, dict):
        return first_tensor(list(value.values()))
    return None


def _grads(output: Tensor | None, params: list[Tensor], release_from: nn.Module | None = None) -> list[Tensor]:
    if output is None or not output.requires_grad or not params:
        return [torch.zeros_like(p) for p in params]
    # An unused parameter's zero gradient needs its shape, which a released one no longer has.
    shapes = [p.shape for p in params]
    if release_from is not None:
        release_unsaved_weights(release_from, output)
    found = torch.autograd.grad(output, params, grad_outputs=cotangent(output), allow_unused=True)
    # autograd.grad returns fresh tensors (the sums into each leaf): no copy (a 250 MiB embedding
    # gradient was held twice).
    return [torch.zeros(shape, dtype=p.dtype, device=p.device) if g is None else g.detach()
            for p, g, shape in zip(params, found, shapes)]  # fmt: skip


def trainable_names(module: nn.Module) -> list[str]:
    """The parameters a piece trains (each tensor once), by name relative to the piece."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def local_grads(output: Any, params: list[Tensor]) -> list[Tensor]:
    """This rank's gradients of ``params`` from the piece's ``output`` (no sums yet)."""
    return _grads(_local(first_tensor(output)), params)


def summed(grads: dict[str, Tensor], prefix: str, tp: Any | None, cp: Any | None,
           tp_partial: Collection[str] = ()) -> dict[str, Tensor]:  # fmt: skip
    """``grads`` (by name relative to the piece at ``prefix``) summed as training sums them, in
    place, at this rank's shape (a parameter tp cut stays cut: :mod:`.shard_compare`).
    ``tp_partial``: full names whose partial gradients training sums over tp after the
    backward (ZeRO-3); elsewhere tp's hooks already summed them inside the backward.

    A collective over cp and tp: every rank holding this piece calls it in the same order."""
    for name, grad in grads.items():
        full_name = f"{prefix}.{name}" if prefix else name
        if cp is not None:  # each cp rank saw its chunk of the sequence; training sums them over dp x cp
            dist.all_reduce(grad, group=cp.group)
        if tp is not None and full_name in tp_partial:
            dist.all_reduce(grad, group=tp.group)
    return grads


# autograd's generated nodes (``AddmmBackward0``) show what they saved as ``_raw_saved_*``;
# AccumulateGrad (a leaf) saves nothing. Any other node (CopySlices after an in-place op on a
# view, a C++ custom Function or ``_foreach_*``'s CppFunction) keeps saved values out of sight.
_SEEN_THROUGH = re.compile(r"[A-Za-z0-9_]+Backward\d+|AccumulateGrad")


def _saved_storages(output: Tensor) -> set[int] | None:
    """The storages the graph behind ``output`` saved for its backward (by data pointer), or
    None when that cannot be seen whole: a node other than autograd's generated ones (a Python
    ``autograd.Function``, whose ``ctx`` can hold anything; CopySlices; a C++ Function), or a
    value saved under saved-tensor hooks (activation checkpointing inside the piece), read
    only by unpacking it, which recomputes it and, for torch's non-reentrant checkpoint, may
    be done once."""
    storages: set[int] = set()
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction) or not _SEEN_THROUGH.fullmatch(
            type(node).__name__
        ):
            return None
        for attr in dir(node):
            if not attr.startswith("_raw_saved_"):
                continue
            value = getattr(node, attr)  # the saved values as kept: nothing is unpacked
            for saved in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(saved, torch._C._autograd.SavedTensor):
                    continue
                if saved.unpack_hook is not None:
                    return None
                data = saved.data
                if isinstance(data, Tensor) and data.layout == torch.strided:
                    storages.add(data.untyped_storage().data_ptr())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return storages


class HookWatch(TorchFunctionMode):
    """Whether a forward run inside it registers a tensor hook (``Tensor.register_hook``): the hook
    runs in the backward with whatever it closed over, a parameter included, out of the graph's
    sight, so :func:`release_unsaved_weights` must not empty any weight then."""

    def __init__(self) -> None:
        super().__init__()
        self.registered = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.register_hook:
            self.registered = True
        return func(*args, **(kwargs or {}))


def _backward_hooks(reference: nn.Module) -> bool:
    """Module backward hooks (the piece's own, or global ones) run with the module at hand."""
    from torch.nn.modules import module as module_hooks

    if module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks:
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in reference.modules())


def release_unsaved_weights(reference: nn.Module, output: Tensor) -> int:
    """Empty each of the reference piece's parameters its graph did not save.

    The weight gradient of a layer whose input needs no gradient is built from that input and
    the cotangent alone (``∂L/∂W = cᵀh`` for a linear head, a scatter of ``c`` for an
    embedding), so autograd saves no weight there; the gathered full weight is dead once the
    forward ran, yet the piece kept it alive next to the full gradient: 2 x the largest
    tensor on a rank (the 0.5 B model's 188 MiB head under tp2 x ZeRO-3). The parameter stays
    the same leaf (its gradient keeps the shape autograd recorded at the forward); only its
    data becomes empty. Nothing is emptied where a backward could read a weight outside the
    graph's saved values (see :func:`_saved_storages`, module backward hooks; the caller
    checks tensor hooks with :class:`HookWatch`). Returns the bytes emptied (freed unless
    another tensor shares the storage).
    """
    saved = None if _backward_hooks(reference) else _saved_storages(output)
    if saved is None:
        return 0
    freed = 0
    for param in reference.parameters():
        if param.numel() and param.untyped_storage().data_ptr() not in saved:
            freed += param.untyped_storage().nbytes()
            param.data = param.data.new_empty(0)
    return freed


def reference_grads(
    reference: nn.Module, names: list[str], output: Any, release: bool = True
) -> dict[str, Tensor]:
    """The reference piece's gradients of ``names`` from its ``output``. With ``release`` (no
    tensor hook was registered in its forward: :class:`HookWatch`) the weights its graph does
    not need are emptied first (:func:`release_unsaved_weights`): the piece is spent after."""
    params = dict(reference.named_parameters())
    wanted = [params[n] for n in names]
    found = _grads(_local(first_tensor(output)), wanted, release_from=reference if release else None)
    return dict(zip(names, found))
