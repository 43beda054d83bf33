"""materialize(): what Module._apply would lose when meta parameters become real ones."""

from __future__ import annotations

import torch
from torch import nn

from lightning_5d.materialize import InitLog, MetaBuild
from lightning_5d.materialize.record import recording


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def _build_on_meta() -> tuple[nn.Module, MetaBuild]:
    build = MetaBuild(InitLog())
    torch.manual_seed(0)
    with recording(build.log), torch.device("meta"):
        model = TiedLM()
    build.capture(model)
    return model, build


def test_tied_weights_stay_one_parameter_after_materialization():
    model, build = _build_on_meta()
    assert model.head.weight is model.embed.weight
    build.materialize(model, torch.device("cpu"), [])
    assert not model.embed.weight.is_meta
    # one tensor under both names, as one process builds it: training updates it once
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == 3  # embedding (= head), norm weight and bias
    torch.manual_seed(0)
    eager = TiedLM()
    torch.testing.assert_close(model.embed.weight, eager.embed.weight, rtol=0, atol=0)
