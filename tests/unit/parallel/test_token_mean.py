"""The step's cross-entropy over pipeline microbatches: pp's mean over them is the batch's token mean.

One process, no group (size 1): each test runs a "pipeline" by hand, one microbatch after the
other under :class:`TokenMean` with the run's :class:`MicrobatchWeights`, averages the microbatches'
values as pp does (1/m) and compares value and gradient with one cross-entropy over the whole batch.
The groups' all-reduce is tested across processes (tests/distributed/test_token_mean.py).
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_5d.parallel.token_mean import (
    MicrobatchWeights,
    TokenMean,
    TokenMeanError,
    find_labels,
    label_counts,
)

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


def pipeline_run(batch: dict, m: int, step) -> torch.Tensor:
    """pp's loss for one batch: each microbatch's step under the run's weights, averaged (1/m)."""
    microbatches = [{k: v.chunk(m)[j] for k, v in batch.items()} for j in range(m)]
    current = [-1]
    weights = MicrobatchWeights(lambda: (current[0], microbatches), shifted=True)
    total = 0.0
    for j, mb in enumerate(microbatches):
        current[0] = j
        with TokenMean(group=None, size=1, microbatches=weights):
            total = total + step(mb)
    return total / m


def logits_for(batch: dict, weight: torch.Tensor) -> torch.Tensor:
    return F.one_hot(batch["input_ids"], VOCAB).float() @ weight


@pytest.mark.parametrize("shifted", [False, True], ids=["aligned labels", "labels shifted in the step"])
@pytest.mark.parametrize("prompts", [[0, 5, 1, 2], [6, 6, 0, 3], [0, 0, 0, 0]], ids=["uneven", "empty mb", "none"])
def test_microbatch_means_weighted_to_the_batch_mean(shifted, prompts):
    batch = batch_with_prompts(prompts, shifted)
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    whole = loss_of(logits_for(batch, weight), batch["labels"], shifted)
    (expected,) = torch.autograd.grad(whole, weight)
    piped = pipeline_run(batch, 2, lambda mb: loss_of(logits_for(mb, weight), mb["labels"], shifted))
    (got,) = torch.autograd.grad(piped, weight)
    torch.testing.assert_close(piped, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    unweighted = sum(loss_of(logits_for(mb, weight), mb["labels"], shifted) for mb in
                     [{k: v.chunk(2)[j] for k, v in batch.items()} for j in range(2)]) / 2  # fmt: skip
    if prompts == [0, 5, 1, 2]:  # what pp computed before: the mean of the microbatches' means
        assert abs(float(unweighted.detach()) - float(whole.detach())) > 1e-3


def test_a_sum_is_the_batch_sum_and_class_weights_count():
    batch = batch_with_prompts([0, 5, 1, 2])
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    classes = torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)) + 0.5
    for kwargs in ({"reduction": "sum"}, {"weight": classes}):
        whole = loss_of(logits_for(batch, weight), batch["labels"], False, **kwargs)
        piped = pipeline_run(batch, 2, lambda mb: loss_of(logits_for(mb, weight), mb["labels"], False, **kwargs))
        torch.testing.assert_close(piped, whole, rtol=1e-6, atol=1e-6)


def test_two_call_sites_weighted_apart():
    batch = batch_with_prompts([0, 5, 1, 2])
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))

    def two_losses(b):  # the step's main loss and a second one over the shifted targets
        return loss_of(logits_for(b, weight), b["labels"], False) + 0.5 * loss_of(logits_for(b, weight),
                                                                                  b["labels"], True)  # fmt: skip

    torch.testing.assert_close(pipeline_run(batch, 2, two_losses), two_losses(batch), rtol=1e-6, atol=1e-7)


def test_targets_masked_inside_the_step_are_refused_under_uneven_counts():
    batch = batch_with_prompts([0, 0, 0, 0])
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))
    prompts = torch.tensor([0, 5, 1, 2])
    batch["prompt"] = prompts

    def masked_in_step(b):
        labels = b["labels"].clone()
        labels[torch.arange(SEQ) < b["prompt"][:, None]] = -100
        return loss_of(logits_for(b, weight), labels, False)

    with pytest.raises(TokenMeanError, match=r"counted 9 targets in pipeline microbatch 1 of 2, and an earlier "
                       r"microbatch 7, while no labels of the batch"):  # fmt: skip
        pipeline_run(batch, 2, masked_in_step)
    batch["prompt"] = torch.tensor([0, 0, 1, 2])  # microbatch 0 counts what the labels say, microbatch 1 not
    with pytest.raises(TokenMeanError, match=r"counted 9 targets in pipeline microbatch 1 of 2, where the labels of "
                       r"the batch hold 12 there.*instead of masking targets inside the step"):  # fmt: skip
        pipeline_run(batch, 2, masked_in_step)
    batch["prompt"] = torch.tensor([1, 2, 2, 1])  # the same count in each microbatch: exact, and it runs
    torch.testing.assert_close(pipeline_run(batch, 2, masked_in_step), masked_in_step(batch))


def test_no_labels_in_the_batch_needs_equal_counts():
    batch = batch_with_prompts([0, 5, 1, 2])
    tokens = {"tokens": torch.cat([batch["input_ids"], batch["input_ids"][:, :1]], 1)}  # no 'labels' entry
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))

    def shifts_itself(b, ignore=None):
        logits, targets = logits_for({"input_ids": b["tokens"][:, :-1]}, weight), b["tokens"][:, 1:].clone()
        if ignore is not None:
            targets[targets == ignore] = -100
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.testing.assert_close(pipeline_run(tokens, 2, shifts_itself), shifts_itself(tokens))
    ignored = int(tokens["tokens"][0, 1])
    with pytest.raises(TokenMeanError, match="no labels of the batch"):
        pipeline_run(tokens, 2, lambda b: shifts_itself(b, ignored))


def test_per_token_and_legacy_calls_are_left_as_they_are():
    batch = batch_with_prompts([0, 5, 1, 2])
    logits = logits_for(batch, torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)))
    microbatches = [{k: v.chunk(2)[j] for k, v in batch.items()} for j in range(2)]
    weights = MicrobatchWeights(lambda: (1, microbatches), shifted=True)
    with TokenMean(group=None, size=1, microbatches=weights):
        per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        legacy = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), size_average=False)
    torch.testing.assert_close(per_token, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                          reduction="none"))  # fmt: skip
    torch.testing.assert_close(legacy, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                       reduction="sum"))  # fmt: skip


def test_find_labels_and_label_counts():
    labels = torch.tensor([[-100, 1, 2], [-100, -100, 3]])
    assert find_labels({"input_ids": labels, "labels": labels}) is labels
    assert find_labels({"input_ids": labels, "target": labels}) is labels
    assert find_labels((labels.float(), labels)) is labels
    assert find_labels({"input_ids": labels}) is None
    assert find_labels({"labels": labels.float()}) is None  # probability targets: every row counts
    bound = {"input": None, "ignore_index": -100}
    assert float(label_counts(bound, labels, shifted=False)) == 3
    assert float(label_counts(bound, labels, shifted=True)) == 3
    assert float(label_counts({**bound, "ignore_index": 3}, labels, shifted=False)) == 5
