"""The gradient-read watch on one process: which reads of a piece of a gradient it refuses.

A fake map says what each parameter's ``.grad`` holds "on this rank"; the distributed cases
(tests/distributed/test_gradient_hooks.py) check the map the strategy builds.
"""

import pytest
import torch
from torch import nn

from lightning_5d.gradient_reads import (
    Found,
    GradientHere,
    GradientMap,
    GradientReadError,
    GradientWatch,
    ManualWindow,
    watch_hooks,
    watching,
)
from lightning_5d.parallel.grad_norm import norm_of_norms, per_parameter_norms
from lightning_5d.piece_reads import unwatched


def model_with_grads() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model(torch.randn(3, 4)).square().sum().backward()
    return model


def shard_map(model: nn.Module, sharded=("0.weight",), **options) -> GradientWatch:
    where = {n: GradientHere.TP_SHARD if n in sharded else GradientHere.WHOLE for n, _ in model.named_parameters()}
    return GradientWatch(GradientMap(where=where, sizes={"tp": 2, "zero": 1, "slices": 2}, **options))


def test_reductions_of_a_shard_are_refused_with_the_fix():
    model = model_with_grads()
    with watching(shard_map(model), model, "M.on_before_optimizer_step"):
        with pytest.raises(GradientReadError, match=r"`_foreach_norm|`linalg_vector_norm") as error:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for words in ("0.weight.grad", "tensor-parallel shard (1/2", "gradient_clip_val", "lightning_5d.grad_norm"):
            assert words in str(error.value)
        with pytest.raises(GradientReadError, match="`norm` reduces"):
            model[0].weight.grad.data.norm(2)  # .data keeps the label
        with pytest.raises(GradientReadError, match="`sum` reduces"):
            model[0].weight.grad.abs().sum()  # so does any element-wise step before the reduction
        with pytest.raises(GradientReadError, match="`__getitem__` reduces"):
            model[0].weight.grad.view(-1)[0]  # an element of a shard is not the one-process element
    single = nn.Linear(1, 1, bias=False)
    single(torch.ones(1, 1)).sum().backward()
    with watching(shard_map(single, sharded=("weight",)), single, "hook"):
        with pytest.raises(GradientReadError, match="`__float__\\(\\)` makes a Python number"):
            float(single.weight.grad)


def test_element_wise_work_and_whole_gradients_pass():
    model = model_with_grads()
    expected = [p.grad.clamp(-1e-2, 1e-2) for p in model.parameters()]
    with watching(shard_map(model), model, "M.on_before_optimizer_step"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-2)  # element-wise: right on any piece
        assert all(p.grad is not None for p in model.parameters())
        finite = torch.isfinite(model[0].weight.grad)  # a mask, not a reduction
        model[0].weight.grad.mul_(finite)
        whole = torch.nn.utils.get_total_norm([model[2].weight.grad, model[1].bias.grad])  # whole ones: fine
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    assert float(whole) > 0


