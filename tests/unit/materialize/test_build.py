"""MetaBuild.build_now: a model built in configure_model exists (on meta) before the planner counts it."""

from contextlib import contextmanager

import lightning as L
from torch import nn

from lightning_5d.materialize import InitLog, MetaBuild


class BuiltLate(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None
        self.calls = 0

    def configure_model(self):
        self.calls += 1
        if self.net is None:  # Lightning's contract: idempotent
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def test_configure_model_is_built_on_meta_once_for_the_planner():
    meta = MetaBuild(InitLog())

    @contextmanager
    def context(empty_init=None):
        assert empty_init is True
        with meta.recording():
            yield

    module = BuiltLate()
    assert next(module.parameters(), None) is None
    meta.build_now(module, context)
    assert sum(p.numel() for p in module.parameters()) == 8 * 16 + 16 + 16 * 4 + 4
    assert all(p.is_meta for p in module.parameters())
    meta.build_now(module, context)  # parameters exist: not called again
    assert module.calls == 1
    meta.capture(module)
    assert meta.active and set(meta.refs) == {"net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias"}
