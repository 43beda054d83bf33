"""The fused block kernel against the pure-math oracle, and the ring emulated in one process.

The emulation runs exactly the products and merges a cp rank runs (``block_schedule``,
``_apply_products`` / ``_backward_products``) against every other rank's K/V block, in
fp32, so causal diagonals, zig-zag halves and GQA (K/V with their own head count) are
covered without starting processes.
"""

import pytest
import torch

from lightning_5d.parallel.context.block_bias import BlockBias, shard_positions
from lightning_5d.parallel.context.kernel import BlockKernel, block_backward, block_forward, select_kernel
from lightning_5d.parallel.context.reference import reference_block_backward, reference_block_forward
from lightning_5d.parallel.context.ring import (
    _apply_products,
    _backward_products,
    block_schedule,
    contiguous_shard,
    zigzag_shard,
)
from lightning_5d.plan.linear_bias import DistanceForm, LinearBias


def _qkv(hq, hkv, sq, sk, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, s, d, generator=gen) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))


def test_kernel_selection():
    assert select_kernel(torch.device("cpu"), torch.float32) is BlockKernel.FLASH_CPU
    assert select_kernel(torch.device("cuda"), torch.bfloat16) is BlockKernel.EFFICIENT_CUDA
    assert select_kernel(torch.device("cuda"), torch.float64) is BlockKernel.REFERENCE


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize(("sq", "sk", "causal"), [(8, 8, True), (8, 8, False), (4, 8, False), (8, 4, False)])
def test_block_kernel_matches_oracle(hkv, sq, sk, causal):
    q, k, v = _qkv(4, hkv, sq, sk)
    out, lse = block_forward(q, k, v, 0.3, causal)
    ref_out, ref_lse = reference_block_forward(q, k, v, 0.3, causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # backward with a *final* out/lse that is not this block's own (as after a merge): lse raised by 0.7
    dout = torch.randn_like(q)
    final_out, final_lse = 0.5 * out, lse + 0.7
    got = block_backward(dout, q, k, v, final_out, final_lse, 0.3, causal)
    want = reference_block_backward(dout, q, k, v, final_out, final_lse, 0.3, causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def _emulated_ring(q, k, v, cp, causal, zigzag, grad):
    """Every rank's forward and backward over all KV blocks, in one process; returns gathered out, dq, dk, dv."""
    shard = (lambda x, r: zigzag_shard(x, 2, r, cp)) if zigzag else (lambda x, r: contiguous_shard(x, 2, r, cp))
    kvs = [torch.stack([shard(k, r), shard(v, r)]) for r in range(cp)]
    scale = q.size(-1) ** -0.5
    outs, lses, dqs = [], [], []
    dkvs = [torch.zeros_like(kv) for kv in kvs]
    for r in range(cp):
        ql = shard(q, r)
        out = torch.zeros_like(ql)
        lse = torch.full(ql.shape[:-1], float("-inf"))
        for src in range(cp):
            _apply_products((out, lse), ql, kvs[src], scale, block_schedule(r, src, cp, causal, zigzag))
        outs.append(out)
        lses.append(lse)
    for r in range(cp):
        ql, dq = shard(q, r), torch.zeros_like(shard(q, r))
        for src in range(cp):
            products = block_schedule(r, src, cp, causal, zigzag)
            _backward_products(ql, kvs[src], shard(grad, r), outs[r], lses[r], dq, dkvs[src], scale, products)
        dqs.append(dq)
    return outs, dqs, [d[0] for d in dkvs], [d[1] for d in dkvs], shard


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize(("causal", "zigzag"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("hkv", [4, 2])
def test_emulated_ring_matches_oracle(cp, causal, zigzag, hkv):
    s = 4 * cp
    q, k, v = _qkv(4, hkv, s, s, seed=cp)
    grad = torch.randn_like(q)
    outs, dqs, dks, dvs, shard = _emulated_ring(q, k, v, cp, causal, zigzag, grad)
    ref_out, ref_lse = reference_block_forward(q, k, v, q.size(-1) ** -0.5, causal)
    ref = (ref_out, *reference_block_backward(grad, q, k, v, ref_out, ref_lse, q.size(-1) ** -0.5, causal))
    for r in range(cp):
        for name, got, want in zip(("out", "dq", "dk", "dv"), (outs[r], dqs[r], dks[r], dvs[r]), ref):
            torch.testing.assert_close(got, shard(want, r), rtol=1e-5, atol=1e-5, msg=f"rank {r} {name}")


# --------------------------------------------------------------------- ALiBi bias (issue 22)

SLOPES = (0.5, 0.25, 0.125, 0.0625)


def _alibi(q_pos, k_pos, form=DistanceForm.KEY_MINUS_QUERY, slopes=SLOPES):
    return LinearBias(slopes, form, causal=False).scores(q_pos, k_pos)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("heads", [4, 1])
@pytest.mark.parametrize(("sq", "sk", "causal"), [(8, 8, True), (8, 8, False), (4, 8, False)])
def test_block_kernel_with_bias_matches_oracle(hkv, heads, sq, sk, causal):
    q, k, v = _qkv(4, hkv, sq, sk, seed=1)
    bias = _alibi(torch.arange(sk - sq, sk), torch.arange(sk), slopes=SLOPES[:heads])
    out, lse = block_forward(q, k, v, 0.3, causal, bias)
    ref_out, ref_lse = reference_block_forward(q, k, v, 0.3, causal, bias)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # the oracle itself against SDPA with the bias as its float mask
    dense = bias.unsqueeze(0).masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf")) if causal else bias
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.3, enable_gqa=hkv != 4)
    torch.testing.assert_close(ref_out, sdpa, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(q)
    final_out, final_lse = 0.5 * out, lse + 0.7
    got = block_backward(dout, q, k, v, final_out, final_lse, 0.3, causal, bias)
    want = reference_block_backward(dout, q, k, v, final_out, final_lse, 0.3, causal, bias)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def _emulated_biased_ring(q, k, v, cp, zigzag, grad, bias):
    """:func:`_emulated_ring` with each block's bias from the global positions of its tokens."""
    shard = (lambda x, r: zigzag_shard(x, 2, r, cp)) if zigzag else (lambda x, r: contiguous_shard(x, 2, r, cp))
    s_local = q.size(2) // cp
    at = lambda r, src: BlockBias(bias, *(shard_positions(x, cp, s_local, zigzag, q.device) for x in (r, src)))  # noqa: E731
    kvs = [torch.stack([shard(k, r), shard(v, r)]) for r in range(cp)]
    scale = q.size(-1) ** -0.5
    outs, lses, dqs, dkvs = [], [], [], [torch.zeros_like(kv) for kv in kvs]
    for r in range(cp):
        out, lse = torch.zeros_like(shard(q, r)), torch.full(shard(q, r).shape[:-1], float("-inf"))
        for src in range(cp):
            products = block_schedule(r, src, cp, bias.causal, zigzag)
            _apply_products((out, lse), shard(q, r), kvs[src], scale, products, at(r, src))
        outs.append(out)
        lses.append(lse)
    for r in range(cp):
        dq = torch.zeros_like(shard(q, r))
        for src in range(cp):
            products = block_schedule(r, src, cp, bias.causal, zigzag)
            _backward_products(shard(q, r), kvs[src], shard(grad, r), outs[r], lses[r], dq, dkvs[src], scale,
                               products, at(r, src))  # fmt: skip
        dqs.append(dq)
    return outs, dqs, [d[0] for d in dkvs], [d[1] for d in dkvs], shard


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize(
    ("form", "causal", "zigzag"),
    [
        (DistanceForm.KEY_MINUS_QUERY, True, True),
        (DistanceForm.KEY_MINUS_QUERY, True, False),
        (DistanceForm.NEGATIVE_ABSOLUTE, False, True),
        (DistanceForm.KEY_MINUS_QUERY, False, False),
    ],
)
def test_emulated_ring_with_alibi_matches_dense_attention(cp, form, causal, zigzag):
    """Every rank's biased blocks merge to dense SDPA with the whole sequence's ALiBi mask, gradients too."""
    s = 4 * cp
    q, k, v = (t.requires_grad_() for t in _qkv(4, 2, s, s, seed=cp))
    grad = torch.randn_like(q)
    bias = LinearBias(SLOPES, form, causal)
    pos = torch.arange(s)
    dense = bias.scores(pos, pos)[None]
    if causal:
        dense = dense.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    ref_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    ref = (ref_out.detach(), *torch.autograd.grad(ref_out, (q, k, v), grad))
    outs, dqs, dks, dvs, shard = _emulated_biased_ring(q.detach(), k.detach(), v.detach(), cp, zigzag, grad, bias)
    for r in range(cp):
        for name, got, want in zip(("out", "dq", "dk", "dv"), (outs[r], dqs[r], dks[r], dvs[r]), ref):
            torch.testing.assert_close(got, shard(want, r), rtol=1e-5, atol=1e-5, msg=f"rank {r} {name}")
