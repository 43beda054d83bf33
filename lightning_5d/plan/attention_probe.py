"""Find a block's attention projections by watching its attention call, where names do not tell.

Names find ``q_proj`` / ``k_proj`` / ``v_proj`` or a fused ``qkv``; a model that calls its
layers ``to_q`` and ``to_kv`` (separate queries, keys and values from one fused linear) has no
name the tables know. The attention call itself does: the model runs once on probe ids, every
linear layer inside the blocks hands out its output as a leaf of its own, and at each
``F.scaled_dot_product_attention(q, k, v)`` we ask autograd which leaves, and which of their
output features, ``q``, ``k`` and ``v`` depend on:

    S_t(P) = { j : d t / d P_j != 0 }        t in {q, k, v}, P a linear's output

``t`` fed by one linear P with S_t(P) all of P's features: a separate projection; ``k`` and ``v``
from one P, ``k`` from its first half and ``v`` from its second: a fused ``[k|v]``; all three
from one P: a fused ``qkv`` (its column order is observed later, in :mod:`.observe`). The
output projection is the first linear whose input depends on the attention's output. Head
counts come from the call's shapes: ``q`` is ``[..., H, L, d]``, and the kv head count is the
width k draws on divided by ``d``.

A float ``attn_mask`` with one slice per head that differs between heads (ALiBi's per-head
slopes) is recorded too: tensor parallelism gives each rank a slice of the heads, so such a
bias must be built for the rank's heads, which only the model's code can do. When the mask is
proven to be slopes times token distances (:func:`lightning_5d.plan.linear_bias.read_linear_bias`),
that is recorded as well: context parallelism rebuilds such a bias from global positions.

Parameters and their gradients are left untouched (gradients are taken with respect to the
leaves only); modules run in eval mode and return to their modes after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.module_mode import eval_mode
from lightning_5d.plan import kinds
from lightning_5d.plan.hints import BlockHints
from lightning_5d.plan.linear_bias import LinearBias, read_linear_bias


@dataclass(frozen=True)
class ObservedAttention:
    """What one block's first attention call showed (paths relative to the block)."""

    hints: BlockHints  # attention, q / k / v / kv / qkv, o and head counts
    per_head_bias: bool = False  # a float attn_mask that differs between heads
    linear_bias: LinearBias | None = None  # the mask, proven ALiBi-shaped (slopes x distances)


@dataclass
class _Call:
    owner: str  # the innermost module running when the kernel was called (relative to the block)
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    out: Tensor  # a leaf standing in for the call's output


@dataclass
class _Block:
    leaves: dict[str, Tensor] = field(default_factory=dict)  # linear path -> its output (a leaf)
    inputs: dict[str, Tensor] = field(default_factory=dict)  # linear path -> its first input
    order: list[str] = field(default_factory=list)  # linears in call order
    made_by: dict[int, str] = field(default_factory=dict)  # id of a module's output -> the module's path
    calls: list[_Call] = field(default_factory=list)


class _Watch(TorchFunctionMode):
    """Records every F.scaled_dot_product_attention call into the block running it."""

    def __init__(self, blocks: list[_Block], stack: list[tuple[int, str]]) -> None:
        super().__init__()
        self.blocks, self.stack = blocks, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not F.scaled_dot_product_attention or not self.stack or len(args) < 3:
            return out
        index, owner = self.stack[-1]
        leaf = out.detach().requires_grad_(True)
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        self.blocks[index].calls.append(_Call(owner, args[0], args[1], args[2], mask, leaf))
        return leaf


def observe_attention(root: nn.Module, blocks_path: str, run) -> dict[int, ObservedAttention]:
    """Block index -> what its first attention call showed, for each block that made one.

    ``run`` runs ``root`` once on probe ids (returns whether it ran)."""
    blocks = list(root.get_submodule(blocks_path).children())
    records = [_Block() for _ in blocks]
    stack: list[tuple[int, str]] = []
    with _hooks(blocks, records, stack), eval_mode(root), torch.enable_grad(), _Watch(records, stack):
        ran = run()
    if not ran:
        return {}
    found = {}
    for index, record in enumerate(records):
        if record.calls:
            observed = _read(record, record.calls[0], blocks[index])
            if observed is not None:
                found[index] = observed
    return found


@contextmanager
def _hooks(blocks: list[nn.Module], records: list[_Block], stack: list[tuple[int, str]]) -> Iterator[None]:
    with ExitStack() as handles:
        for index, block in enumerate(blocks):
            record = records[index]
            for path, module in block.named_modules():
                handles.callback(module.register_forward_pre_hook(_enter(stack, index, path)).remove)
                handles.callback(module.register_forward_hook(_leave(stack, record, path)).remove)
                if path and kinds.projection_kind(module) is not None:
                    handles.callback(module.register_forward_pre_hook(_input_of(record, path)).remove)
                    handles.callback(module.register_forward_hook(_leaf_of(record, path)).remove)
        yield


