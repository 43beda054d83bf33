"""The Transformer Engine backend without Transformer Engine: the missing-dependency error,
and the recipe mapping, layer conversion, autocast and capability gating against a fake
``transformer_engine`` package that records what it is given. The real TE path needs a
CUDA GPU with TE and is not exercised here."""

import enum
import sys
import types
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.fp8 import te_backend
from lightning_5d.fp8.recipes import Fp8Recipe
from lightning_5d.fp8.te_backend import (
    TransformerEngineMissing,
    UnsupportedFp8Recipe,
    check_recipe_supported,
    convert_to_te,
    require_transformer_engine,
    te_autocast,
    te_available,
    te_recipe,
)


class FakeTE:
    """A stand-in for transformer_engine with the API te_backend uses, recording calls."""

    def __init__(self, *, new_api=True, support=None, missing_recipes=()):
        self.calls = []
        self.support = {"fp8": (True, ""), "block": (True, ""), "mxfp8": (True, "")}
        self.support.update(support or {})
        root = types.ModuleType("transformer_engine")
        root.__version__ = "2.99.0-fake"
        pytorch = types.ModuleType("transformer_engine.pytorch")
        common = types.ModuleType("transformer_engine.common")
        recipe = types.ModuleType("transformer_engine.common.recipe")
        fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
        root.pytorch, root.common, common.recipe, pytorch.fp8 = pytorch, common, recipe, fp8
        self.modules = {
            "transformer_engine": root,
            "transformer_engine.pytorch": pytorch,
            "transformer_engine.pytorch.fp8": fp8,
            "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe,
        }

        class Format(enum.Enum):
            E4M3 = "e4m3"
            E5M2 = "e5m2"
            HYBRID = "hybrid"

        recipe.Format = Format
        for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
            if name not in missing_recipes:
                setattr(recipe, name, self._recipe_class(name))

        calls = self.calls

        class Linear(nn.Module):
            def __init__(self, in_features, out_features, bias=True, **kwargs):
                super().__init__()
                calls.append(("Linear", (in_features, out_features), {"bias": bias, **kwargs}))
                dtype, device = kwargs.get("params_dtype"), kwargs.get("device")
                # Random, so a conversion that forgot to copy would show.
                self.weight = nn.Parameter(torch.randn(out_features, in_features, dtype=dtype, device=device))
                self.bias = nn.Parameter(torch.randn(out_features, dtype=dtype, device=device)) if bias else None

            def forward(self, x):
                return F.linear(x, self.weight, self.bias)

        pytorch.Linear = Linear

        @contextmanager
        def autocast(**kwargs):
            calls.append(("autocast", (), kwargs))
            yield

        @contextmanager
        def fp8_autocast(**kwargs):
            calls.append(("fp8_autocast", (), kwargs))
            yield

        pytorch.fp8_autocast = fp8_autocast
        checks = {"fp8": "fp8", "fp8_block_scaling": "block", "mxfp8": "mxfp8"}
        for te_name, key in checks.items():
            if new_api:
                setattr(pytorch, f"is_{te_name}_available", self._new_check(key))
            setattr(fp8, f"check_{te_name}_support", lambda key=key: self.support[key])
        if new_api:
            pytorch.autocast = autocast

    def _recipe_class(self, name):
        calls = self.calls

        class Recipe:
            def __init__(self, **kwargs):
                calls.append((name, (), kwargs))
                self.kwargs = kwargs

        Recipe.__name__ = name
        return Recipe

    def _new_check(self, key):
        def check(return_reason=False):
            return self.support[key] if return_reason else self.support[key][0]

        return check

    def install(self, monkeypatch, capability=(9, 0)):
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(te_backend, "gpu_capability", lambda: capability)
        return self


