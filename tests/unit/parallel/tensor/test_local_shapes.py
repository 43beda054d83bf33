"""nanoGPT-style attention on one tp rank's heads: the full-width reshapes observed at discovery
are replayed with local sizes (lightning_5d.parallel.tensor.local_shapes; single process, the
ranks' partial outputs summed as the row-parallel all-reduce would)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_5d.parallel.tensor.local_shapes import fits, localize_shapes
from lightning_5d.parallel.tensor.sharding import TensorShard
from lightning_5d.plan import discover

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plan"))  # the shared nanoGPT-style model
from nanogpt_style import DIM, TinyGPT  # noqa: E402


def rank_attention(attention: nn.Module, plan_attention, rank: int, tp: int) -> nn.Module:
    """This rank's attention as TensorParallel leaves it: fused columns cut per segment, the
    output projection's rows cut (its bias on rank 0 only: added once after the sum), the
    head-count attributes divided, and the observed reshapes replayed with local sizes."""
    local = copy.deepcopy(attention)
    segments = TensorShard(0, plan_attention.qkv.segments)
    local.c_attn.weight = nn.Parameter(segments.take(attention.c_attn.weight.detach(), rank, tp))
    local.c_attn.bias = nn.Parameter(segments.take(attention.c_attn.bias.detach(), rank, tp))
    local.c_proj.weight = nn.Parameter(TensorShard(1).take(attention.c_proj.weight.detach(), rank, tp))
    if rank:
        local.c_proj.bias = None
    for name in plan_attention.head_attributes:
        setattr(local, name, getattr(local, name) // tp)
    localize_shapes(local, plan_attention.shape_sites, tp)
    return local


@pytest.mark.parametrize("tp", [2, 4])
def test_nanogpt_attention_on_each_ranks_heads_sums_to_the_full_attention(tp):
    torch.manual_seed(0)
    model = TinyGPT()
    plan_attention = discover(model).block_plans[0].attention
    attention = model.h[0].attn
    x = torch.randn(3, 10, DIM)  # neither probe shape: the batch-shaped sizes are the call's own
    with torch.no_grad():
        full = attention(x)
        parts = [rank_attention(attention, plan_attention, r, tp)(x) for r in range(tp)]
    torch.testing.assert_close(sum(parts), full, rtol=1e-5, atol=1e-6)


def test_without_the_observed_sites_the_rank_cannot_run_the_forward():
    """What tp met before: split(n_embd) of the rank's 3·C/tp features gives two tensors, not three."""
    torch.manual_seed(0)
    model = TinyGPT()
    plan_attention = discover(model).block_plans[0].attention
    local = rank_attention(model.h[0].attn, plan_attention, 0, 2)
    local.forward = type(local).forward.__get__(local)  # the model's own forward, no replay
    with pytest.raises(ValueError, match="not enough values to unpack"):
        local(torch.randn(2, 5, DIM))


def test_a_call_that_already_fits_is_left_as_the_model_wrote_it():
    x = torch.zeros(2, 3, 8)
    assert fits("view", x, (2, 3, 2, 4), 0, 0) and fits("view", x, (2, 3, -1, 4), 0, 0)
    assert not fits("view", x, (2, 3, 4, 4), 0, 0)
    assert fits("split", x, (4,), 2, 2) and not fits("split", x, (4,), 2, 3) and fits("split", x, (3, 5), 2, 2)


def test_a_forward_whose_own_sizes_fit_stops_paying_for_the_mode_after_one_call(monkeypatch):
    """einops / head-attribute style: tp divided the attribute the forward reshapes with."""
    from lightning_5d.parallel.tensor import local_shapes
    from lightning_5d.plan.shape_sites import ShapeSite

    class HeadsAttribute(nn.Module):
        heads, head_dim = 2, 4  # already this rank's heads (4 / tp)

        def forward(self, x):
            return x.reshape(x.size(0), self.heads, self.head_dim)

    modes = []

    class Counted(local_shapes._LocalShapes):
        def __init__(self, *args):
            super().__init__(*args)
            modes.append(self)

    monkeypatch.setattr(local_shapes, "_LocalShapes", Counted)
    module = HeadsAttribute()
    code = HeadsAttribute.forward.__code__
    key = (code.co_filename, code.co_firstlineno + 1, 0)
    site = ShapeSite(key, "reshape", (None, 4, 4), (False, True, False))
    localize_shapes(module, (site,), tp=2)
    for _ in range(3):
        assert module(torch.zeros(3, 8)).shape == (3, 2, 4)
    assert len(modes) == 1 and modes[0].rewrote == 0  # one forward under the mode, nothing to rewrite
    # A forward whose own sizes do not fit (the full head count) keeps its mode on every call:
    modes.clear()
    module = HeadsAttribute()
    module.heads = 4
    localize_shapes(module, (site,), tp=2)
    for _ in range(3):
        assert module(torch.zeros(3, 8)).shape == (3, 2, 4)
    assert len(modes) == 3 and all(m.rewrote == 1 for m in modes)
