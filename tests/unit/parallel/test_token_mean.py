"""The step's cross-entropy over pipeline microbatches: pp's mean over them is the batch's token mean.

One process, no group (size 1): each test runs a "pipeline" by hand, one microbatch after the
other under :class:`TokenMean` with the run's :class:`MicrobatchWeights`, backpropagates the
microbatches' mean as pp does (1/m), combines their values with the counts the weights record (as
the pipeline combines logged means) and compares both with one cross-entropy over the whole batch.
The groups' all-reduce is tested across processes (tests/distributed/test_token_mean.py).
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_5d.parallel.pipeline.batch import _weighted_mean
from lightning_5d.parallel.token_mean import (
    MicrobatchWeights,
    Relation,
    TokenMean,
    TokenMeanError,
    find_targets,
)

ONE = (None, 1)  # a group of one rank

VOCAB, SEQ = 11, 6


def batch_with_prompts(prompts: list[int], shifted: bool = False) -> dict:
    """Sample i's first prompts[i] targets masked with -100 (``shifted``: labels equal to the inputs)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (len(prompts), SEQ + 1), generator=g)
    inputs, labels = ids[:, :-1], (ids[:, :-1] if shifted else ids[:, 1:]).clone()
    for row, k in enumerate(prompts):
        labels[row, : k + 1 if shifted else k] = -100
    return {"input_ids": inputs, "labels": labels}


def loss_of(logits: torch.Tensor, labels: torch.Tensor, shifted: bool, **kwargs) -> torch.Tensor:
    if shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **kwargs)


def cut(batch, m: int, j: int):
    if isinstance(batch, dict):
        return {k: v.chunk(m)[j] for k, v in batch.items()}
    return tuple(v.chunk(m)[j] for v in batch)


def pipeline_run(batch, m: int, step) -> tuple[torch.Tensor, float]:
    """pp on one batch: (the loss it backpropagates, each microbatch's under the run's weights times 1/m;
    the step's value as the pipeline logs it, the microbatches' values weighted by the recorded counts)."""
    microbatches = [cut(batch, m, j) for j in range(m)]
    current, recorded = [-1], []
    weights = MicrobatchWeights(lambda: (current[0], microbatches), shifts=True, record=recorded.append)
    values = []
    for j, mb in enumerate(microbatches):
        current[0] = j
        with TokenMean(ONE, ONE, microbatches=weights):
            values.append(step(mb))
    logged = _weighted_mean([float(v.detach()) for v in values], recorded[-1] if recorded else None)
    return sum(values) / m, logged


def logits_for(batch: dict, weight: torch.Tensor) -> torch.Tensor:
    return F.one_hot(batch["input_ids"], VOCAB).float() @ weight


@pytest.mark.parametrize("shifted", [False, True], ids=["aligned labels", "labels shifted in the step"])
@pytest.mark.parametrize("prompts", [[0, 5, 1, 2], [6, 6, 0, 3], [0, 0, 0, 0]], ids=["uneven", "empty mb", "none"])
def test_microbatch_means_weighted_to_the_batch_mean(shifted, prompts):
    batch = batch_with_prompts(prompts, shifted)
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    whole = loss_of(logits_for(batch, weight), batch["labels"], shifted)
    (expected,) = torch.autograd.grad(whole, weight)
    piped, logged = pipeline_run(batch, 2, lambda mb: loss_of(logits_for(mb, weight), mb["labels"], shifted))
    (got,) = torch.autograd.grad(piped, weight)
    assert abs(logged - float(whole.detach())) <= 1e-6
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    unweighted = sum(loss_of(logits_for(mb, weight), mb["labels"], shifted) for mb in
                     [{k: v.chunk(2)[j] for k, v in batch.items()} for j in range(2)]) / 2  # fmt: skip
    if prompts == [0, 5, 1, 2]:  # what pp computed before: the mean of the microbatches' means
        assert abs(float(unweighted.detach()) - float(whole.detach())) > 1e-3


