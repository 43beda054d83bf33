"""Single-process checks of MoE load balancing: the aux loss, its attachment, the selection bias."""

import pytest
import torch

from lightning_5d.parallel.expert.balance import AttachAuxLoss, load_balancing_loss, update_bias

# --------------------------------------------------------------------------- aux loss


@pytest.mark.parametrize("num_experts", [2, 4, 8])
def test_aux_loss_is_one_when_balanced(num_experts):
    probs = torch.full((12, num_experts), 1.0 / num_experts)
    counts = torch.full((num_experts,), 5)
    assert load_balancing_loss(probs, counts).item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("num_experts", [2, 4, 8])
def test_aux_loss_is_num_experts_when_everything_goes_to_one(num_experts):
    probs = torch.zeros(10, num_experts)
    probs[:, 2 % num_experts] = 1.0
    counts = torch.zeros(num_experts, dtype=torch.long)
    counts[2 % num_experts] = 20
    assert load_balancing_loss(probs, counts).item() == pytest.approx(num_experts, abs=1e-6)


def _random_inputs(tokens=11, num_experts=5):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=g, dtype=torch.float64), -1)
    counts = torch.randint(0, 9, (num_experts,), generator=g)
    counts[0] += 1  # at least one assignment
    return probs, counts


def test_aux_loss_matches_the_formula_on_random_inputs():
    probs, counts = _random_inputs()
    tokens, num_experts = probs.shape
    total = sum(int(c) for c in counts)
    want = 0.0
    for e in range(num_experts):
        f_e = int(counts[e]) / total
        p_e = sum(float(probs[t, e]) for t in range(tokens)) / tokens
        want += f_e * p_e
    want *= num_experts
    assert load_balancing_loss(probs, counts).item() == pytest.approx(want, rel=1e-12)


def test_aux_loss_gradient_wrt_probs():
    probs, counts = _random_inputs()
    tokens, num_experts = probs.shape
    probs = probs.clone().requires_grad_()
    load_balancing_loss(probs, counts).backward()
    # d/dp[t,e] of E * sum_e f_e * mean_t p[t,e] = E * f_e / T, the same for every token
    f = counts.double() / counts.sum()
    want = (num_experts * f / tokens).expand(tokens, num_experts)
    torch.testing.assert_close(probs.grad, want, rtol=1e-12, atol=1e-12)


def test_aux_loss_with_no_assignments_is_zero_not_nan():
    probs = torch.full((3, 4), 0.25)
    assert load_balancing_loss(probs, torch.zeros(4, dtype=torch.long)).item() == 0.0


# --------------------------------------------------------------------------- AttachAuxLoss


@pytest.mark.parametrize("scale", [0.5, 0.01])
def test_attach_aux_loss_is_identity_forward_and_gives_aux_the_scale(scale):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    output = 2.0 * x
    aux = (w**2).sum()  # d aux / d w = 2 w
    y = AttachAuxLoss.apply(output, aux, scale)
    assert torch.equal(y, output)

    upstream = torch.randn(4, 3, generator=g, dtype=torch.float64)
    (y * upstream).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * upstream)  # output gradient unchanged
    torch.testing.assert_close(w.grad, scale * 2.0 * w.detach())  # scale * d aux / d w

    # the aux gradient does not depend on the size of the upstream gradient
    x.grad, w.grad = None, None
    (AttachAuxLoss.apply(2.0 * x, (w**2).sum(), scale) * (3.0 * upstream)).sum().backward()
    torch.testing.assert_close(x.grad, 6.0 * upstream)
    torch.testing.assert_close(w.grad, scale * 2.0 * w.detach())


def test_attach_aux_loss_equals_adding_scale_times_aux_to_the_loss():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    router = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    scale = 0.25

    def parts():
        probs = torch.softmax(x @ router, -1)
        counts = torch.bincount(probs.argmax(-1).detach(), minlength=3)
        return torch.tanh(x), load_balancing_loss(probs, counts)

    out, aux = parts()
    AttachAuxLoss.apply(out, aux, scale).sum().backward()
    got = (x.grad.clone(), router.grad.clone())

    x.grad, router.grad = None, None
    out, aux = parts()
    (out.sum() + scale * aux).backward()
    torch.testing.assert_close(got[0], x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], router.grad, rtol=1e-12, atol=1e-12)
    assert router.grad.abs().sum() > 0


# --------------------------------------------------------------------------- bias update


def test_update_bias_moves_by_exactly_rate_towards_the_under_loaded():
    bias = torch.tensor([0.5, -0.25, 1.0, 0.0, 2.0])
    load = torch.tensor([4, 1, 3, 6, 1])  # mean 3: experts 1 and 4 under, 0 and 3 over, 2 equal
    rate = 0.125
    update_bias(bias, load, rate)
    assert bias.tolist() == [0.5 - rate, -0.25 + rate, 1.0, 0.0 - rate, 2.0 + rate]


def test_update_bias_leaves_an_even_load_alone_and_works_in_place():
    bias = torch.tensor([0.1, 0.2, 0.3])
    before = bias.clone()
    ref = bias
    update_bias(bias, torch.tensor([7, 7, 7]), 0.5)
    assert ref is bias
    assert torch.equal(bias, before)
