"""Which norms inside an attention module tensor parallelism treats as width norms (no processes)."""

import torch
from torch import nn

from lightning_5d.parallel.tensor.width_norm import _rms, find_width_norms


class RMS(nn.Module):  # OLMo-2's form, under another name
    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = eps

    def forward(self, x):
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, q_norm: nn.Module, k_norm: nn.Module) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(64, 64), nn.Linear(64, 32)
        self.q_norm, self.k_norm = q_norm, k_norm


def test_full_width_rms_norms_are_found_with_their_epsilon():
    block = nn.Module()
    block.attn = Attention(RMS(64, 1e-5), RMS(32, 1e-5))
    found = find_width_norms(block, "attn", {64, 32}, head_dim=16)
    assert [(n.path, n.width, n.eps) for n in found] == [("attn.q_norm", 64, 1e-5), ("attn.k_norm", 32, 1e-5)]


def test_per_head_norms_are_not_width_norms_and_a_layer_norm_is_not_an_rms_norm():
    block = nn.Module()
    block.attn = Attention(RMS(16), nn.LayerNorm(32))  # q: per head (head_dim 16); k: a LayerNorm over the width
    found = find_width_norms(block, "attn", {64, 32}, head_dim=16)
    assert [(n.path, n.eps) for n in found] == [("attn.k_norm", None)]  # found, but refused (not an RMSNorm)


def test_the_distributed_formula_on_two_column_halves_equals_the_norm():
    norm = RMS(8, 1e-6)
    x = torch.randn(3, 8)
    halves = x.chunk(2, -1)
    total = sum(h.pow(2).sum(-1, keepdim=True) for h in halves)  # what the all-reduce sums
    pieces = [_rms(h, w, 1e-6, total, 8) for h, w in zip(halves, norm.weight.detach().chunk(2))]
    torch.testing.assert_close(torch.cat(pieces, -1), norm(x).detach(), rtol=1e-6, atol=1e-6)
