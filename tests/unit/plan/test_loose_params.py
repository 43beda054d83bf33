"""When the forward reads parameters that belong to no part of the plan (issue 22: the zoo's
moduledict_layers adds a raw ``nn.Parameter`` of positions to the embedding's output), and what
pipeline parallelism does with each: the first / last stage holds it, or a refusal says when it
was read."""

import pytest
import torch
from torch import nn

from lightning_5d.parallel.pipeline.batch import PipelineError
from lightning_5d.parallel.pipeline.cuttable import loose_by_stage
from lightning_5d.plan import discover
from lightning_5d.plan.model_plan import Phase

VOCAB, DIM = 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM) for _ in range(4))
        self.num_heads = 2
        self.up_proj, self.down_proj = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 2, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Model(nn.Module):
    """``where``: the phase the raw parameter ``extra`` is read in."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.extra = nn.Parameter(torch.randn(1, 32, DIM) * 0.02)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        if self.where == "before":
            x = x + self.extra[:, : ids.size(1)]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.where == "among" and i == 0:
                x = x * self.extra[:, : ids.size(1)].sigmoid()
        if self.where == "after":
            x = x + self.extra[:, : ids.size(1)]
        return self.lm_head(self.norm(x))


@pytest.mark.parametrize(
    "where, phase", [("before", Phase.BEFORE), ("among", Phase.AMONG), ("after", Phase.AFTER), ("never", None)]
)
def test_the_phase_a_loose_parameter_is_read_in(where, phase):
    torch.manual_seed(0)
    plan = discover(Model(where))
    (loose,) = plan.loose_params
    assert loose.name == "extra"
    assert loose.phases == (frozenset({phase}) if phase else frozenset())


def test_pipeline_places_parameters_read_before_or_after_the_blocks():
    torch.manual_seed(0)
    for where, expected in (("before", (["extra"], [])), ("after", ([], ["extra"]))):
        model = Model(where)
        assert loose_by_stage(model, discover(model)) == expected


@pytest.mark.parametrize(
    "where, said",
    [("among", "extra (read among the blocks)"), ("never", "extra (never read by the probe forward)")],
)
def test_pipeline_refusal_says_when_the_parameter_was_read(where, said):
    torch.manual_seed(0)
    model = Model(where)
    with pytest.raises(PipelineError) as caught:
        loose_by_stage(model, discover(model))
    message = str(caught.value)
    assert said in message and "move each of these into a block" in message and "use pp=1" in message


def test_meta_weights_are_not_observed_and_refused_as_such():
    with torch.device("meta"):
        model = Model("before")
    plan = discover(model)
    assert plan.loose_params == ()
    with pytest.raises(PipelineError, match=r"extra \(not observed: the probe forward did not run\)"):
        loose_by_stage(model, plan)