def test_the_strategys_own_reads_pause_the_watch():
    model = model_with_grads()
    with watching(shard_map(model), model, "hook"):
        with unwatched():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(GradientReadError):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_under_pp_combining_parameters_is_refused_but_one_parameter_passes():
    model = model_with_grads()
    where = {n: GradientHere.WHOLE for n, _ in model.named_parameters()}
    grads = GradientWatch(GradientMap(where=where, sizes={}, stage=1, stages=2))
    with watching(grads, model, "M.on_before_optimizer_step"):
        one = model[0].weight.grad.norm(2)  # a whole parameter's norm is right on its stage
        assert float(one) > 0
        with pytest.raises(GradientReadError, match="under pp=2 this rank holds only stage 1"):
            torch.tensor([p.grad.norm(2) for p in model.parameters()])  # Lightning's grad_norm total
        with pytest.raises(GradientReadError, match="combines the gradients of several parameters"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_a_gradient_only_in_the_optimizers_slices_is_refused_and_a_whole_one_is_read():
    model = model_with_grads()
    master = torch.full((8,), 3.0)
    model[1].weight.grad = None  # moved into the fp32 master before the hook
    places = {"0.weight": (Found.ELSEWHERE, None), "1.weight": (Found.SUBSTITUTE, master)}
    grads = shard_map(model, sharded=(), locate=lambda name, grad: places.get(name, (Found.READ, grad)), moved_out=True)
    with watching(grads, model, "M.on_before_optimizer_step"):
        with pytest.raises(GradientReadError, match=r"0.weight.grad holds this rank's own, unreduced gradient"):
            [p.grad for p in model.parameters()]  # None, or this rank's own unreduced gradient
        read = model[1].weight.grad
        assert read is master  # the same numbers, and writes reach the optimizer's parameter
        read.mul_(0.5)
    assert torch.equal(master, torch.full((8,), 1.5))
    assert model[2].bias.grad is not None and model[1].weight.grad is None  # outside: untouched


def test_a_partial_sum_is_a_piece_while_it_is_pending():
    model = model_with_grads()
    pending = [True]
    grads = shard_map(model, sharded=(), tp_partial=lambda name: pending[0] and name == "1.weight", tp_sums_late=True)
    assert grads.map.needed
    with watching(grads, model, "M.on_after_backward"):
        with pytest.raises(GradientReadError, match="partial sum, which tp adds"):
            model[1].weight.grad.norm()
    pending[0] = False
    with watching(grads, model, "M.on_before_optimizer_step"):
        assert float(model[1].weight.grad.norm()) >= 0


def test_a_piece_copied_into_another_buffer_stays_a_piece():
    model = model_with_grads()
    grads = shard_map(model)
    with watching(grads, model, "hook"):
        flat = torch.zeros(64)
        flat[:32] = model[0].weight.grad.view(-1)
        with pytest.raises(GradientReadError, match="`norm` reduces"):
            flat.norm()
        other = torch.zeros(40)
        other[:32].copy_(model[0].weight.grad.view(-1))
        with pytest.raises(GradientReadError, match="`sum` reduces"):
            other.sum()
        with pytest.raises(GradientReadError, match="`__array__"):
            model[0].weight.grad.__array__()
        kept = model[0].weight.grad.clone()
    with watching(grads, model, "hook 2"):  # the same fit's next hook: still a piece
        with pytest.raises(GradientReadError, match="^hook 2: `norm` reduces"):
            kept.norm()


def test_the_manual_window_leaves_the_mode_stack_as_it_found_it():
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = model_with_grads()
    window, other = ManualWindow(), Other()
    before = list(_get_current_function_mode_stack())
    window.open(shard_map(model), model, "step after manual_backward")
    other.__enter__()  # a mode entered around the rest of the step, left after the window closes
    with pytest.raises(GradientReadError):
        model[0].weight.grad.norm()
    window.close()
    model[0].weight.grad.norm()  # unwatched again
    assert _get_current_function_mode_stack() == [*before, other]
    other.__exit__(None, None, None)
    assert _get_current_function_mode_stack() == before
    window.close()  # closing twice does nothing


def test_gradients_of_no_watched_parameter_pass():
    model, other = model_with_grads(), model_with_grads()
    with watching(shard_map(model, sharded=[n for n, _ in model.named_parameters()]), model, "hook"):
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)  # another module's parameters


class Callback:
    def on_before_optimizer_step(self, trainer, module, optimizer):
        module[0].weight.grad.norm()

    def on_after_backward(self, trainer, module):
        pass


def test_watch_hooks_wraps_the_hooks_and_puts_them_back():
    model, callback = model_with_grads(), Callback()
    model.on_before_optimizer_step = lambda optimizer: model[0].weight.grad.sum()
    own = model.on_before_optimizer_step
    remove = watch_hooks(shard_map(model), model, [(model, ("on_before_optimizer_step",), "M"),
                                                   (callback, ("on_before_optimizer_step",), "C")])  # fmt: skip
    with pytest.raises(GradientReadError, match=r"^M.on_before_optimizer_step: `sum`"):
        model.on_before_optimizer_step(None)
    with pytest.raises(GradientReadError, match=r"^C.on_before_optimizer_step: `norm`"):
        callback.on_before_optimizer_step(None, model, None)
    remove()
    assert model.on_before_optimizer_step is own and "on_before_optimizer_step" not in vars(callback)
    callback.on_before_optimizer_step(None, model, None)  # unwatched again


def test_per_parameter_norms_in_one_process_are_torchs():
    model = model_with_grads()
    pieces = {n: p.grad for n, p in model.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    for norm_type in (1.0, 2.0, 3.0, float("inf")):
        norms = per_parameter_norms(pieces, names, norm_type)
        for n, g in pieces.items():
            assert float(norms[n]) == pytest.approx(float(torch.linalg.vector_norm(g, norm_type)), rel=1e-6)
        total = torch.nn.utils.get_total_norm(list(pieces.values()), norm_type)
        assert float(norm_of_norms(norms.values(), norm_type)) == pytest.approx(float(total), rel=1e-6)


def test_a_name_without_gradient_is_left_out():
    model = model_with_grads()
    model[1].weight.grad = None
    pieces = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norms = per_parameter_norms(pieces, [n for n, _ in model.named_parameters()], 2.0)
    assert "1.weight" not in norms and len(norms) == 5


def test_nothing_is_watched_where_every_gradient_is_whole():
    model = model_with_grads()
    assert not shard_map(model, sharded=()).map.needed
    assert shard_map(model).map.needed and shard_map(model, sharded=(), stages=2).map.needed
    assert shard_map(model, sharded=(), dtensor_grads=True).map.needed
    assert shard_map(model, sharded=(), moved_out=True).map.needed
