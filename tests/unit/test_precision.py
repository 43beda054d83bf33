"""FiveDPrecision settings, strings, errors and the linears it would put in FP8; no process group."""

import lightning as L
import pytest
import torch

from lightning_5d import FiveDPrecision, FiveDStrategy, Fp8Backend, Fp8Recipe, PrecisionError
from lightning_5d.fp8.targets import fp8_targets
from lightning_5d.models import LlamaLM
from lightning_5d.plan import discover
from lightning_5d.precision import PrecisionMode, precision_plugins
from lightning_5d.train import ConfigError, compose, validate

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_strings_name_the_mode_and_recipe():
    assert FiveDPrecision.from_string("bf16-mixed").fp8 is None
    p = FiveDPrecision.from_string("fp8-blockwise")
    assert p.mode is PrecisionMode.FP8 and p.fp8.recipe is Fp8Recipe.BLOCKWISE
    assert FiveDPrecision.from_string("fp8").fp8.recipe is Fp8Recipe.TENSORWISE
    assert FiveDPrecision("fp8", recipe="mxfp8", fp8={"backend": "torch"}).fp8.backend is Fp8Backend.TORCH
    assert p.precision == "bf16-mixed"  # what Lightning and the planner read


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FiveDPrecision.from_string("fp8-int4"), r"fp8.recipe='int4' is not valid; choose one of 'tensorwise'"),
        (lambda: FiveDPrecision("fp16-mixed"), r"precision='fp16-mixed' is not valid"),
        (lambda: FiveDPrecision("bf16-mixed", recipe="blockwise"), r"use FiveDPrecision\('fp8', recipe=...\)"),
        (lambda: FiveDPrecision("fp8", fp8={"recipe": "rowwise", "fp8_all_gather": True}), "needs recipe=tensorwise"),
        (lambda: FiveDPrecision("fp8", fp8={"scaling": 1}), r"unknown fp8 options \['scaling'\]"),
        (lambda: FiveDPrecision("bf16-mixed", reduce_dtype="fp16"), r"reduce_dtype='fp16' is not valid"),
        (lambda: FiveDPrecision("fp8", numerics_check_every=-1), "need every >= 0"),
        (lambda: FiveDPrecision("bf16-mixed", accumulation_dtype="fp64"), r"accumulation_dtype='fp64' is not valid"),
        (lambda: FiveDPrecision("fp8", fp8={"amax_history_len": 0}), "amax_history_len=0 must be at least 1"),
    ],
)
def test_bad_settings_name_the_value_and_the_fix(make, message):
    with pytest.raises(PrecisionError, match=message):
        make()


def test_precision_plugins_routes_our_strings_to_a_plugin():
    assert precision_plugins("32-true") == ("32-true", [])
    assert precision_plugins("bf16-mixed") == ("bf16-mixed", [])  # the strategy adopts Lightning's
    text, plugins = precision_plugins("fp8-delayed", {"numerics_check_every": 5})
    assert text is None and plugins[0].fp8.recipe is Fp8Recipe.DELAYED and plugins[0].guard.every == 5


