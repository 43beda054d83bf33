"""ZeRO-3 units under a pipeline run (parallel/pipeline/fsdp.py), on a world of one rank:
gradients held across the run's backwards reduce once, and a run that raised (or a forward the
shape probe stopped) leaves nothing behind for the next one."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_5d.parallel.pipeline.fsdp import (
    adopt_stage_units,
    drop_held_gradients,
    hold_gradients,
    reduce_held_gradients,
    reset_stopped_forward,
)


@pytest.fixture
def units(world_of_one):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    # bf16 compute with fp32 reduction: held gradients wait in FSDP's fp32 accumulator
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for module in (model[0], model[1], model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    units = [model[0], model[1], model]
    adopt_stage_units(units)
    return model, units


def run(model, units, microbatches):
    for p in model.parameters():
        p.grad = None
    hold_gradients(units)
    for x in microbatches:
        model(x).float().sum().backward()
    reduce_held_gradients(units)
    return model[0].weight.grad.full_tensor().clone()


def test_held_gradients_reduce_once_to_the_sum_of_the_runs_backwards(units):
    model, units = units
    x = torch.randn(2, 4, 8)
    both = run(model, units, [x[0], x[1]])
    each = run(model, units, [x[0]]) + run(model, units, [x[1]])
    torch.testing.assert_close(both, each)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after the reduce


def test_a_run_that_raised_leaves_no_gradient_for_the_next(units):
    model, units = units
    x = torch.randn(4, 8)
    clean = run(model, units, [x])
    hold_gradients(units)
    model(x).float().sum().backward()  # the run's first microbatch, then the step raised
    drop_held_gradients(units)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    torch.testing.assert_close(run(model, units, [x]), clean)


class _Stop(Exception):
    pass


def _stop(*_args):
    raise _Stop


def test_a_forward_stopped_at_a_units_input_leaves_no_unit_gathered(units):
    model, units = units
    x = torch.randn(4, 8)
    clean = run(model, units, [x])
    # As the pipeline's shape probe stops at the first block's input: after FSDP2's pre-forward hook.
    handle = model[1].register_forward_pre_hook(_stop)
    with pytest.raises(_Stop), torch.no_grad():
        model(x)
    handle.remove()
    assert not isinstance(model[1].weight, DTensor)  # gathered before the stop; its post-forward never ran
    reset_stopped_forward(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    torch.testing.assert_close(run(model, units, [x]), clean)
