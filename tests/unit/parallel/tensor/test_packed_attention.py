"""nn.MultiheadAttention under tensor parallelism, in one process: t copies of the module each
holding one rank's cut (``TensorShard`` of in_proj_weight / in_proj_bias / out_proj.weight, as
``TensorParallel`` cuts them), run with ``run_local_heads``; the sum of their out_proj partials
plus the bias (what g computes) and their gradients must equal the unsharded module's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.mha_parts import MhaPartsError
from lightning_5d.parallel.tensor.packed_attention import PackedAttentionError, map_qkv_inputs, run_local_heads
from lightning_5d.parallel.tensor.sharding import TensorShard

E, H = 16, 4


def _shards(full: nn.MultiheadAttention, tp: int) -> list[nn.MultiheadAttention]:
    """Rank copies of ``full``: [q_r|k_r|v_r] rows, the out_proj columns of the rank's heads, and an
    out_proj that returns its partial product (the test adds the partials and the bias, as g does)."""
    qkv = TensorShard(0, (E, E, E))
    ranks = []
    for r in range(tp):
        m = copy.deepcopy(full)
        m.in_proj_weight = nn.Parameter(qkv.take(full.in_proj_weight.detach(), r, tp).clone())
        if full.in_proj_bias is not None:
            m.in_proj_bias = nn.Parameter(qkv.take(full.in_proj_bias.detach(), r, tp).clone())
        m.out_proj.weight = nn.Parameter(TensorShard(1).take(full.out_proj.weight.detach(), r, tp).clone())
        for extra in ("bias_k", "bias_v"):
            if getattr(full, extra) is not None:
                setattr(m, extra, nn.Parameter(TensorShard(2).take(getattr(full, extra).detach(), r, tp).clone()))
        m.out_proj.forward = lambda x, m=m: F.linear(x, m.out_proj.weight)
        run_local_heads(m, r, tp)
        ranks.append(m)
    return ranks


def _sharded_call(ranks, full, *args, **kwargs):
    out = sum(m(*args, **kwargs)[0] for m in ranks)
    return out if full.out_proj.bias is None else out + full.out_proj.bias


def _causal(n):
    return nn.Transformer.generate_square_subsequent_mask(n)


CASES = {
    # name: (batch_first, bias, input shape, call keyword arguments builder, module options)
    "encoder causal, is_causal": (True, True, (2, 6), lambda n, b: {"attn_mask": _causal(n), "is_causal": True}),
    "seq-first, float mask": (False, True, (2, 6), lambda n, b: {"attn_mask": _causal(n)}),
    "bool mask + padding": (
        True,
        False,
        (3, 5),
        lambda n, b: {
            "attn_mask": torch.ones(n, n, dtype=torch.bool).triu(1),
            "key_padding_mask": torch.tensor([[False] * n, [False] * (n - 2) + [True] * 2, [False] * n])[:b],
        },
    ),
    "causal + padding": (
        True,
        True,
        (3, 5),
        lambda n, b: {
            "attn_mask": _causal(n),
            "is_causal": True,
            "key_padding_mask": torch.tensor([[False] * n, [False] * (n - 1) + [True], [False] * n])[:b],
        },
    ),
    "per-head 3-D mask": (True, True, (2, 5), lambda n, b: {"attn_mask": torch.randn(b * H, n, n)}),
    "no mask, unbatched": (True, True, (None, 5), lambda n, b: {}),
    "add_bias_kv + add_zero_attn, per-head mask": (
        True,
        True,
        (2, 5),
        lambda n, b: {"attn_mask": torch.randn(b * H, n, n)},
        {"add_bias_kv": True, "add_zero_attn": True},
    ),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_the_heads_of_tp_ranks_sum_to_the_module(case, tp):
    batch_first, bias, (b, n), kwargs_of, *options = CASES[case]
    torch.manual_seed(0)
    full = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, **(options or [{}])[0]).double()
    ranks = _shards(full, tp)
    shape = (n, E) if b is None else ((b, n, E) if batch_first else (n, b, E))
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    kwargs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in kwargs_of(n, b or 1).items()}  # fmt: skip
    if b is None:
        kwargs.pop("attn_mask", None)
    expected = full(x, x, x, need_weights=False, **kwargs)[0]
    got = _sharded_call(ranks, full, x, x, x, need_weights=False, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)

    grad = torch.randn_like(expected)
    (gx_full,) = torch.autograd.grad(expected, x, grad, retain_graph=True)
    (gx,) = torch.autograd.grad(got, x, grad, retain_graph=True)
    torch.testing.assert_close(gx, gx_full)  # the sum over ranks f computes in backward
    expected.backward(grad)
    got.backward(grad)
    qkv = TensorShard(0, (E, E, E))
    for r, m in enumerate(ranks):
        torch.testing.assert_close(m.in_proj_weight.grad, qkv.take(full.in_proj_weight.grad, r, tp))
        torch.testing.assert_close(m.out_proj.weight.grad, TensorShard(1).take(full.out_proj.weight.grad, r, tp))
        if bias:
            torch.testing.assert_close(m.in_proj_bias.grad, qkv.take(full.in_proj_bias.grad, r, tp))
        if full.bias_k is not None:
            torch.testing.assert_close(m.bias_k.grad, TensorShard(2).take(full.bias_k.grad, r, tp))
            torch.testing.assert_close(m.bias_v.grad, TensorShard(2).take(full.bias_v.grad, r, tp))


def test_cross_attention_with_other_key_and_value():
    torch.manual_seed(1)
    full = nn.MultiheadAttention(E, H, batch_first=True).double()
    ranks = _shards(full, 2)
    q, kv = torch.randn(2, 4, E, dtype=torch.float64), torch.randn(2, 7, E, dtype=torch.float64)
    expected = full(q, kv, kv, need_weights=False)[0]
    torch.testing.assert_close(_sharded_call(ranks, full, q, kv, kv, need_weights=False), expected)


def test_need_weights_is_refused_with_the_fix():
    ranks = _shards(nn.MultiheadAttention(E, H, batch_first=True), 2)
    x = torch.randn(1, 3, E)
    with pytest.raises(MhaPartsError, match="tp=2 .*need_weights=True.*2 of 4.*Pass need_weights=False"):
        ranks[0](x, x, x)  # torch's default need_weights=True


def test_f_runs_once_per_distinct_input_and_sequence_parallelism_refuses_cross_attention():
    calls = []

    def f(t):
        calls.append(t)
        return t * 2

    x, memory = torch.ones(2), torch.zeros(2)
    args, kwargs = map_qkv_inputs((x, x), {"value": x, "need_weights": False}, f, shared_only=True, where="a")
    assert len(calls) == 1 and args[0] is args[1] is kwargs["value"] and kwargs["need_weights"] is False
    args, _ = map_qkv_inputs((x, memory, memory), {}, f, shared_only=False, where="a")
    assert len(calls) == 3 and args[1] is args[2]
    with pytest.raises(PackedAttentionError, match="sequence_parallel=false"):
        map_qkv_inputs((x, memory, memory), {}, f, shared_only=True, where="a")
