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


def test_hybrid_names_the_valid_ulysses_sizes():
    from lightning_5d.config import LayoutError
    from lightning_5d.parallel.context.hybrid import check_hybrid, valid_ulysses

    assert valid_ulysses(8) == [2, 4]
    assert valid_ulysses(8, (8, 2)) == [2]  # 2 KV heads per tp rank
    check_hybrid(8, 2, (8, 2))
    with pytest.raises(LayoutError, match=r"context.ulysses=4 .* 8 query and 2 KV heads.*\[2\]"):
        check_hybrid(8, 4, (8, 2))
    with pytest.raises(LayoutError, match=r"context.ulysses=3 must divide cp=8.*\[2, 4\]"):
        check_hybrid(8, 3)
    with pytest.raises(LayoutError, match=r"ulysses=cp is context.mode='alltoall'"):
        check_hybrid(4, 4)
    with pytest.raises(LayoutError, match=r"needs context.ulysses.*\[2\]"):
        check_hybrid(4, None)


def test_hybrid_is_refused_before_any_process_group():
    from lightning_5d import FiveDStrategy
    from lightning_5d.config import LayoutError

    with pytest.raises(LayoutError, match=r"context.ulysses=3 must divide cp=4.*\[2\]"):
        FiveDStrategy(cp=4, context={"mode": "hybrid", "ulysses": 3})
    with pytest.raises(LayoutError, match="needs context.ulysses"):
        FiveDStrategy(cp=4, context={"mode": "hybrid"})
    with pytest.warns(UserWarning, match="context.ulysses"):
        FiveDStrategy(cp=4, context={"mode": "ring", "ulysses": 2})
