"""The dimensions' ``self.log`` regions nest: the innermost meets the user's call first, and
each puts back what was there (parallel/step_log.py; cp, tp and pp use it)."""

import lightning as L
import pytest

import torch

from lightning_5d.parallel.step_log import log_options, log_through, reduce_fx_name


class Logging(L.LightningModule):
    pass


def tagging(tag: str, calls: list):
    def make_log(log):
        def tagged(name, value, *args, **kwargs):
            calls.append(tag)
            return log(name, value, *args, **kwargs)

        return tagged

    return make_log


def test_regions_nest_innermost_first_and_restore_the_class_log(monkeypatch):
    module, calls, logged = Logging(), [], []
    monkeypatch.setattr(Logging, "log", lambda self, name, value, **kwargs: logged.append((name, value, kwargs)))
    with log_through(module, tagging("outer", calls)):
        with log_through(module, tagging("inner", calls)):
            module.log("loss", 1.0, prog_bar=True)
            module.log_dict({"acc": 0.5})  # log_dict calls self.log(name=..., value=...)
        assert "log" in vars(module)  # the outer region's log is back
    assert calls == ["inner", "outer", "inner", "outer"]
    assert logged == [("loss", 1.0, {"prog_bar": True}), ("acc", 0.5, logged[1][2])]
    assert "log" not in vars(module)  # the class's own method again


def test_a_step_that_raises_still_restores_the_log():
    module = Logging()
    with pytest.raises(RuntimeError), log_through(module, lambda log: log):
        raise RuntimeError("the user's step failed")
    assert "log" not in vars(module)


def test_log_options_by_name_whether_positional_or_keyword():
    options = log_options((True, None, None, None, "max"), {"sync_dist": True})
    assert options == {"prog_bar": True, "logger": None, "on_step": None, "on_epoch": None, "reduce_fx": "max",
                       "sync_dist": True}  # fmt: skip
    assert log_options((), {"reduce_fx": "sum"}) == {"reduce_fx": "sum"}


FX = [("mean", "mean"), ("avg", "mean"), ("MAX", "max"), (torch.max, "max"), (torch.sum, "sum"), (sum, "sum"),
      (min, "min"), (torch.mean, "mean")]  # fmt: skip


@pytest.mark.parametrize("given,name", FX)
def test_reduce_fx_by_name_as_lightning_accepts_it(given, name):
    assert reduce_fx_name(given) == name
