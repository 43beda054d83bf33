"""Discovery records which reshapes of an attention forward take a full head count or width
(lightning_5d.plan.shape_sites; single process)."""

import torch

from lightning_5d.plan import discover
from lightning_5d.plan.shape_sites import ShapeSite, shape_call, with_sizes
from nanogpt_style import DIM, HEADS, TinyGPT


def test_nanogpt_style_reshapes_are_recorded_with_their_full_widths_and_head_counts():
    torch.manual_seed(0)
    plan = discover(TinyGPT())
    sites = plan.block_plans[0].attention.shape_sites
    assert [s.op for s in sites] == ["split", "view", "view", "view", "view"]
    split, q_view, *_, merge = sites
    assert split.sizes == (DIM,) and split.divided == (True,) and split.pieces == 3
    # Batch and sequence change between the two probes: not constants. The head count is one; 8 (C // n_head) too.
    assert q_view.sizes == (None, None, HEADS, DIM // HEADS) and q_view.divided == (False, False, True, False)
    assert merge.sizes == (None, None, DIM) and merge.divided == (False, False, True)
    # The three q/k/v views come from one line of the model's code: told apart by their order.
    assert len({s.key for s in sites}) == 5 and len({s.key[:2] for s in sites[1:4]}) == 1
    assert plan.block_plans[1].attention.shape_sites == sites  # the same code in every block


def test_a_site_gives_local_sizes_and_keeps_the_batch_shaped_ones():
    site = ShapeSite(("m.py", 3, 0), "view", (None, None, 4, 8), (False, False, True, False))
    assert site.local_sizes((5, 7, 2, 16), tp=2) == (5, 7, 2, 8)  # heads 4 / 2; head width as observed


def test_shape_calls_are_read_in_each_spelling():
    x = torch.zeros(2, 3, 4)
    assert shape_call(torch.Tensor.view, (x, 2, 12), {}) == ("view", (2, 12))
    assert shape_call(torch.Tensor.reshape, (x, (6, 4)), {}) == ("reshape", (6, 4))
    assert shape_call(torch.Tensor.view, (x, torch.float32), {}) is None  # a dtype view
    assert shape_call(torch.split, (x, [1, 3], 2), {}) == ("split", (1, 3))
    assert shape_call(torch.Tensor.add, (x, 1), {}) is None
    assert with_sizes("split", (x, [1, 3], 2), (2, 2)) == (x, [2, 2], 2)
    assert with_sizes("split", (x, 4), (2,)) == (x, 2)


def test_describe_lists_the_reshapes_tp_gives_local_sizes():
    from lightning_5d.plan import describe

    import re

    text = describe(discover(TinyGPT()))
    # One entry per line of code (the q/k/v views share one): split, the head view, the merge view.
    assert re.search(r"width reshapes +nanogpt_style\.py:\d+ split, nanogpt_style\.py:\d+ view, "
                     r"nanogpt_style\.py:\d+ view\n", text), text  # fmt: skip
