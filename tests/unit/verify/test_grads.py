"""The verifier's backward per piece (single process: no tp or cp sums)."""

import copy
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_5d.config import ActivationCheckpointing
from lightning_5d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_5d.verify.grads import (
    HookWatch,
    cotangent,
    local_grads,
    reference_grads,
    release_unsaved_weights,
    trainable_names,
)
from lightning_5d.verify.rerun import ParallelGrads, rerun, unit_owners


def test_the_cotangent_of_a_shard_is_the_shard_of_the_cotangent():
    y = torch.randn(2, 8, 16)
    for dim in (1, 2):  # a sequence shard (SP, cp), a column / vocabulary shard (tp)
        for part, cut in zip(y.chunk(2, dim), cotangent(y).chunk(2, dim)):
            assert torch.equal(cotangent(part), cut)


def test_gradients_are_taken_for_the_pieces_own_parameters_only():
    torch.manual_seed(0)
    before, piece = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    piece[1].weight.requires_grad_(False)  # frozen: not compared
    x = torch.randn(3, 4)
    recorded = before(x).detach()  # what the probe records: the piece's input, detached
    names = trainable_names(piece)
    assert names == ["0.weight", "0.bias", "1.bias"]
    params = dict(piece.named_parameters())
    with torch.enable_grad():
        grads = local_grads(rerun(piece, (recorded,), {}), [params[n] for n in names])
    assert before.weight.grad is None and piece[0].weight.grad is None  # nothing accumulated anywhere
    reference = copy.deepcopy(piece)
    again = reference_grads(reference, names, reference(recorded))
    for name, grad in zip(names, grads):
        torch.testing.assert_close(grad, again[name])
    assert grads[0].abs().sum() > 0


class Head(nn.Module):
    """A final norm and head in one piece: the head's input needs a gradient (the norm's
    weight), so its weight is saved, and so are the norm's; only the head's bias is not."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 32)

    def forward(self, x):
        return self.proj(self.norm(x))


class Scale(torch.autograd.Function):
    """Keeps its weight on ctx, outside save_for_backward: autograd cannot show it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.w, (g * x).sum(0)


class CustomScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.proj(Scale.apply(x, self.w))


class CheckpointedHead(nn.Module):
    """A head under torch's non-reentrant checkpoint: its saved values are read only by unpacking."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32, bias=False)

    def forward(self, x):
        return checkpoint(self.proj, x, use_reentrant=False)


class ScaledInPlace(nn.Module):
    """An in-place op on a view: CopySlices hides the saved scale of the op it wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.scale = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.proj(x)
        h[:, :].mul_(self.scale)
        return h


class ForeachScaled(nn.Module):
    """``_foreach_mul``'s node (a CppFunction) shows nothing it saved."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a = nn.LayerNorm(8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch._foreach_mul([self.norm(x)], [self.a])[0]


def _hooked() -> nn.Module:
    head = nn.Linear(8, 32, bias=False)
    head.register_full_backward_pre_hook(lambda module, grad: None)  # runs with the module at hand
    return head


@pytest.mark.parametrize(
    ("piece", "inputs", "released"),
    [
        (nn.Linear(8, 32, bias=False), torch.randn(3, 8), ["weight"]),  # an untied head: ∂L/∂W = cᵀh
        (nn.Embedding(32, 8), torch.randint(0, 32, (3,)), ["weight"]),  # a scatter of the cotangent
        (Head(), torch.randn(3, 8), ["proj.bias"]),
        (CustomScaled(), torch.randn(3, 8), []),  # a Python Function's ctx could hold anything
        (CheckpointedHead(), torch.randn(3, 8), []),  # unpacking would recompute (and may be done once)
        (ScaledInPlace(), torch.randn(3, 8), []),
        (ForeachScaled(), torch.randn(3, 8), []),
        (_hooked(), torch.randn(3, 8), []),
    ],
)
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the hooked head: its input needs no gradient
def test_the_reference_backward_frees_only_the_weights_its_graph_does_not_save(piece, inputs, released):
    torch.manual_seed(0)
    names = trainable_names(piece)
    expected = dict(zip(names, local_grads(piece(inputs), [dict(piece.named_parameters())[n] for n in names])))
    sizes = {n: p.numel() for n, p in piece.named_parameters()}
    grads = reference_grads(piece, names, piece(inputs))
    assert [n for n, p in piece.named_parameters() if p.numel() == 0 and sizes[n]] == released
    for name in names:  # equal to the backward that kept every weight, at the parameter's shape
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0)


class HookReadsScale(nn.Module):
    """A tensor hook registered in the forward reads a parameter in the backward, outside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.scale = nn.Linear(8, 8), nn.Parameter(torch.randn(1))

    def forward(self, x):
        h = self.proj(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * self.scale.sum())
        return h + self.scale


