"""The global gradient norm on one process: what it counts (no process groups needed)."""

import torch

from lightning_5d.parallel.grad_norm import clip_grad_norm_, total_grad_norm


def _params(*values):
    out = []
    for v in values:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.tensor(v, dtype=torch.float32)
        out.append(p)
    return out


def test_a_copy_counted_elsewhere_is_left_out_of_the_norm_but_still_clipped():
    a, copy = _params([3.0, 4.0], [30.0, 40.0])
    never = lambda p: False  # noqa: E731
    assert float(total_grad_norm([a, copy], never, None)) > 50
    assert float(total_grad_norm([a, copy], never, None, counted_elsewhere=lambda p: p is copy)) == 5.0
    clip_grad_norm_([a, copy], 1.0, never, None, counted_elsewhere=lambda p: p is copy)
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)
    torch.testing.assert_close(copy.grad, torch.tensor([6.0, 8.0]), rtol=1e-5, atol=0)  # the same coefficient
