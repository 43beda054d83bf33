"""All-to-all (Ulysses) attention: the head-count check (the exchange itself: tests/distributed/parallel/context)."""

import pytest
import torch

from lightning_5d.parallel.context.ring import ring_attention
from lightning_5d.parallel.context.ulysses import check_alltoall_heads


def test_heads_must_divide_over_cp():
    check_alltoall_heads(8, 2, 2)
    with pytest.raises(ValueError, match=r"cp in \[1, 2\]"):
        check_alltoall_heads(8, 2, 4)  # KV heads limit it
    with pytest.raises(ValueError, match=r"cp in \[1, 3\].*ring"):
        check_alltoall_heads(6, 3, 2)


def test_ring_entry_refuses_alltoall():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="alltoall_attention"):
        ring_attention(q, q, q, None, causal=False, mode="alltoall")
