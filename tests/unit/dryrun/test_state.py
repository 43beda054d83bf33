"""Per-tensor start-up bytes (lightning_5d.dryrun.state): a frozen tensor holds its parameter only."""

import pytest

from lightning_5d.config import ZeroStage
from lightning_5d.dryrun.holdings import HeldTensor, Part
from lightning_5d.dryrun.state import StateRules, tensor_state


def held(trainable: bool) -> HeldTensor:
    return HeldTensor("w", (10, 6), (10, 6), 4, False, Part.BLOCKS, trainable)


@pytest.mark.parametrize("zero", list(ZeroStage))
@pytest.mark.parametrize("low_precision", [False, True])
def test_a_frozen_tensor_holds_its_parameter_and_no_gradient_or_optimizer_state(zero, low_precision):
    rules = StateRules(zero=zero, low_precision_params=low_precision and zero != ZeroStage.PARAMETERS)
    group = (4, 3)  # the last of 4 shard ranks: ZeRO-3's chunk of 10 rows is 1 row there
    trained, frozen = tensor_state(held(True), rules, group), tensor_state(held(False), rules, group)
    assert frozen == (trained[0], 0, 0)
    expected = 4 * 6 if zero == ZeroStage.PARAMETERS else (2 if rules.low_precision_params else 4) * 60
    assert frozen[0] == expected
