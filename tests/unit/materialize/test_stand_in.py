"""RecordedValues: a meta-built model computes, call by call, with the values its eager build holds."""

import gc
import weakref

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_5d.materialize import InitLog, recording
from lightning_5d.materialize.apply import capture
from lightning_5d.materialize.stand_in import RecordedValues, UnrecordedMetaTensor, recorded_values
from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.plan import discover

CONFIG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _both(build=lambda: LlamaLM(CONFIG)):
    L.seed_everything(0, verbose=False)
    eager = build()
    L.seed_everything(0, verbose=False)
    log = InitLog()
    with recording(log):
        meta = build()
    capture(meta, log)
    return eager, meta, log


@pytest.mark.parametrize("budget", [2**40, 0])
def test_the_meta_model_computes_the_eager_logits_bit_equal(budget):
    eager, meta, log = _both()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    mode = recorded_values(meta, log, budget)
    with torch.no_grad():
        expected = eager(ids)
        with mode:
            got = meta(ids)
            once = mode.recomputed
            again = meta(ids)  # a second probe forward
    assert got.device.type == "cpu"
    assert torch.equal(got, expected) and torch.equal(again, expected)
    tensors = len({id(t) for t in [*meta.parameters(), *meta.buffers()]})
    if budget == 0:  # nothing kept: each read recomputes (a table handed on as itself, once per read)
        assert mode.kept_bytes == 0 and once > 0 and mode.recomputed == 2 * once
    else:  # a budget that holds the whole model: each tensor recomputed once
        assert 0 < mode.kept_bytes <= mode.budget and 0 < once <= tensors and mode.recomputed == once
    assert all(p.is_meta for p in meta.parameters())  # the model itself is untouched


def test_the_default_budget_is_the_share_less_the_largest_tensor():
    _, meta, log = _both()
    sizes = [t.numel() * t.element_size() for t in (*meta.parameters(), *meta.buffers())]
    assert recorded_values(meta, log).budget == sum(sizes) - max(sizes)  # one process: the share is all
    mode = recorded_values(meta, log, budget=4096)
    head = meta.model.lm_head.weight if hasattr(meta, "model") else next(meta.parameters())
    with mode:
        F.linear(torch.ones(1, head.shape[1]), head)
    assert mode.kept_bytes == 0  # larger than the budget: recomputed at each read, kept by no one


def test_shape_and_type_questions_recompute_nothing_and_the_device_reads_cpu():
    _, meta, log = _both()
    weight = next(meta.parameters())
    mode = RecordedValues(log, budget=1 << 30)
    with mode:
        facts = (weight.shape, weight.size(), weight.dtype, weight.dim(), weight.numel(), weight.requires_grad,
                 weight.stride(), weight.is_floating_point(), weight.device, weight.is_meta)  # fmt: skip
    assert mode.recomputed == 0
    assert facts[8] == torch.device("cpu") and facts[9] is False
    assert weight.device.type == "meta"  # outside the mode it is the meta tensor it always was


def test_a_meta_device_asked_for_inside_a_forward_is_cpu():
    _, meta, log = _both()
    weight = next(meta.parameters())
    with RecordedValues(log, budget=0):
        positions = torch.arange(4, device=weight.device)
        moved = torch.ones(2).to("meta")
        made = torch.zeros(3, device=torch.device("meta"))
    assert {positions.device.type, moved.device.type, made.device.type} == {"cpu"}


def test_a_mode_entered_inside_sees_the_models_own_parameter():
    """Discovery's own modes (loose-parameter phases, position reads) match parameters by identity."""
    _, meta, log = _both()
    weight = meta.model.embed_tokens.weight if hasattr(meta.model, "embed_tokens") else next(meta.parameters())

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.ids = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.ids.update(id(a) for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    seen = Seen()
    with RecordedValues(log, budget=0), seen:
        out = F.embedding(torch.tensor([[1, 2]]), weight)
    assert id(weight) in seen.ids and out.device.type == "cpu"


def test_a_meta_tensor_the_recording_does_not_know_fails_as_it_did():
    _, _, log = _both()
    stranger = torch.empty(4, 4, device="meta")
    assert torch.mm(torch.ones(2, 4), stranger).device.type == "cpu"  # torch alone gives numbers from nowhere
    with RecordedValues(log, budget=0), pytest.raises(UnrecordedMetaTensor, match="did not record"):
        torch.mm(torch.ones(2, 4), stranger)
    with RecordedValues(log, budget=0):
        assert torch.mm(stranger, stranger).is_meta  # meta with meta: shapes only, as before


def test_a_buffer_is_recomputed_with_its_recorded_value():
    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(8.0).reshape(2, 4) / 3, persistent=False)

        def forward(self, x):
            return self.proj(x) + self.table[:1]

    eager, meta, log = _both(WithTable)
    x = torch.ones(3, 4)
    with torch.no_grad(), RecordedValues(log, budget=1 << 20):
        got = meta(x)
    assert torch.equal(got, eager(x).detach())


