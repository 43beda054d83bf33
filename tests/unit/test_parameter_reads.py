"""The parameter-read watch on one process: what a step may compute from parameters that are pieces.

A fake map says what each parameter is "on this rank"; the distributed cases
(tests/distributed/test_parameter_reads.py) check the map the strategy builds and the numbers.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_5d.parameter_reads import ParameterHere, ParameterMap, ParameterReadError, ParameterWatch
from lightning_5d.piece_reads import unwatched


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens):
        # Reductions of the parameters inside the forward are the layout's business, not the watch's.
        scale = self.embed.weight.pow(2).mean()
        return self.head(self.norm(self.embed(tokens))) * (1 + 0 * scale)


def watch_of(model: nn.Module, where: dict | None = None, **options) -> ParameterWatch:
    places = {n: (where or {}).get(n, ParameterHere.WHOLE) for n, _ in model.named_parameters()}
    return ParameterWatch(model, ParameterMap(where=places, sizes={"tp": 2, "ep": 1, "pp": 2}, **options))


def loss_of(model: nn.Module) -> torch.Tensor:
    return F.cross_entropy(model(torch.arange(6).view(2, 3)).flatten(0, 1), torch.arange(6))


def run_step(watch: ParameterWatch, body, *args):
    return watch.step(body, "M.training_step")(*args)


def test_reductions_of_a_shard_are_refused_with_the_fix():
    model = Tiny()
    watch = watch_of(model, {"embed.weight": ParameterHere.TP_SHARD})
    for penalty, op in (
        (lambda m: sum(p.pow(2).sum() for p in m.parameters()), "`sum` reduces"),
        (lambda m: m.embed.weight.pow(2).mean(), "`mean` reduces"),
        (lambda m: torch.nn.utils.parameters_to_vector(m.parameters()).norm(), "reduces"),
        (lambda m: m.embed.weight.data.abs().max(), "`max` reduces"),  # .data keeps the label
        (lambda m: m.embed.weight[0], "`__getitem__` reduces"),  # a row of a shard is not row 0
    ):
        with pytest.raises(ParameterReadError, match=op) as error:
            run_step(watch, lambda: loss_of(model) + penalty(model))
        for words in ("M.training_step", "embed.weight", "tensor-parallel shard (1/2", "weight_decay", "lm_head("):
            assert words in str(error.value)
    # The chunked cross-entropy pattern: logits from the head's weight in the step, outside its module.
    watch = watch_of(model, {"head.weight": ParameterHere.TP_SHARD})
    with pytest.raises(ParameterReadError, match="head.weight"):
        run_step(watch, lambda: F.cross_entropy(F.linear(model.norm(model.embed(torch.arange(3))), model.head.weight),
                                                torch.arange(3)))  # fmt: skip


class LinearCrossEntropy(nn.Module):
    """A loss module given the head's weight, as fused linear cross-entropy kernels take it."""

    def forward(self, weight, hidden, target):
        return F.cross_entropy(F.linear(hidden, weight), target)


def test_a_piece_given_to_a_module_from_the_step_is_refused():
    model = Tiny()
    model.loss_fn = LinearCrossEntropy()
    watch = watch_of(model, {"head.weight": ParameterHere.TP_SHARD})
    hidden = torch.randn(3, 8)
    with pytest.raises(ParameterReadError, match="the call of LinearCrossEntropy .* head.weight"):
        run_step(watch, lambda: model.loss_fn(model.head.weight, hidden, torch.arange(3)))
    assert torch.overrides._get_current_function_mode_stack() == [] and watch._calls == []  # left in order
    run_step(watch, lambda: model.loss_fn(model.norm.weight.expand(16, 8), hidden, torch.arange(3)))  # whole


def test_the_models_forward_and_element_wise_work_pass():
    model = Tiny()
    watch = watch_of(model, {"embed.weight": ParameterHere.TP_SHARD, "head.weight": ParameterHere.TP_SHARD})
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step():
        with torch.no_grad():
            model.head.weight.clamp_(-1.0, 1.0)  # element-wise: right on any piece
            for n, p in model.named_parameters():
                ema[n].mul_(0.9).add_(p.detach(), alpha=0.1)
        loss = loss_of(model)  # the forward reduces the embedding weight itself: not watched
        whole = model.norm.weight.pow(2).sum()  # a whole parameter: fine
        return loss + 1e-3 * whole

    loss = run_step(watch, step)
    loss.backward()
    assert model.embed.weight.grad is not None
    with pytest.raises(ParameterReadError, match="embed.weight"):  # the EMA copy of a shard is a shard
        run_step(watch, lambda: ema["embed.weight"].norm())
    assert torch.overrides._get_current_function_mode_stack() == []  # nothing left on torch's stack


def test_outside_the_step_and_paused_nothing_is_watched():
    model = Tiny()
    watch = watch_of(model, {"embed.weight": ParameterHere.TP_SHARD})
    model.embed.weight.norm()  # no step running

    def step():
        with unwatched():  # the strategy's own backward / optimizer step from a manual step
            model.embed.weight.norm()
        return model.embed.weight.grad  # p.grad is the gradient's business (gradient_reads)

    run_step(watch, step)
    assert all(len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 for m in model.modules())
    watch.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # the fit's end


def test_a_parameter_object_swapped_in_after_setup_is_labelled_by_its_name():
    # ZeRO-3 registers a gathered unit's parameters in place of its shards (the last block, from
    # its forward to its backward): the watch labels what it meets by name.
    model = Tiny()
    watch = watch_of(model, {"head.weight": ParameterHere.TP_SHARD})
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    with pytest.raises(ParameterReadError, match="head.weight"):
        run_step(watch, lambda: model.head.weight.norm())
    mine = nn.Parameter(torch.ones(3))  # not the model's: whole, and met once
    run_step(watch, lambda: mine.sum())


