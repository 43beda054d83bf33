"""The attention kernel, read from the module's source."""

import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.plan import AttentionKernel
from lightning_5d.plan.kernel import detect


class Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Softmax(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


class InAHelper(nn.Module):
    def forward(self, q, k, v):
        return self._attend(q, k, v)

    def _attend(self, q, k, v):
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


class OnlyAComment(nn.Module):
    def forward(self, q, k, v):
        # softmax and scaled_dot_product_attention happen in a custom kernel
        return custom_kernel(q, k, v)


def custom_kernel(q, k, v):
    return v


def test_kernels():
    assert detect(Sdpa()) is AttentionKernel.SDPA
    assert detect(Softmax()) is AttentionKernel.EXPLICIT_SOFTMAX
    assert detect(InAHelper()) is AttentionKernel.EXPLICIT_SOFTMAX
    assert detect(OnlyAComment()) is AttentionKernel.UNKNOWN


def test_source_unavailable_is_unknown():
    # A class made at run time has no source file.
    cls = type("Dynamic", (nn.Module,), {"forward": lambda self, x: x})
    assert detect(cls()) is AttentionKernel.UNKNOWN
    assert detect(nn.Identity()) is AttentionKernel.UNKNOWN