def test_a_tensor_hook_registered_in_the_forward_keeps_every_weight():
    torch.manual_seed(0)
    piece, x = HookReadsScale(), torch.randn(3, 8)
    names = trainable_names(piece)
    expected = local_grads(piece(x), [dict(piece.named_parameters())[n] for n in names])
    watch = HookWatch()
    with watch:  # as the verifier runs the reference's forward
        out = piece(x)
    assert watch.registered
    grads = reference_grads(piece, names, out, release=not watch.registered)
    assert all(p.numel() for p in piece.parameters())
    for name, want in zip(names, expected):
        torch.testing.assert_close(grads[name], want, rtol=0, atol=0)
    with HookWatch() as quiet:
        nn.Linear(8, 8)(x)
    assert not quiet.registered


def test_the_release_counts_the_bytes_it_freed():
    head = nn.Linear(8, 32, bias=False)
    out = head(torch.randn(3, 8))
    assert release_unsaved_weights(head, out) == 8 * 32 * 4
    assert release_unsaved_weights(head, out) == 0  # already empty
    custom = CustomScaled()
    assert release_unsaved_weights(custom, custom(torch.randn(3, 8))) == 0


class Block(nn.Module):
    """Runs only inside its context (as cp's ring attention needs cp's shard to be current)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)
        self.inside = False

    def forward(self, x):
        if not self.inside:
            raise RuntimeError("ran outside the probe's context")
        return x + self.proj(self.norm(x))


@pytest.mark.parametrize("mode", [ActivationCheckpointing.FULL, ActivationCheckpointing.SELECTIVE])
def test_an_activation_checkpointed_piece_recomputes_inside_the_probes_context(mode):
    torch.manual_seed(0)
    block = Block()
    plain = copy.deepcopy(block)
    apply_activation_checkpointing([block], mode)

    @contextmanager
    def context():
        block.inside = plain.inside = True
        try:
            yield
        finally:
            block.inside = plain.inside = False

    x = torch.randn(2, 5, 8)
    names = trainable_names(block)
    grads = ParallelGrads(context, owners={}).of(block, "layers.0", (x,), {}, names)  # the backward recomputes
    with context():
        expected = reference_grads(plain, names, plain(x))
    for name in names:
        torch.testing.assert_close(grads[name], expected[name])


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_zero3_gradients_come_from_the_gathered_unit_and_it_is_sharded_again(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = Tiny()
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 16, (2, 6))
    with torch.no_grad():
        model(ids)  # the probe: FSDP2's lazy initialisation, no graph
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        unit.reshard()  # as the verifier does after its probe
    owners = unit_owners(model)
    assert owners[id(model.layers[1][1].weight)] is model.layers[1]  # the innermost unit, not the root
    assert owners[id(model.head.weight)] is model

    x = plain.embed(ids).detach()
    live = model.layers[1]
    names = trainable_names(live)
    grads = ParallelGrads(nullcontext, owners=owners, zero3=True).of(live, "layers.1", (x,), {}, names)
    expected = reference_grads(plain.layers[1], names, plain.layers[1](x))
    for name in names:
        torch.testing.assert_close(grads[name], expected[name])
        assert not isinstance(grads[name], DTensor)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # every unit sharded again
    assert all(p.grad is None for p in model.parameters())  # nothing left for training's first step
