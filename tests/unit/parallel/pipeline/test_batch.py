"""Microbatches in, one step's output and logs out: the pieces that need no processes."""

import pytest
import torch

from lightning_5d.parallel.pipeline.batch import PipelineError, _combine_logs, merge_step_outputs, split_microbatches


def test_split_microbatches_cuts_every_tensor_and_keeps_the_rest():
    batch = {"input_ids": torch.arange(16).view(8, 2), "labels": torch.arange(8), "name": "x"}
    mbs = split_microbatches(batch, 4)
    assert len(mbs) == 4
    assert torch.equal(torch.cat([m["input_ids"] for m in mbs]), batch["input_ids"])
    assert all(m["name"] == "x" and m["labels"].shape == (2,) for m in mbs)


def test_a_batch_that_does_not_divide_names_both_numbers():
    with pytest.raises(PipelineError, match="batch of 6 samples does not split into pipeline.microbatches=4"):
        split_microbatches({"input_ids": torch.zeros(6, 3)}, 4)


def test_merge_step_outputs():
    assert merge_step_outputs([torch.tensor(1.0), torch.tensor(3.0)]).item() == 2.0
    merged = merge_step_outputs([{"loss": torch.tensor(2.0), "x": torch.ones(2, 3)}] * 2)
    assert merged["loss"].item() == 2.0 and merged["x"].shape == (4, 3)
    assert merge_step_outputs([None, None]) is None


def test_logged_values_are_averaged_over_microbatches_with_their_options():
    logs = _combine_logs([[("loss", 1.0, {"prog_bar": True})], [("loss", 2.0, {"prog_bar": True})]])
    assert logs == [("loss", 1.5, {"prog_bar": True})]


def test_logged_values_follow_their_reduce_fx():
    logs = _combine_logs(
        [
            [("n", 3.0, {"reduce_fx": "sum"}), ("m", 1.0, {"reduce_fx": max})],
            [("n", 4.0, {"reduce_fx": "sum"}), ("m", 5.0, {"reduce_fx": max})],
        ]
    )
    assert dict((k, v) for k, v, _ in logs) == {"n": 7.0, "m": 5.0}


def test_means_weighted_by_the_targets_each_microbatch_counts():
    """parallel/token_mean.py gives the first cross-entropy's counts: means logged in every microbatch and
    returned scalars are weighted by them (a microbatch with none adds nothing, NaN included); sums,
    counts and a name logged by some microbatches only are not."""
    weights = [3.0, 1.0, 0.0]
    records = [[("loss", 1.0, {}), ("hits", 3, {}), ("x", 5.0, {})], [("loss", 5.0, {}), ("hits", 1, {})],
               [("loss", float("nan"), {}), ("hits", 0, {})]]  # fmt: skip
    assert _combine_logs(records, weights) == [("loss", 2.0, {}), ("hits", 4.0, {}), ("x", 5.0, {})]
    merged = merge_step_outputs([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(5.0)}, {"loss": torch.tensor(7.0)}],
                                weights)  # fmt: skip
    assert merged["loss"].item() == 2.0
    assert merge_step_outputs([torch.tensor(1.0), torch.tensor(5.0)], [0.0, 0.0]).item() == 3.0  # no targets
    twice = [[("a", 1.0, {}), ("a", 7.0, {})], []]  # logged twice by one microbatch: which weight is whose?
    assert _combine_logs(twice, [1.0, 3.0]) == [("a", 4.0, {})]
