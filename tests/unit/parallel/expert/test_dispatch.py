"""Single-process checks of MoE token dispatch: plan sizes, capacity dropping, regrouping, combine.

``group=None`` is ep=1 (the exchange is the identity); the ep>1 bookkeeping of ``plan_dispatch``
is driven with fake count exchanges, and one test simulates a two-rank all-to-all by hand.
"""

import math

import pytest
import torch
from torch import nn

from lightning_5d.config import DropPolicy
from lightning_5d.parallel.expert.dispatch import (
    _keep_mask,
    _source_major_to_expert_major,
    capacity,
    dispatch_and_combine,
    exchange,
    exchange_counts,
    plan_dispatch,
    run_grouped,
)

T, H, E, K = 13, 8, 4, 2


def _route(tokens, num_experts, k, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g, dtype=dtype)
    top_w, top_i = torch.softmax(logits, -1).topk(k, dim=-1)
    return top_i, top_w / top_w.sum(-1, keepdim=True)


def _experts(num_experts, seed):
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Linear(H, H, dtype=torch.float64) for _ in range(num_experts))


def _runner(experts, first=0):
    def run_local(rows, counts):
        pieces = rows.split(counts)
        return torch.cat([experts[first + j](piece) for j, piece in enumerate(pieces)])

    return run_local


