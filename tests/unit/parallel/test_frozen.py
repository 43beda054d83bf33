"""FrozenAtSetup: which frozen parameters a layout relies on, and the refusal once one trains."""

import pytest
import torch
from torch import nn

from lightning_5d.parallel.frozen import FrozenAtSetup, FrozenParameterError


def model() -> nn.Module:
    m = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    m[0].weight.requires_grad_(False)
    m[1].weight.requires_grad_(False)
    return m


def test_nothing_is_watched_without_machinery_that_leaves_frozen_parameters_out():
    assert FrozenAtSetup.watch(model(), zero_stage=None, tp_partial=None) is None
    assert FrozenAtSetup.watch(nn.Linear(2, 2), zero_stage=1, tp_partial=None) is None  # none frozen
    assert FrozenAtSetup.without_masters(model(), []) is None


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_zero_engines_watch_every_frozen_parameter(zero_stage):
    m = model()
    watch = FrozenAtSetup.watch(m, zero_stage=zero_stage, tp_partial=None)
    assert [n for n, _ in watch.params] == ["0.weight", "1.weight"]
    watch.check()  # still frozen: fine
    m[2].weight.requires_grad_(False)  # freezing a trainable one later is fine too
    watch.check()
    m[1].weight.requires_grad_(True)
    with pytest.raises(FrozenParameterError, match=rf"1 parameter\(s\) frozen .*\(1\.weight\).*zero={zero_stage} "
                                                   r"reduces and shards only.*use zero=3.*a later Trainer"):  # fmt: skip
        watch.check()


def test_frozen_bf16_parameters_without_a_master_are_watched_by_name():
    m = model().to(torch.bfloat16)
    watch = FrozenAtSetup.without_masters(m, [m[1].weight])  # what MasterWeights left without a master
    assert [n for n, _ in watch.params] == ["1.weight"]
    m[0].weight.requires_grad_(True)  # it got no master either way: not this watch's
    watch.check()
    m[1].weight.requires_grad_(True)
    with pytest.raises(FrozenParameterError, match="would be stepped in bf16"):
        watch.check()


def test_tp_watches_only_the_frozen_parameters_whose_partial_gradients_it_sums():
    m = model()
    watch = FrozenAtSetup.watch(m, zero_stage=None, tp_partial={"1.weight", "1.bias"})
    assert [n for n, _ in watch.params] == ["1.weight"]
    m[0].weight.requires_grad_(True)  # no ZeRO engine: the embedding trains on its own gradient, as one process
    watch.check()
    m[1].weight.requires_grad_(True)
    with pytest.raises(FrozenParameterError, match="sums the partial gradients"):
        watch.check()


def test_lightnings_finetuning_callbacks_are_refused_only_where_the_optimizer_holds_other_tensors():
    from lightning.pytorch.callbacks import BackboneFinetuning

    from lightning_5d.parallel.frozen import refuse_finetuning_callbacks

    module = nn.Linear(4, 4)
    own = torch.optim.AdamW(module.parameters())
    master = torch.optim.AdamW([nn.Parameter(torch.zeros(8))])  # a slice or an fp32 master
    callbacks = [BackboneFinetuning()]
    refuse_finetuning_callbacks(callbacks, [own], module, zero=3)
    refuse_finetuning_callbacks([], [master], module, zero=1)
    with pytest.raises(FrozenParameterError, match=r"BackboneFinetuning .* zero=1 the optimizer holds flat fp32 slices"):
        refuse_finetuning_callbacks(callbacks, [own, master], module, zero=1)
    with pytest.raises(FrozenParameterError, match=r"zero=3 the optimizer holds fp32 masters of the bf16 parameters"):
        refuse_finetuning_callbacks(callbacks, [master], module, zero=3)
