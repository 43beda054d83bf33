"""What a FiveDStrategy leaves on a module for a later Trainer's strategy (lightning_5d/applied.py)."""

import copy
import pickle

from torch import nn

from lightning_5d.applied import AppliedDimensions
from lightning_5d.config import ParallelConfig


def test_the_record_left_on_a_module_is_found_and_dropped_from_pickles_and_copies():
    module = nn.Linear(2, 2)
    applied = AppliedDimensions(module=module)
    config = ParallelConfig.from_mapping({"zero": 1})
    assert AppliedDimensions.left_on(module) is None
    applied.leave_on(module, config, "layout")
    left = AppliedDimensions.left_on(module)
    assert left.applied is applied and left.config == config and left.layout == "layout"
    assert not applied.cuts_module  # data parallelism alone: a new strategy applies it afresh
    assert "weight" in dict(module.named_parameters()) and len(module.state_dict()) == 2  # not a parameter or buffer
    for other in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):  # it holds process groups
        assert AppliedDimensions.left_on(other) is None