def test_class_weights_count_and_sums_are_left_as_they_are():
    batch = batch_with_prompts([0, 5, 1, 2])
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    classes = torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)) + 0.5
    whole = loss_of(logits_for(batch, weight), batch["labels"], False, weight=classes)
    (expected,) = torch.autograd.grad(whole, weight)
    piped, logged = pipeline_run(batch, 2, lambda mb: loss_of(logits_for(mb, weight), mb["labels"], False,
                                                              weight=classes))  # fmt: skip
    torch.testing.assert_close(torch.autograd.grad(piped, weight)[0], expected, rtol=1e-6, atol=1e-7)
    assert abs(logged - float(whole.detach())) <= 1e-6
    # A sum is the part's own: the step may divide it by its own count (HF's num_items_in_batch).
    mb = cut(batch, 2, 0)
    with TokenMean(ONE, ONE, microbatches=MicrobatchWeights(lambda: (0, [mb, mb]), shifts=True)):
        summed = loss_of(logits_for(mb, weight), mb["labels"], False, reduction="sum")
    torch.testing.assert_close(summed, loss_of(logits_for(mb, weight), mb["labels"], False, reduction="sum"))


def test_two_call_sites_weighted_apart():
    batch = batch_with_prompts([0, 5, 1, 2])
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))

    def two_losses(b):  # the step's main loss and a second one over the shifted targets
        return loss_of(logits_for(b, weight), b["labels"], False) + 0.5 * loss_of(logits_for(b, weight),
                                                                                  b["labels"], True)  # fmt: skip

    weight.requires_grad_(True)
    (expected,) = torch.autograd.grad(two_losses(batch), weight)
    piped, _ = pipeline_run(batch, 2, two_losses)
    torch.testing.assert_close(torch.autograd.grad(piped, weight)[0], expected, rtol=1e-6, atol=1e-7)


def test_targets_masked_inside_the_step_are_refused_under_uneven_counts():
    batch = batch_with_prompts([0, 0, 0, 0])
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    prompts = torch.tensor([0, 5, 1, 2])
    batch["prompt"] = prompts

    def masked_in_step(b):
        labels = b["labels"].clone()
        labels[torch.arange(SEQ) < b["prompt"][:, None]] = -100
        return loss_of(logits_for(b, weight), labels, False)

    with pytest.raises(TokenMeanError, match=r"counted 9 targets in pipeline microbatch 1 of 2, and an earlier "
                       r"microbatch 7, while its targets are no tensor of the batch.*instead of masking targets "
                       r"inside the step"):  # fmt: skip
        pipeline_run(batch, 2, masked_in_step)
    batch["prompt"] = torch.tensor([1, 2, 2, 1])  # the same count in each microbatch: exact, and it runs
    (expected,) = torch.autograd.grad(masked_in_step(batch), weight)
    piped, _ = pipeline_run(batch, 2, masked_in_step)
    torch.testing.assert_close(torch.autograd.grad(piped, weight)[0], expected, rtol=1e-6, atol=1e-7)
    # A value computed without gradients (a metric, validation): not refused, logged unweighted, with a warning.
    with torch.no_grad(), pytest.warns(UserWarning, match="logged means are combined unweighted"):
        batch["prompt"] = torch.tensor([0, 5, 1, 2])
        _, logged = pipeline_run(batch, 2, masked_in_step)
        halves = [float(masked_in_step(cut(batch, 2, j))) for j in range(2)]
    assert logged == pytest.approx(sum(halves) / 2)


def test_no_labels_in_the_batch_needs_equal_counts():
    batch = batch_with_prompts([0, 5, 1, 2])
    tokens = {"tokens": torch.cat([batch["input_ids"], batch["input_ids"][:, :1]], 1)}  # no 'labels' entry
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def shifts_itself(b, ignore=None):
        logits, targets = logits_for({"input_ids": b["tokens"][:, :-1]}, weight), b["tokens"][:, 1:].clone()
        if ignore is not None:
            targets[targets == ignore] = -100
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    piped, logged = pipeline_run(tokens, 2, shifts_itself)  # targets: tokens[..., 1:], all counted
    assert abs(logged - float(shifts_itself(tokens).detach())) <= 1e-6
    ignored = int(tokens["tokens"][0, 1])
    with pytest.raises(TokenMeanError, match="its targets are no tensor of the batch"):
        pipeline_run(tokens, 2, lambda b: shifts_itself(b, ignored))


