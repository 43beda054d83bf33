"""RecordedValues: a meta-built model computes, call by call, with the values its eager build holds."""

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


@pytest.mark.parametrize("budget", [None, 0])
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
    else:  # one process's budget holds the whole model: each tensor recomputed once
        assert 0 < mode.kept_bytes <= mode.budget and 0 < once <= tensors and mode.recomputed == once
    assert all(p.is_meta for p in meta.parameters())  # the model itself is untouched


def test_the_default_budget_is_the_larger_of_the_largest_tensor_and_the_share():
    _, meta, log = _both()
    sizes = [t.numel() * t.element_size() for t in (*meta.parameters(), *meta.buffers())]
    assert recorded_values(meta, log).budget == max(max(sizes), sum(sizes))  # one process: the share is all
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