def hide_te(monkeypatch):
    # A None entry makes `import transformer_engine...` raise ImportError even where TE is installed.
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_te_names_the_extra_and_the_torch_backend(monkeypatch):
    hide_te(monkeypatch)
    with pytest.raises(TransformerEngineMissing) as info:
        require_transformer_engine()
    assert isinstance(info.value, ImportError)
    message = str(info.value)
    assert "pip install 'lightning-5d[te]'" in message
    assert "backend=torch" in message
    for needs_te in (lambda: te_recipe("tensorwise"), lambda: convert_to_te(nn.Linear(16, 16), ["x"])):
        with pytest.raises(TransformerEngineMissing):
            needs_te()


def test_te_available_needs_te_and_an_fp8_gpu(monkeypatch):
    hide_te(monkeypatch)
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: (9, 0))
    assert te_available() is False  # no TE
    fake = FakeTE().install(monkeypatch, capability=(9, 0))
    assert te_available() is True
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: None)
    assert te_available() is False  # no GPU
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: (8, 6))
    assert te_available() is False  # Ampere: no FP8
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: (8, 9))
    assert te_available() is True
    fake.support["fp8"] = (False, "CublasLt version 12.1.3.x or higher required for FP8 execution on Ada.")
    assert te_available() is False  # TE's own verdict counts


def test_recipe_mapping_records_the_te_constructor_arguments(monkeypatch):
    fake = FakeTE().install(monkeypatch)
    fmt = sys.modules["transformer_engine.common.recipe"].Format
    expected = {
        "tensorwise": ("Float8CurrentScaling", {"fp8_format": fmt.HYBRID}),
        "delayed": ("DelayedScaling", {"fp8_format": fmt.HYBRID, "amax_history_len": 16, "amax_compute_algo": "max"}),
        "blockwise": ("Float8BlockScaling", {"fp8_format": fmt.E4M3}),
        "mxfp8": ("MXFP8BlockScaling", {"fp8_format": fmt.E4M3}),
    }
    for recipe, (cls, kwargs) in expected.items():
        obj = te_recipe(Fp8Recipe(recipe))
        assert type(obj).__name__ == cls and obj.kwargs == kwargs
        assert fake.calls[-1] == (cls, (), kwargs)
    te_recipe("delayed", amax_history_len=7)
    assert fake.calls[-1][2]["amax_history_len"] == 7
    with pytest.raises(UnsupportedFp8Recipe, match="backend=torch"):
        te_recipe("rowwise")


def test_recipe_missing_from_an_older_te_is_a_clear_error(monkeypatch):
    FakeTE(missing_recipes=("Float8BlockScaling",)).install(monkeypatch)
    with pytest.raises(UnsupportedFp8Recipe, match=r"2\.99\.0-fake has no Float8BlockScaling"):
        te_recipe("blockwise")


def test_convert_to_te_replaces_linears_and_copies_weights(monkeypatch):
    fake = FakeTE().install(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 48), nn.GELU(), nn.ModuleDict({"proj": nn.Linear(48, 16, bias=False).to(torch.bfloat16)})
    )
    model[0].bias.requires_grad_(False)
    x = torch.randn(4, 32)
    want = model[2]["proj"](model[1](model[0](x)).bfloat16())
    originals = {k: v.detach().clone() for k, v in model.state_dict().items()}
    TELinear = sys.modules["transformer_engine.pytorch"].Linear
    model.eval()

    assert convert_to_te(model, ["0", "2.proj"]) == ["0", "2.proj"]

    assert isinstance(model[0], TELinear) and isinstance(model[2]["proj"], TELinear)
    assert isinstance(model[1], nn.GELU)
    linears = [c for c in fake.calls if c[0] == "Linear"]
    cpu = torch.device("cpu")
    assert linears == [
        ("Linear", (32, 48), {"bias": True, "params_dtype": torch.float32, "device": cpu}),
        ("Linear", (48, 16), {"bias": False, "params_dtype": torch.bfloat16, "device": cpu}),
    ]
    assert model[2]["proj"].bias is None and model[2]["proj"].weight.dtype == torch.bfloat16
    state = model.state_dict()
    assert state.keys() == originals.keys()
    assert all(torch.equal(state[k], v) for k, v in originals.items())
    assert model[0].bias.requires_grad is False and model[0].weight.requires_grad is True
    assert not model[0].training  # keeps the mode of the layer it replaces
    assert torch.equal(model[2]["proj"](model[1](model[0](x)).bfloat16()), want)


