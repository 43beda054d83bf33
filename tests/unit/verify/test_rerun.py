"""The parallel side of the gradient check (verify/rerun.py) on ZeRO-3 units of a world of one rank:
a unit whose gathered weights the backward does not read is resharded before that backward."""

import torch

from lightning_5d.verify.grads import cotangent, local_grads
from lightning_5d.verify.rerun import ParallelGrads, gathered, reshard_unsaved_units, unit_owners


def _head_of(zero3_blocks):
    model, _ = zero3_blocks
    head = model[3]
    return model, head, torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))


def test_a_head_on_a_detached_input_is_resharded_before_its_backward_with_the_same_gradient(zero3_blocks):
    model, head, x = _head_of(zero3_blocks)
    with gathered(head, unit_owners(model)) as units:
        weight, bias = head.weight, head.bias  # FSDP2's unsharded parameters, registered while gathered
        expected_weight = weight.detach().clone()
        with torch.enable_grad():
            out = head.forward(x)
            assert reshard_unsaved_units(head, units, out) == 1
            assert weight.untyped_storage().nbytes() == 0  # the gathered weight is freed
            grad_w, grad_b = local_grads(out, [weight, bias])
    c = cotangent(out)
    assert torch.allclose(grad_w, c.reshape(-1, 16).T @ x.reshape(-1, 8))
    assert torch.allclose(grad_b, c.reshape(-1, 16).sum(0))
    assert torch.equal(head.weight.full_tensor(), expected_weight)  # the shard itself is untouched


def test_a_unit_whose_weight_the_graph_saved_stays_gathered(zero3_blocks):
    model, head, x = _head_of(zero3_blocks)
    with gathered(head, unit_owners(model)) as units, torch.enable_grad():
        out = head.forward(x.requires_grad_(True))  # the input's gradient reads the weight
        assert reshard_unsaved_units(head, units, out) == 0
        assert head.weight.untyped_storage().nbytes() > 0


def test_a_module_backward_hook_keeps_the_unit_gathered(zero3_blocks):
    model, head, x = _head_of(zero3_blocks)
    handle = head.register_full_backward_hook(lambda *_: None)  # may read the module's weight
    try:
        with gathered(head, unit_owners(model)) as units, torch.enable_grad():
            assert reshard_unsaved_units(head, units, head.forward(x)) == 0
    finally:
        handle.remove()


def test_the_check_gives_the_gradient_of_the_whole_head(zero3_blocks):
    model, head, x = _head_of(zero3_blocks)
    grads = ParallelGrads(context=torch.enable_grad, owners=unit_owners(model), zero3=True)
    found = grads.of(head, "3", (x,), {}, ["weight"])
    out = torch.nn.functional.linear(x, head.weight.full_tensor(), head.bias.full_tensor())
    assert torch.allclose(found["weight"], cotangent(out).reshape(-1, 16).T @ x.reshape(-1, 8))