def test_under_pp_combining_parameters_is_refused_but_one_parameter_passes():
    model = Tiny()
    watch = watch_of(model, stage=1, stages=2)
    run_step(watch, lambda: loss_of(model) + model.norm.weight.pow(2).sum())
    with pytest.raises(ParameterReadError, match=r"under pp=2 .* stage 1's parameters") as error:
        run_step(watch, lambda: loss_of(model) + sum(p.pow(2).sum() for p in model.parameters()))
    assert "norm.bias" in str(error.value) or "embed.weight" in str(error.value)


def test_a_term_on_a_parameter_tp_sums_is_refused_when_it_reaches_the_backward():
    model = Tiny()
    watch = watch_of(model, {"norm.weight": ParameterHere.TP_SUMMED})
    logged = run_step(watch, lambda: model.norm.weight.pow(2).sum().detach())  # its value is whole: fine
    assert float(logged) == pytest.approx(8.0)
    with torch.no_grad():
        run_step(watch, lambda: model.norm.weight.pow(2).sum())
    loss = run_step(watch, lambda: loss_of(model) + model.norm.weight.pow(2).sum())
    with pytest.raises(ParameterReadError, match=r"under tp=2 norm.weight .* count 2 times"):
        loss.backward()


def test_the_map_says_what_needs_watching():
    model = Tiny()
    names = [n for n, _ in model.named_parameters()]
    whole = ParameterMap(where={n: ParameterHere.WHOLE for n in names}, sizes={})
    assert not whole.needed
    assert ParameterMap(where=whole.where, sizes={}, stages=2).needed
    assert ParameterMap(where=whole.where, sizes={}, dtensor_parameters=True).needed
    assert ParameterMap(where={**whole.where, "norm.weight": ParameterHere.TP_SUMMED}, sizes={}).needed
    assert not ParameterHere.TP_SUMMED.piece and ParameterHere.TP_SHARD.piece and ParameterHere.EXPERT_SHARD.piece


def test_under_pp_a_block_of_the_last_stage_is_a_piece():
    # The step runs on the last stage, which sees its blocks re-keyed from 0: a penalty on
    # layers[0] there trained another block (1.8e-2 off one process), silently.
    model = Tiny()
    watch = watch_of(model, {"norm.weight": ParameterHere.STAGE_BLOCK}, stage=1, stages=2)
    with pytest.raises(ParameterReadError, match=r"`sum` reduces .* norm.weight .* last stage's blocks"):
        run_step(watch, lambda: loss_of(model) + model.norm.weight.pow(2).sum())
    with torch.no_grad():  # element-wise (an EMA of it) is right on any block
        run_step(watch, lambda: model.norm.weight.detach().clone().mul_(0.9).add_(model.norm.weight, alpha=0.1))
    run_step(watch, lambda: loss_of(model) + model.head.weight.pow(2).sum())  # a part only this stage holds


def test_parameters_handed_to_a_module_as_a_generator_or_with_a_gradient_tp_sums():
    model = Tiny()
    model.loss_fn = Penalty()
    watch = watch_of(model, {"head.weight": ParameterHere.TP_SHARD, "norm.weight": ParameterHere.TP_SUMMED})
    with pytest.raises(ParameterReadError, match=r"a generator of parameters \(`parameters\(\)`\)"):
        run_step(watch, lambda: model.loss_fn(model.parameters()))
    with pytest.raises(ParameterReadError, match=r"norm.weight: the call of Penalty .* count 2 times"):
        run_step(watch, lambda: model.loss_fn([model.norm.weight]))
    with torch.no_grad():
        run_step(watch, lambda: model.loss_fn([model.norm.weight]))  # its value is whole
    assert torch.overrides._get_current_function_mode_stack() == [] and watch._calls == []


class Penalty(nn.Module):
    def forward(self, params):
        return sum(p.pow(2).sum() for p in params)


def test_a_function_combining_along_a_dimension_of_a_shard_is_refused():
    model = Tiny()
    watch = watch_of(model, {"embed.weight": ParameterHere.TP_SHARD}, shard_dims={"embed.weight": 0})
    for combine in (lambda w: F.normalize(w, dim=0), lambda w: torch.softmax(w, 0), lambda w: w.cumsum(0),
                    lambda w: F.layer_norm(w, (8,)), lambda w: F.normalize(w.t(), dim=1)):  # fmt: skip
        with pytest.raises(ParameterReadError, match="combines elements along a dimension"):
            run_step(watch, lambda: combine(model.embed.weight))
    # Along the other dimension than the cut (each row is whole here), on the parameter itself: right.
    run_step(watch, lambda: F.normalize(model.embed.weight, dim=-1))
    run_step(watch, lambda: torch.softmax(model.embed.weight, dim=1))


def test_the_map_of_the_applied_dimensions():
    from types import SimpleNamespace

    model = Tiny()
    tp = SimpleNamespace(sequence_partial={"norm.weight"}, size=2, shards={"head.weight": SimpleNamespace(dim=0)},
                         is_sharded=lambda name: name == "head.weight")  # fmt: skip
    pp = SimpleNamespace(plan=SimpleNamespace(blocks="embed"), pp=2, rank=1)
    places = ParameterMap.of(model, tp, None, pp, zero3=False)
    assert places.where == {"embed.weight": ParameterHere.STAGE_BLOCK, "norm.weight": ParameterHere.TP_SUMMED,
                            "norm.bias": ParameterHere.WHOLE, "head.weight": ParameterHere.TP_SHARD}  # fmt: skip
    assert places.shard_dims == {"head.weight": 0} and places.sizes == {"tp": 2, "ep": 1, "pp": 2}
    assert (places.stage, places.stages) == (1, 2)