def test_strategy_adopts_lightnings_bf16_mixed():
    t = L.Trainer(strategy=FiveDStrategy(zero=1), accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    assert isinstance(t.precision_plugin, FiveDPrecision) and t.precision_plugin.attached
    t = L.Trainer(strategy=FiveDStrategy(zero=1), accelerator="cpu", devices=2, logger=False,
                  plugins=[FiveDPrecision("fp8", recipe="rowwise")])  # fmt: skip
    assert t.strategy.precision_plugin.fp8.recipe is Fp8Recipe.ROWWISE


def test_another_strategy_is_refused_before_any_change():
    with pytest.raises(PrecisionError, match="use it with strategy='5d'"):
        FiveDPrecision("fp8").convert_module(torch.nn.Linear(2, 2))


def test_fp8_targets_are_the_block_projections():
    model = LlamaLM(TINY)
    names = fp8_targets(discover(model), model)
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per block
    assert "model.layers.0.attn.q_proj" in names or any(n.endswith("q_proj") for n in names)
    assert not any("lm_head" in n for n in names)
    with_head = fp8_targets(discover(model), model, keep_head_bf16=False)
    assert len(with_head) == len(names) + 1


def test_fp8_targets_of_a_moe_keep_the_router_unless_asked():
    model = LlamaLM({**TINY, "num_experts": 4, "experts_top_k": 2})
    plan = discover(model)
    names = fp8_targets(plan, model)
    router = f"{plan.block_path(0)}.{plan.block_plans[0].moe.router}"
    assert router not in names
    assert router in fp8_targets(plan, model, keep_router_bf16=False)
    assert sum(f"{plan.block_path(0)}.{plan.block_plans[0].moe.experts}." in n for n in names) == 4 * 3


def test_l5d_train_validates_the_precision_before_launch():
    validate(compose(["recipe=tiny_tp", "precision=fp8_blockwise"]))
    with pytest.raises(ConfigError, match="amax_history_len=0 must be at least 1"):
        validate(compose(["recipe=tiny_tp", "precision=fp8_delayed", "+precision_options.fp8.amax_history_len=0"]))
    with pytest.raises(ConfigError, match="two FP8 recipes given"):
        validate(compose(["recipe=tiny_tp", "precision=fp8_delayed", "+precision_options.fp8.recipe=rowwise"]))


def test_auto_backend_falls_back_to_torch_where_transformer_engine_cannot_serve(monkeypatch):
    from lightning_5d.fp8 import te_backend

    monkeypatch.setattr(te_backend, "te_available", lambda: True)
    monkeypatch.setattr(te_backend, "check_recipe_supported", lambda recipe: None)
    monkeypatch.setattr(te_backend, "te_recipe", lambda recipe, amax_history_len=16: object())
    single = {"tp": 1, "pp": 1, "ep": 1}
    assert FiveDPrecision("fp8")._choose_backend(single, False) is Fp8Backend.TRANSFORMER_ENGINE
    assert FiveDPrecision("fp8")._choose_backend({**single, "tp": 2}, False) is Fp8Backend.TORCH
    assert FiveDPrecision("fp8")._choose_backend(single, True) is Fp8Backend.TORCH  # activation checkpointing
    assert FiveDPrecision("fp8", recipe="rowwise")._choose_backend(single, False) is Fp8Backend.TORCH

    def no_mxfp8(recipe):
        raise te_backend.UnsupportedFp8Recipe("MXFP8 needs a Blackwell GPU")

    monkeypatch.setattr(te_backend, "check_recipe_supported", no_mxfp8)
    assert FiveDPrecision("fp8", recipe="mxfp8")._choose_backend(single, False) is Fp8Backend.TORCH
    monkeypatch.setattr(te_backend, "te_available", lambda: False)
    assert FiveDPrecision("fp8")._choose_backend(single, False) is Fp8Backend.TORCH


def test_asking_for_transformer_engine_where_it_cannot_serve_names_the_fix():
    explicit = FiveDPrecision("fp8", fp8={"backend": "transformer_engine"})
    with pytest.raises(PrecisionError, match=r"cannot run with tp=2, pp=2 here; use fp8.backend=torch"):
        explicit._choose_backend({"tp": 2, "pp": 2, "ep": 1}, False)
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ImportError, match=r"pip install 'lightning-5d\[te\]'"):
            explicit._choose_backend({"tp": 1, "pp": 1, "ep": 1}, False)


def test_auto_backend_leaves_misaligned_layers_and_experts_to_torch(monkeypatch):
    from lightning_5d.fp8 import te_backend

    monkeypatch.setattr(te_backend, "te_available", lambda: True)
    monkeypatch.setattr(te_backend, "check_recipe_supported", lambda recipe: None)
    monkeypatch.setattr(te_backend, "te_recipe", lambda recipe, amax_history_len=16: object())
    single = {"tp": 1, "pp": 1, "ep": 1}
    aligned, odd = [("q", 64, 64)], [("q", 64, 48)]
    assert FiveDPrecision("fp8")._choose_backend(single, False, shapes=aligned) is Fp8Backend.TRANSFORMER_ENGINE
    assert FiveDPrecision("fp8", recipe="mxfp8")._choose_backend(single, False, shapes=odd) is Fp8Backend.TORCH
    assert FiveDPrecision("fp8")._choose_backend(single, False, experts=True) is Fp8Backend.TORCH
    # nn.MultiheadAttention's bare in_proj_weight: no TE layer holds it, our Fp8Projection does
    attention = ["encoder.layers.0.self_attn"]
    assert FiveDPrecision("fp8")._choose_backend(single, False, attentions=attention) is Fp8Backend.TORCH
    explicit = FiveDPrecision("fp8", fp8={"backend": "transformer_engine"})
    with pytest.raises(PrecisionError, match=r"nn.MultiheadAttention's in-projection \(encoder.layers.0.self_attn\)"):
        explicit._choose_backend(single, False, attentions=attention)
    with pytest.raises(PrecisionError, match=r"q \(64 -> 48, not multiples of 32\)"):
        FiveDPrecision("fp8", recipe="mxfp8", fp8={"backend": "transformer_engine"})._choose_backend(
            single, False, shapes=odd
        )