def _naive(x, top_i, top_w, experts, keep=None):
    """sum_k w_k * expert_{e_k}(x_t), one token and one slot at a time; ``keep`` masks slots."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for s in range(top_i.shape[1]):
            if keep is None or keep[t, s]:
                acc = acc + top_w[t, s] * experts[int(top_i[t, s])](x[t])
        rows.append(acc)
    return torch.stack(rows)


def _identity_counts(send):
    return send


# --------------------------------------------------------------------------- dropless, ep=1


def test_dropless_output_and_gradients_match_the_per_token_loop():
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    top_i, top_w = _route(T, E, K, seed=1)
    experts = _experts(E, seed=2)
    params = list(experts.parameters())

    x1 = x.clone().requires_grad_()
    w1 = top_w.clone().requires_grad_()
    plan = plan_dispatch(top_i, w1, E, 1, lambda s: exchange_counts(s, None))
    out = dispatch_and_combine(x1, plan, None, _runner(experts))

    x2 = x.clone().requires_grad_()
    w2 = top_w.clone().requires_grad_()
    ref = _naive(x2, top_i, w2, experts)

    assert out.shape == (T, H)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert plan.dropped == 0

    upstream = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, [x1, w1, *params], upstream)
    want = torch.autograd.grad(ref, [x2, w2, *params], upstream)
    for a, b in zip(got, want):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_exchange_is_identity_without_a_group():
    x = torch.randn(5, 3)
    assert exchange(x, [5], [5], None) is x
    counts = torch.tensor([[2, 3]])
    assert exchange_counts(counts, None) is counts


# --------------------------------------------------------------------------- plan sizes, ep=2


def test_plan_splits_for_two_ranks_and_the_counts_the_fake_exchange_returns():
    top_i, top_w = _route(T, E, K, seed=4)
    seen = []
    received = torch.tensor([[3, 1], [2, 5]])

    def recv_counts(send):
        seen.append(send.clone())
        return received

    plan = plan_dispatch(top_i, top_w, E, 2, recv_counts)

    flat = top_i.flatten().tolist()
    to_rank0 = sum(1 for e in flat if e in (0, 1))
    to_rank1 = sum(1 for e in flat if e in (2, 3))
    assert plan.send_splits == [to_rank0, to_rank1]
    assert sum(plan.send_splits) == T * K
    assert torch.equal(plan.tokens_per_expert, torch.bincount(top_i.flatten(), minlength=E))
    assert torch.equal(plan.kept_per_expert, plan.tokens_per_expert)
    # What is handed to the exchange: row r = counts for rank r's experts.
    per_expert = [flat.count(e) for e in range(E)]
    assert seen[0].tolist() == [per_expert[0:2], per_expert[2:4]]
    assert plan.recv_per_expert == [[3, 1], [2, 5]]
    assert plan.recv_splits == [4, 7]

    # Sorted assignments: experts non-decreasing, tokens and weights follow the order.
    sorted_experts = top_i.flatten()[plan.order]
    assert torch.all(sorted_experts[1:] >= sorted_experts[:-1])
    assert sorted(plan.order.tolist()) == list(range(T * K))
    assert torch.equal(plan.tokens, plan.order // K)
    assert torch.equal(plan.weights, top_w.flatten()[plan.order])


def test_two_rank_dispatch_simulated_by_hand_matches_the_loop():
    """ep=2 with the all-to-all done by hand: rows travel source-major and come back in order."""
    ep, local = 2, E // 2
    experts = _experts(E, seed=5)
    xs = [
        torch.randn(T + r, H, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + r)) for r in range(ep)
    ]
    routes = [_route(T + r, E, K, seed=20 + r) for r in range(ep)]
    sends = [torch.bincount(ti.flatten(), minlength=E).view(ep, local) for ti, _ in routes]

    def recv_for(rank):
        return lambda send: torch.stack([sends[s][rank] for s in range(ep)])

    plans = [plan_dispatch(ti, tw, E, ep, recv_for(r)) for r, (ti, tw) in enumerate(routes)]
    for r in range(ep):
        assert plans[r].send_splits == sends[r].sum(1).tolist()
    # forward all-to-all
    outgoing = [xs[s][plans[s].tokens].split(plans[s].send_splits) for s in range(ep)]
    results = []
    for d in range(ep):
        rows = torch.cat([outgoing[s][d] for s in range(ep)])
        assert rows.shape[0] == sum(plans[d].recv_splits)
        results.append(
            run_grouped(rows, plans[d].recv_per_expert, _runner(experts, first=d * local)).split(plans[d].recv_splits)
        )
    # backward all-to-all, then combine as dispatch_and_combine does
    for s in range(ep):
        back = torch.cat([results[d][s] for d in range(ep)])
        out = torch.zeros_like(xs[s]).index_add(0, plans[s].tokens, back * plans[s].weights.unsqueeze(-1))
        ref = _naive(xs[s], *routes[s], experts)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- capacity


def test_capacity_is_the_rounded_up_share_times_the_factor():
    assert capacity(32, 4, 1.0) == 8
    assert capacity(26, 4, 1.0) == 7
    assert capacity(26, 4, 1.25) == math.ceil(1.25 * 26 / 4) == 9
    assert capacity(1, 8, 0.5) == 1


def _expected_keep(top_i, top_w, cap, policy):
    """Independent keep mask [T, k]: per expert, first `cap` by flat position or by descending weight."""
    t_count, k = top_i.shape
    keep = torch.zeros(t_count, k, dtype=torch.bool)
    for e in range(int(top_i.max()) + 1):
        slots = [(t, s) for t in range(t_count) for s in range(k) if int(top_i[t, s]) == e]
        if policy == DropPolicy.PROBABILITY:
            slots.sort(key=lambda ts: (-float(top_w[ts]), ts))
        for t, s in slots[:cap]:
            keep[t, s] = True
    return keep


def _skewed_route():
    """16 tokens, k=2: tokens 0-11 go to experts (0, 1), tokens 12-15 to (2, 3); distinct weights."""
    tokens = 16
    top_i = torch.tensor([[0, 1]] * 12 + [[2, 3]] * 4)
    g = torch.Generator().manual_seed(7)
    raw = torch.rand(tokens, K, generator=g, dtype=torch.float64) + 0.05
    return top_i, raw / raw.sum(-1, keepdim=True)


@pytest.mark.parametrize("policy", [DropPolicy.PROBABILITY, DropPolicy.POSITION])
def test_capacity_drops_to_the_limit_by_policy(policy):
    top_i, top_w = _skewed_route()
    tokens = top_i.shape[0]
    cap = capacity(tokens * K, E, 1.0)
    assert cap == 8
    plan = plan_dispatch(top_i, top_w, E, 1, _identity_counts, capacity_factor=1.0, drop_policy=policy)

    assert torch.all(plan.kept_per_expert <= cap)
    assert plan.kept_per_expert.tolist() == [8, 8, 4, 4]
    assert plan.tokens_per_expert.tolist() == [12, 12, 4, 4]
    assert plan.dropped == int((plan.tokens_per_expert - plan.kept_per_expert).sum()) == 8
    assert plan.send_splits == [24]
    assert plan.recv_per_expert == [[8, 8, 4, 4]]

    keep = _expected_keep(top_i, top_w, cap, policy)
    kept_flat = sorted(plan.order.tolist())
    assert kept_flat == keep.flatten().nonzero().squeeze(1).tolist()
    if policy == DropPolicy.POSITION:
        # earliest tokens win: 0-7 keep both slots, 8-11 lose both
        assert keep[:8].all() and not keep[8:12].any() and keep[12:].all()
    else:
        # the highest weights win inside each over-full expert
        for e in (0, 1):
            w = top_w[:12, e]
            assert w[keep[:12, e]].min() > w[~keep[:12, e]].max()


@pytest.mark.parametrize("policy", [DropPolicy.PROBABILITY, DropPolicy.POSITION])
def test_dropped_slots_leave_the_output_and_untouched_tokens_match_dropless(policy):
    top_i, top_w = _skewed_route()
    tokens = top_i.shape[0]
    x = torch.randn(tokens, H, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    experts = _experts(E, seed=9)
    run = _runner(experts)

    dropless = dispatch_and_combine(x, plan_dispatch(top_i, top_w, E, 1, _identity_counts), None, run)
    plan = plan_dispatch(top_i, top_w, E, 1, _identity_counts, capacity_factor=1.0, drop_policy=policy)
    capped = dispatch_and_combine(x, plan, None, run)

    keep = _expected_keep(top_i, top_w, capacity(tokens * K, E, 1.0), policy)
    torch.testing.assert_close(capped, _naive(x, top_i, top_w, experts, keep), rtol=1e-12, atol=1e-12)
    whole = keep.all(1)
    assert whole.any() and (~whole).any()
    torch.testing.assert_close(capped[whole], dropless[whole], rtol=1e-12, atol=1e-12)
    none = ~keep.any(1)
    if policy == DropPolicy.POSITION:
        assert none.tolist() == [False] * 8 + [True] * 4 + [False] * 4
    assert torch.equal(capped[none], torch.zeros_like(capped[none]))
    assert (capped[~none].abs().sum(1) > 0).all()


def test_keep_mask_directly():
    experts = torch.tensor([1, 0, 1, 1, 0, 1])
    weights = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.2, 0.7])
    by_prob = _keep_mask(experts, weights, 2, 2, DropPolicy.PROBABILITY)
    by_pos = _keep_mask(experts, weights, 2, 2, DropPolicy.POSITION)
    assert by_prob.tolist() == [False, True, True, False, True, True]
    assert by_pos.tolist() == [True, True, True, False, True, False]


def test_large_capacity_factor_drops_nothing():
    top_i, top_w = _skewed_route()
    plan = plan_dispatch(top_i, top_w, E, 1, _identity_counts, capacity_factor=10.0)
    assert plan.dropped == 0
    assert torch.equal(plan.kept_per_expert, plan.tokens_per_expert)


# --------------------------------------------------------------------------- regrouping


def test_source_major_rows_are_regrouped_expert_major():
    recv = [[1, 2], [3, 0]]
    # source 0: row 0 -> e0, rows 1-2 -> e1; source 1: rows 3-5 -> e0
    assert _source_major_to_expert_major(recv).tolist() == [0, 3, 4, 5, 1, 2]
    assert _source_major_to_expert_major([[0, 0], [0, 0]]).tolist() == []


def test_run_grouped_hands_each_expert_its_rows_and_restores_the_order():
    recv = [[1, 2], [3, 0]]
    rows = torch.arange(6, dtype=torch.float64).unsqueeze(1).repeat(1, 2)
    seen = {}

    def run_local(grouped, counts):
        seen["rows"], seen["counts"] = grouped.clone(), list(counts)
        marks = torch.cat([torch.full((n, 1), 100.0 * (j + 1), dtype=grouped.dtype) for j, n in enumerate(counts)])
        return grouped + marks

    out = run_grouped(rows, recv, run_local)
    assert seen["counts"] == [4, 2]
    assert seen["rows"][:, 0].tolist() == [0, 3, 4, 5, 1, 2]
    expert_of_row = [0, 1, 1, 0, 0, 0]
    want = rows + torch.tensor([100.0 * (e + 1) for e in expert_of_row], dtype=torch.float64).unsqueeze(1)
    assert torch.equal(out, want)


def test_experts_that_return_fresh_zeros_keep_the_rows_in_the_graph():
    # Hugging Face's eager experts return zeros_like(rows) when none of them is hit; the rank
    # must still backpropagate through its all-to-alls, so the result stays in the graph.
    rows = torch.randn(3, 4, requires_grad=True)
    out = run_grouped(rows, [[3, 0]], lambda r, counts: torch.zeros_like(r))
    assert out.requires_grad
    out.sum().backward()
    assert torch.equal(rows.grad, torch.zeros_like(rows))