def test_targets_found_by_their_values_in_any_layout_of_the_batch():
    """Labels equal to the inputs whose first target is masked in microbatch 0 only (counts of the labels
    and of the shifted labels tie there), a tuple batch with an attention mask after its labels, and
    Hugging Face's padded shift: each is read from the tensor the targets are, and is exact."""
    shifted = batch_with_prompts([1, 1, 0, 0], shifted=True)
    shifted["labels"][2:, 0] = 5  # microbatch 1's first labels counted by the unshifted labels only
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def hf_style(b, pad=False):
        labels = F.pad(b["labels"], (0, 1), value=-100)[..., 1:] if pad else b["labels"][..., 1:]
        logits = logits_for(b, weight)
        return F.cross_entropy((logits if pad else logits[:, :-1]).flatten(0, 1), labels.flatten())

    aligned = batch_with_prompts([0, 5, 1, 2])
    as_tuple = (aligned["input_ids"], aligned["labels"], torch.ones_like(aligned["input_ids"]))
    cases = [(shifted, hf_style), (shifted, lambda b: hf_style(b, pad=True)),
             (as_tuple, lambda b: loss_of(logits_for({"input_ids": b[0]}, weight), b[1], False))]  # fmt: skip
    for batch, step in cases:
        (expected,) = torch.autograd.grad(step(batch), weight)
        piped, logged = pipeline_run(batch, 2, step)
        torch.testing.assert_close(torch.autograd.grad(piped, weight)[0], expected, rtol=1e-6, atol=1e-7)
        assert abs(logged - float(step(batch).detach())) <= 1e-6
    labels = shifted["labels"]
    assert find_targets(shifted, labels[..., 1:], -100, shifts=True) == [(0, Relation.SHIFTED)]
    assert find_targets(shifted, labels[..., 1:], -100, shifts=False) == []  # cp: no shifted targets
    assert find_targets(as_tuple, as_tuple[1], -100, shifts=True) == [(1, Relation.EQUAL)]


def test_targets_equal_to_the_inputs_in_a_microbatch_that_masks_nothing_are_read_from_the_labels():
    """A tuple (input_ids, labels, attention_mask) with labels equal to the inputs, -100 on left padding in
    microbatch 1 only: in microbatch 0 the step's targets labels[:, 1:] equal input_ids[:, 1:] too, which
    count differently in microbatch 1. The tensor that holds -100 in the run is the labels."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels = ids.clone()
    labels[2:, :2] = -100  # left padding in microbatch 1
    batch = (ids, labels, torch.ones_like(ids))
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def step(b):
        logits = logits_for({"input_ids": b[0]}, weight)[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), b[1][:, 1:].flatten())

    assert find_targets(cut(batch, 2, 0), labels[:2, 1:], -100, shifts=True) == [(0, Relation.SHIFTED),
                                                                                 (1, Relation.SHIFTED)]  # fmt: skip
    (expected,) = torch.autograd.grad(step(batch), weight)
    piped, logged = pipeline_run(batch, 2, step)
    torch.testing.assert_close(torch.autograd.grad(piped, weight)[0], expected, rtol=1e-6, atol=1e-7)
    assert abs(logged - float(step(batch).detach())) <= 1e-6


def test_per_token_and_legacy_calls_are_left_as_they_are():
    batch = batch_with_prompts([0, 5, 1, 2])
    logits = logits_for(batch, torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)))
    microbatches = [{k: v.chunk(2)[j] for k, v in batch.items()} for j in range(2)]
    weights = MicrobatchWeights(lambda: (1, microbatches), shifts=True)
    with TokenMean(ONE, ONE, microbatches=weights):
        per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        legacy = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), size_average=False)
    torch.testing.assert_close(per_token, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                          reduction="none"))  # fmt: skip
    torch.testing.assert_close(legacy, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                       reduction="sum"))  # fmt: skip
