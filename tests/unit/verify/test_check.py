"""Which layouts the plan verifier checks (``PlanCheck.before``, single process)."""

import pytest

from lightning_5d.config import ParallelConfig, VerifyMode
from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.verify import PlanCheck

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
PIECES = 5  # embedding, 2 blocks, final norm, head


@pytest.mark.parametrize(
    ("verify", "zero", "rewrites", "pieces"),
    [
        # The default checks wherever a dimension rewrites the forward (tp, cp, pp, ep, FP8) ...
        ("auto", 3, True, PIECES),
        ("auto", 1, True, PIECES),
        # ... but not ZeRO-3 alone, where each piece runs its own code on gathered weights.
        ("auto", 3, False, 0),
        # Asked for, ZeRO-3 alone is checked too.
        ("blocks", 3, False, PIECES),
        ("outputs", 3, False, PIECES),
        # ZeRO-0..2 alone leave the forward untouched; off is off.
        ("blocks", 1, False, 0),
        ("off", 3, True, 0),
    ],
)
def test_which_layouts_are_checked(verify, zero, rewrites, pieces):
    module = LlamaLM(CONFIG)
    config = ParallelConfig(verify=verify, zero=zero)
    check = PlanCheck.before(module, None, config, rewrites=rewrites)
    assert len(check.pieces) == pieces
    # A layout no dimension rewrites is not refused when the probe cannot call the model.
    assert check.required == (rewrites or not pieces)


def test_auto_is_the_default():
    assert ParallelConfig().verify == VerifyMode.AUTO