def test_discovery_of_the_meta_built_reference_model_recomputes_nothing():
    """Its names say everything and its shape sites are found on meta: the Llama-style models of the
    production recipes pay no recomputation at start-up (the zoo's styles: tests/zoo/test_zoo.py)."""
    eager, meta, log = _both()
    made = []

    def values():
        made.append(recorded_values(meta, log))
        return made[-1]

    plan = discover(meta, values=values)
    assert plan.block_plans == discover(eager).block_plans
    assert sum(m.recomputed for m in made) == 0


def test_recomputing_leaves_the_users_generator_where_it_was():
    """The replay sets the CPU generator before each draw it redoes: the user's stream must not move
    (an eager build's discovery reads weights and draws nothing)."""
    _, meta, log = _both()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with torch.no_grad(), RecordedValues(log, budget=0):
        meta(torch.randint(0, CONFIG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_call_that_returns_its_input_gives_back_the_models_own_tensor():
    """``table.to(x.device)`` is the table itself in an eager build; discovery tells a table read
    whole from another use by that identity (plan/position_reads.py)."""
    _, meta, log = _both()
    weight = next(meta.parameters())
    with RecordedValues(log, budget=1 << 30):
        same = weight.to(torch.device("cpu"))
        typed = weight.type_as(weight)
        other = weight * 2
    assert same is weight and typed is weight
    assert other.device.type == "cpu" and other is not weight


def test_a_backward_through_recomputed_weights_gives_the_eager_gradient_and_holds_no_weight():
    """A probe with gradients (discovery's fused-layout and attention probes) differentiates with
    respect to activations; the weights its graph passes are saved as refs and recomputed by the
    backward, so between forward and backward the graph holds none of them."""
    eager, meta, log = _both()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    leaf = {}

    def as_leaf(_module, _args, out):  # the embedding's output: the leaf the gradient is taken to
        leaf["x"] = out.detach().requires_grad_(True)
        return leaf["x"]

    def grad_of_embedding(model, between=lambda: None):
        handle = model.model.embed_tokens.register_forward_hook(as_leaf)
        try:
            loss = model(ids).square().sum()
            between()
            return torch.autograd.grad(loss, leaf["x"])[0]
        finally:
            handle.remove()

    expected = grad_of_embedding(eager)
    mode = recorded_values(meta, log, budget=0)
    alive = []
    with mode:
        got = grad_of_embedding(meta, lambda: alive.extend(w() for _, w in mode.made.values() if w() is not None))
    assert torch.equal(got, expected)
    assert mode.packed > 0 and alive == []
    assert all(p.grad is None for p in meta.parameters()) and all(p.is_meta for p in meta.parameters())


def test_discovery_of_a_meta_built_fused_model_holds_about_one_tensor_at_a_time():
    """nanoGPT's fused ``c_attn`` is observed by a forward and backward (plan/observe.py); on a
    meta build with nothing kept, the tensors alive at once (the CPU allocator's own accounting)
    stay near the largest one. Before the saved weights were packed the graph held every weight
    after the first block: most of the model."""
    import sys
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).parents[2]))
    from zoo.adapter import FirstOfPair
    from zoo.nanogpt import GPT, GPTConfig

    _, meta, log = _both(lambda: FirstOfPair(GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4))))
    sizes = [p.numel() * p.element_size() for p in meta.parameters()]
    mode = recorded_values(meta, log, budget=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        plan = discover(meta, values=lambda: mode)
    events = sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage
        peak = max(peak, live)
    assert any("observed layout fused segments" in n for n in plan.notes)  # the backward ran
    assert mode.packed > 0
    assert peak <= 2 * max(sizes) < sum(sizes) / 4, (peak, max(sizes), sum(sizes))
    # No graph outlives discovery: a saved output handed back with its grad_fn would hold its own
    # node (a cycle through C++ the collector cannot see), and with it the mode and its values.
    gone = weakref.ref(mode)
    del mode, prof, events
    gc.collect()
    assert gone() is None
