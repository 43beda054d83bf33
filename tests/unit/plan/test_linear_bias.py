"""Reading an attn_mask as ALiBi (slopes x token distances): what is proven, what is not, and
which written forms are the same attention (issue 22: ALiBi under context parallelism)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_5d.plan.arange_flow import ArangeFlow
from lightning_5d.plan.linear_bias import DistanceForm, LinearBias, read_linear_bias

H, N = 4, 8
SLOPES = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])  # Press et al.'s slopes
POS = torch.arange(N)
ABOVE = POS[None, :] > POS[:, None]  # j > i: the causal mask's -inf


def written(form: str) -> torch.Tensor:
    """The bias as models write it, [H, N, N] fp32, before any mask."""
    i, j = POS[:, None].float(), POS[None, :].float()
    distance = {"j - i": j - i, "j": j.expand(N, N), "-|i - j|": -(i - j).abs()}[form]
    return SLOPES[:, None, None] * distance


CAUSAL_FORMS = ["j - i", "j", "-|i - j|"]


@pytest.mark.parametrize("form", CAUSAL_FORMS)
def test_the_three_causal_forms_read_as_one_bias_and_give_one_attention(form):
    """m·(j − i), m·j and −m·|i − j| under the causal mask: one LinearBias, and on the probe SDPA
    gives the same output for each (m·j differs by the per-row constant m·i; −|i − j| = j − i on
    every kept entry j ≤ i)."""
    mask = written(form).masked_fill(ABOVE, float("-inf"))
    bias = read_linear_bias(mask)
    assert bias == LinearBias(tuple(SLOPES.tolist()), DistanceForm.KEY_MINUS_QUERY, causal=True)
    q, k, v = (torch.randn(1, H, N, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    rebuilt = bias.scores(POS, POS).masked_fill(ABOVE, float("-inf"))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=rebuilt), rtol=1e-6, atol=1e-6)  # fmt: skip
    if form == "j - i":
        assert torch.equal(bias.scores(POS, POS)[:, ~ABOVE], written(form)[:, ~ABOVE])  # bit for bit


def test_without_the_causal_mask_the_symmetric_form_is_another_attention():
    """Unmasked, m·j is still m·(j − i) (a per-row constant), but −m·|i − j| differs on j > i by
    −2m·(j − i): its own form, and a different output."""
    relative, key, symmetric = (read_linear_bias(written(f)) for f in ("j - i", "j", "-|i - j|"))
    assert relative == key and relative.form is DistanceForm.KEY_MINUS_QUERY and not relative.causal
    assert symmetric.form is DistanceForm.NEGATIVE_ABSOLUTE and symmetric.slopes == relative.slopes
    q, k, v = (torch.randn(1, H, N, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=written("j - i"))
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=written("-|i - j|"))
    assert (a - b).abs().max() > 1e-2
    torch.testing.assert_close(symmetric.scores(POS, POS), written("-|i - j|"))


def test_shapes_models_pass():
    mask = written("j - i").masked_fill(ABOVE, float("-inf"))
    expected = read_linear_bias(mask)
    assert read_linear_bias(mask[None]) == expected  # [1, H, N, N]
    assert read_linear_bias(mask[None].expand(3, H, N, N)) == expected  # a batch of copies
    shared = read_linear_bias(mask[1])  # [N, N]: one bias for every head
    assert shared.slopes == (SLOPES[1].item(),) and shared.causal
    plain_causal = read_linear_bias(torch.zeros(N, N).masked_fill(ABOVE, float("-inf")))
    assert plain_causal.slopes == (0.0,)  # a float causal mask: slope 0
    half = read_linear_bias(mask.half())
    assert half is not None and half.slopes == tuple(SLOPES.half().tolist())


def _not_alibi():
    alibi = written("j - i").masked_fill(ABOVE, float("-inf"))
    window = alibi.masked_fill(POS[:, None] - POS[None, :] > 3, float("-inf"))  # a sliding window
    padded = alibi.clone()
    padded[..., 0] = float("-inf")  # a padded first key
    squared = (SLOPES[:, None, None] * -((POS[:, None] - POS[None, :]).float() ** 2)).masked_fill(ABOVE, float("-inf"))
    per_sample = torch.stack([alibi, alibi * 2])  # [2, H, N, N]: the batch's slices differ
    learned = alibi.clone().requires_grad_()
    upper = written("j - i").masked_fill(~ABOVE & (POS[:, None] != POS[None, :]), float("-inf"))  # anti-causal
    return {
        "random": torch.randn(H, N, N),
        "sliding window": window,
        "padding": padded,
        "squared distance": squared,
        "per-sample": per_sample,
        "learned (requires grad)": learned,
        "anti-causal": upper,
        "boolean": ~ABOVE,
        "nan": alibi.masked_fill(POS[None, :] == 2, float("nan")),
        "keys of another length": alibi[..., :-1],
        "one token": alibi[..., :1, :1],
        "none": None,
    }


@pytest.mark.parametrize("name", list(_not_alibi()))
def test_what_is_not_slopes_times_distances_is_not_read(name):
    assert read_linear_bias(_not_alibi()[name]) is None


def test_a_slope_that_changes_along_a_row_is_not_read():
    bias = written("j - i").masked_fill(ABOVE, float("-inf"))
    bias[2, 5, 1] += 1e-3  # one entry off the line: no longer m·(j − i) + c_i
    assert read_linear_bias(bias) is None


# ---------------------------------------------------------------- arange flow (position observation)


def _alibi_from(n, pos):
    d = (pos[None, :] - pos[:, None]).float()
    return (SLOPES[:, None, None] * d).masked_fill(d > 0, float("-inf"))


def test_an_arange_that_only_builds_an_alibi_mask_does_not_reach_the_output():
    q = torch.randn(1, H, N, 8)
    with ArangeFlow() as flow:
        pos = torch.arange(N)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=_alibi_from(N, pos))
    assert len(flow.aranges) == 1 and flow.labels(out) == frozenset()


def test_an_arange_that_reaches_q_or_a_mask_of_another_kind_does():
    q = torch.randn(1, H, N, 8)
    with ArangeFlow() as flow:
        angles = torch.arange(N).float()[:, None] * 0.1  # rotary-like: positions into q
        rotated = q * angles.cos()
        out_q = F.scaled_dot_product_attention(rotated, q, q, is_causal=True)
        pos = torch.arange(N)
        causal = pos[None, :] <= pos[:, None]  # a boolean mask: not a linear bias
        out_mask = F.scaled_dot_product_attention(q, q, q, attn_mask=causal)
        written_into = torch.zeros(N)
        written_into[:] = torch.arange(N)  # x[i] = y marks x
        added = torch.zeros(N)
        added.add_(torch.arange(N))
    assert flow.labels(out_q) == {0} and flow.labels(out_mask) == {1}
    assert flow.labels(written_into) == {2} and flow.labels(added) == {3}


def test_the_check_runs_over_blocks_of_rows(monkeypatch):
    """Every call's mask is read under cp, so the check holds a few rows at a time; a bad entry
    in a later block is still found."""
    import lightning_5d.plan.linear_bias as linear_bias

    monkeypatch.setattr(linear_bias, "_CHUNK", 2 * N)  # two rows per block
    mask = written("j").masked_fill(ABOVE, float("-inf"))
    assert read_linear_bias(mask) == LinearBias(tuple(SLOPES.tolist()), DistanceForm.KEY_MINUS_QUERY, True)
    window = mask.masked_fill(POS[:, None] - POS[None, :] > 5, float("-inf"))  # rows 6, 7 only
    assert read_linear_bias(window) is None
    mask[3, N - 1, 2] += 1e-3
    assert read_linear_bias(mask) is None