def test_convert_to_te_refuses_what_te_cannot_take(monkeypatch):
    FakeTE().install(monkeypatch)
    model = nn.Sequential(nn.Linear(32, 37), nn.ReLU())
    with pytest.raises(ValueError, match="divisible by 16"):
        convert_to_te(model, ["0"])
    with pytest.raises(TypeError, match="not an nn.Linear"):
        convert_to_te(model, ["1"])
    with pytest.raises(ValueError, match="root module"):
        convert_to_te(nn.Linear(16, 16), [""])


def test_te_autocast_uses_autocast_or_the_older_fp8_autocast(monkeypatch):
    fake = FakeTE().install(monkeypatch)
    recipe = te_recipe("tensorwise")
    group = object()
    with te_autocast(recipe, amax_reduction_group=group):
        pass
    assert fake.calls[-1] == ("autocast", (), {"enabled": True, "recipe": recipe, "amax_reduction_group": group})

    old = FakeTE(new_api=False).install(monkeypatch)
    with te_autocast(recipe, enabled=False):
        pass
    assert old.calls[-1] == ("fp8_autocast", (), {"enabled": False, "fp8_recipe": recipe, "fp8_group": None})


@pytest.mark.parametrize(
    "recipe, capability, message",
    [
        ("tensorwise", (8, 6), r"Ada, Hopper or newer GPU \(compute capability 8\.9\+, sm_89\+\); this GPU is sm_86"),
        ("delayed", (8, 0), r"sm_89\+"),
        ("blockwise", (8, 9), r"Hopper or newer GPU .*sm_90\+.*this GPU is sm_89"),
        ("mxfp8", (9, 0), r"Blackwell GPU \(compute capability 10\.0\+, sm_100\+\); this GPU is sm_90"),
        ("mxfp8", None, r"needs a CUDA GPU \(a Blackwell GPU.*none is available.*backend=torch"),
        ("rowwise", (10, 0), r"'rowwise' has no Transformer Engine recipe; use backend=torch"),
    ],
)
def test_capability_gating_names_the_gpu_needed(monkeypatch, recipe, capability, message):
    FakeTE().install(monkeypatch, capability=capability)
    with pytest.raises(UnsupportedFp8Recipe, match=message):
        check_recipe_supported(recipe)


def test_capability_gating_passes_and_defers_to_te(monkeypatch):
    fake = FakeTE().install(monkeypatch, capability=(10, 0))
    for recipe in ("tensorwise", "delayed", "blockwise", "mxfp8"):
        check_recipe_supported(recipe)
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: (9, 0))
    for recipe in ("tensorwise", Fp8Recipe.DELAYED, "blockwise"):
        check_recipe_supported(recipe)
    fake.support["block"] = (False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9.")
    with pytest.raises(UnsupportedFp8Recipe, match=r"CUDA >= 12\.9"):
        check_recipe_supported("blockwise")
    # TE < 2.8 has only transformer_engine.pytorch.fp8.check_*_support
    old = FakeTE(new_api=False, support={"mxfp8": (False, "not on 12.0+ yet")}).install(monkeypatch, (12, 0))
    assert old.support["mxfp8"][0] is False
    with pytest.raises(UnsupportedFp8Recipe, match="not on 12.0"):
        check_recipe_supported("mxfp8")
    check_recipe_supported("tensorwise")


def test_capability_gating_without_te_uses_the_capability_alone(monkeypatch):
    hide_te(monkeypatch)
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: (10, 0))
    check_recipe_supported("mxfp8")
    monkeypatch.setattr(te_backend, "gpu_capability", lambda: (9, 0))
    with pytest.raises(UnsupportedFp8Recipe, match="Blackwell"):
        check_recipe_supported("mxfp8")