def _enter(stack, index, path):
    def hook(_module, _args):
        stack.append((index, path))

    return hook


def _leave(stack, record: _Block, path: str):
    def hook(_module, _args, out):
        stack.pop()
        if isinstance(out, Tensor):
            record.made_by.setdefault(id(out), path)

    return hook


def _input_of(record: _Block, path: str):
    def hook(_module, args):
        if path not in record.inputs and args and isinstance(args[0], Tensor):
            record.inputs[path] = args[0]

    return hook


def _leaf_of(record: _Block, path: str):
    def hook(_module, _args, out):
        if path in record.leaves or not isinstance(out, Tensor) or not out.is_floating_point():
            return None
        record.leaves[path] = out.detach().requires_grad_(True)
        record.order.append(path)
        return record.leaves[path]

    return hook



def _sources(record: _Block, t: Tensor) -> dict[str, set[int]]:
    """Linear path -> the output features of that linear ``t`` depends on."""
    if not t.requires_grad:
        return {}
    names = list(record.leaves)
    cotangent = torch.randn(t.shape, generator=torch.Generator().manual_seed(2)).to(t)
    grads = torch.autograd.grad(t, [record.leaves[n] for n in names], cotangent, retain_graph=True, allow_unused=True)
    found = {}
    for name, grad in zip(names, grads):
        if grad is None:
            continue
        used = torch.nonzero(grad.reshape(-1, grad.size(-1)).abs().sum(0) != 0).flatten().tolist()
        if used:
            found[name] = set(used)
    return found


def _output_projection(record: _Block, call: _Call) -> str | None:
    for path in record.order:
        x = record.inputs.get(path)
        if x is None or not x.requires_grad:
            continue
        (grad,) = torch.autograd.grad(x, call.out, torch.ones_like(x), retain_graph=True, allow_unused=True)
        if grad is not None and bool(grad.abs().sum() != 0):
            return path
    return None


def _read(record: _Block, call: _Call, block: nn.Module) -> ObservedAttention | None:
    q, k, v = (_sources(record, t) for t in (call.q, call.k, call.v))
    if len(q) != 1 or len(k) != 1 or len(v) != 1:
        return None  # several linears feed one input (or none): not a layout a plan can name
    (qp, qs), (kp, ks), (vp, vs) = next(iter(q.items())), next(iter(k.items())), next(iter(v.items()))
    o = _output_projection(record, call)
    if o is None or call.q.dim() < 3:
        return None
    heads, head_dim = call.q.size(-3), call.q.size(-1)
    hints = BlockHints(attention=call.owner, o=o, num_heads=heads, head_dim=head_dim)
    width = {p: _width(record, p) for p in {qp, kp, vp}}
    if qp == kp == vp:
        hints.qkv = qp
        kv_width = (width[qp] - heads * head_dim) // 2
    elif kp == vp and qp != kp:
        half = width[kp] // 2
        if ks != set(range(half)) or vs != set(range(half, 2 * half)):
            return None  # k and v interleaved inside one linear: no [k|v] cut keeps them apart
        hints.q, hints.kv, kv_width = qp, kp, half
    elif len({qp, kp, vp}) == 3:
        if any(s != set(range(width[p])) for p, s in ((qp, qs), (kp, ks), (vp, vs))):
            return None  # a projection only part of which feeds the call: not a plain one
        hints.q, hints.k, hints.v, kv_width = qp, kp, vp, width[kp]
    else:
        return None  # q fused with only one of k, v
    if width[qp] < heads * head_dim or kv_width <= 0 or kv_width % head_dim:
        return None
    hints.num_kv_heads = kv_width // head_dim
    hints.norms = _input_norm(record, qp, block)
    return ObservedAttention(hints, _per_head_bias(call.mask, heads), read_linear_bias(call.mask))


def _input_norm(record: _Block, q: str, block: nn.Module) -> tuple[str, ...]:
    """The norm whose output is the q projection's input (a pre-norm, wherever it is held):
    a norm on the attention's input, never one over the projection's output width."""
    x = record.inputs.get(q)
    path = record.made_by.get(id(x)) if x is not None else None
    return (path,) if path and kinds.is_norm(block.get_submodule(path)) else ()


def _width(record: _Block, path: str) -> int:
    return record.leaves[path].size(-1)


def _per_head_bias(mask: Tensor | None, heads: int) -> bool:
    if mask is None or not mask.is_floating_point() or mask.dim() < 3 or heads < 2 or mask.size(-3) != heads:
        return False
    first = mask.select(-3, 0).unsqueeze(-3)
    same = torch.isclose(mask, first, equal_nan=True) | (torch.isinf(mask) & torch.isinf(first) & (mask == first))
    return not bool(same.all())

