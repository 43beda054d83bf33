"""Single-process checks of the ring-attention pieces: merge math, sharding, block schedule."""

import pytest
import torch
import torch.nn.functional as F

from lightning_5d.parallel.context.ring import (
    block_schedule,
    contiguous_shard,
    contiguous_unshard,
    count_block_units,
    merge_partial,
    ring_attention,
    zigzag_shard,
    zigzag_unshard,
)


def _partial(q, k, v):
    s = q @ k.transpose(-1, -2)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


@pytest.mark.parametrize("split", [1, 5, 11])
def test_two_block_merge_equals_full_softmax(split):
    torch.manual_seed(0)
    q = torch.randn(3, 4, 8, dtype=torch.float64)
    k, v = torch.randn(3, 12, 8, dtype=torch.float64), torch.randn(3, 12, 8, dtype=torch.float64)
    k = k * 4  # large logits: the merge must rescale, not overflow
    full_out, full_lse = _partial(q, k, v)
    out_a, lse_a = _partial(q, k[:, :split], v[:, :split])
    out_b, lse_b = _partial(q, k[:, split:], v[:, split:])
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
    # an empty running state (lse = -inf) is the identity of the merge
    empty_out, empty_lse = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    out, lse = merge_partial(empty_out, empty_lse, full_out, full_lse)
    torch.testing.assert_close(out, full_out, rtol=0, atol=0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_shard_round_trip(cp):
    x = torch.arange(2 * 4 * cp * 3).reshape(2, 4 * cp, 3)
    shards = [zigzag_shard(x, 1, r, cp) for r in range(cp)]
    chunk = 2
    for r, shard in enumerate(shards):  # chunks r and 2cp-1-r
        expected = torch.cat([x[:, r * chunk:(r + 1) * chunk], x[:, (2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk]], 1)
        assert torch.equal(shard, expected)
    assert torch.equal(zigzag_unshard(shards, 1), x)
    assert torch.equal(contiguous_unshard([contiguous_shard(x, 1, r, cp) for r in range(cp)], 1), x)
    with pytest.raises(ValueError, match="2\\*cp"):
        zigzag_shard(x[:, :-1], 1, 0, cp)


def _visible_units(rank, cp, zigzag, s_local=4):
    """Brute force: quarter-block products that contain any unmasked (causal) score."""
    n = 2 * cp * (s_local // 2) if zigzag else cp * s_local
    pos = torch.arange(n)
    shard = (lambda x, r: zigzag_shard(x, 0, r, cp)) if zigzag else (lambda x, r: contiguous_shard(x, 0, r, cp))
    qpos = shard(pos, rank).chunk(2)
    units = 0
    for src in range(cp):
        for kp in shard(pos, src).chunk(2):
            units += sum(bool((qp[:, None] >= kp[None, :]).any()) for qp in qpos)
    return units


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_block_schedule_counts(cp):
    causal_ring = [count_block_units(r, cp, causal=True, zigzag=False) for r in range(cp)]
    zigzag = [count_block_units(r, cp, causal=True, zigzag=True) for r in range(cp)]
    full = [count_block_units(r, cp, causal=False, zigzag=z) for r in range(cp) for z in (False, True)]
    assert zigzag == [2 * cp + 2] * cp  # balanced
    assert causal_ring == [4 * (r + 1) for r in range(cp)]  # unbalanced for cp > 1
    assert sum(zigzag) == sum(causal_ring)  # same total work
    assert full == [4 * cp] * (2 * cp)
    # nothing visible is skipped; zig-zag computes no fully masked quarter block except inside the diagonal
    for r in range(cp):
        assert _visible_units(r, cp, zigzag=True) == zigzag[r] - 1  # the diagonal's masked quarter
        assert _visible_units(r, cp, zigzag=False) <= causal_ring[r]
        for src in range(cp):
            diag = [p.diagonal for p in block_schedule(r, src, cp, True, True)]
            assert any(diag) == (src == r)  # the mask only on the diagonal block


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_single_rank_matches_sdpa_and_gradcheck(causal, hkv):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, 6, 8, dtype=torch.float64, requires_grad=True)
    stats = {}
    out = ring_attention(q, k, v, None, causal=causal, stats=stats)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != 4)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert stats["forward_units"] == 4
    if hkv == 2:
        fn = lambda q, k, v: ring_attention(q, k, v, None, causal=causal)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_fp32_math_for_bf16_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    out = ring_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, causal=True)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(*(t.bfloat16().double() for t in (q, k, v)), is_causal=True)
    assert ((out.double() - ref).norm() / ref.norm()) < 5e-3  # only the output rounding


def test_bad_shapes():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ring_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), None, causal=False)
    with pytest.raises(ValueError, match="even local sequence"):
        ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], None, causal=True, sharding="zigzag")
