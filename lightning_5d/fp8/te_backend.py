"""The NVIDIA Transformer Engine (TE) backend for FP8 training: recipes, layers, autocast.

With ``backend=transformer_engine`` (or ``auto`` where :func:`te_available`), the chosen
``nn.Linear`` layers become ``transformer_engine.pytorch.Linear`` (:func:`convert_to_te`)
and every forward runs inside TE's autocast with the TE recipe matching our
:class:`~lightning_5d.fp8.recipes.Fp8Recipe` (:func:`te_recipe`, :func:`te_autocast`).
TE then keeps its own scales, amax histories and fp8 GEMM kernels.

Written against TE 2.x's public PyTorch API (``transformer_engine.pytorch.Linear``,
``autocast`` / the older ``fp8_autocast``, ``is_*_available`` / the older
``fp8.check_*_support``, ``transformer_engine.common.recipe``). TE is an optional extra
(``pip install 'lightning-5d[te]'``) that needs a CUDA GPU; **this path only runs on a
GPU with TE installed and was not run during development** (a CPU-only machine without
TE): the unit tests exercise the mapping, the layer replacement and the capability gating
against a fake ``transformer_engine`` package that records what it is given, not TE.

Recipe mapping (ROWWISE has no TE recipe: use ``backend=torch``):

    tensorwise  Float8CurrentScaling(fp8_format=HYBRID)    sm_89+ (Ada, Hopper, Blackwell)
    delayed     DelayedScaling(fp8_format=HYBRID, amax_history_len, amax_compute_algo="max")   sm_89+
    blockwise   Float8BlockScaling(fp8_format=E4M3)        sm_90+ (TE also needs CUDA >= 12.9)
    mxfp8       MXFP8BlockScaling(fp8_format=E4M3)         sm_100+ (Blackwell)

HYBRID is E4M3 for forward tensors and E5M2 for gradients (TE's default for per-tensor
scaling); TE's block recipes are E4M3 throughout.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Any, Iterable

import torch
from torch import nn

from lightning_5d.fp8.recipes import Fp8Recipe

__all__ = [
    "TE_INSTALL",
    "TransformerEngineMissing",
    "UnsupportedFp8Recipe",
    "check_recipe_supported",
    "convert_to_te",
    "gpu_capability",
    "require_transformer_engine",
    "te_autocast",
    "te_available",
    "te_recipe",
]

TE_INSTALL = "pip install 'lightning-5d[te]'"

# (minimum compute capability, what that is, TE's own check: new name, name in TE < 2.8's fp8 module)
_REQUIREMENTS: dict[Fp8Recipe, tuple[tuple[int, int], str, str, str]] = {
    Fp8Recipe.TENSORWISE: ((8, 9), "an Ada, Hopper or newer GPU", "is_fp8_available", "check_fp8_support"),
    Fp8Recipe.DELAYED: ((8, 9), "an Ada, Hopper or newer GPU", "is_fp8_available", "check_fp8_support"),
    Fp8Recipe.BLOCKWISE: (
        (9, 0),
        "a Hopper or newer GPU",
        "is_fp8_block_scaling_available",
        "check_fp8_block_scaling_support",
    ),
    Fp8Recipe.MXFP8: ((10, 0), "a Blackwell GPU", "is_mxfp8_available", "check_mxfp8_support"),
}

# Our recipe -> (TE recipe class, its fp8_format).
_TE_RECIPES: dict[Fp8Recipe, tuple[str, str]] = {
    Fp8Recipe.TENSORWISE: ("Float8CurrentScaling", "HYBRID"),
    Fp8Recipe.DELAYED: ("DelayedScaling", "HYBRID"),
    Fp8Recipe.BLOCKWISE: ("Float8BlockScaling", "E4M3"),
    Fp8Recipe.MXFP8: ("MXFP8BlockScaling", "E4M3"),
}

# TE's FP8 GEMMs need both feature dimensions divisible by 16 (its documented limit); MXFP8's
# 1x32 scaling blocks need 32.
_TE_ALIGNMENT = 16
_TE_MXFP8_ALIGNMENT = 32


class TransformerEngineMissing(ImportError):
    """The Transformer Engine backend was asked for, but TE cannot be imported."""


class UnsupportedFp8Recipe(RuntimeError):
    """The recipe cannot run on this GPU (or has no Transformer Engine counterpart)."""


def require_transformer_engine():
    """``transformer_engine.pytorch``, or :class:`TransformerEngineMissing` saying how to get it."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except (ImportError, OSError, RuntimeError) as e:
        # TE's import also fails with OSError/RuntimeError when its CUDA libraries are absent.
        raise TransformerEngineMissing(
            f"the FP8 backend 'transformer_engine' needs NVIDIA Transformer Engine, which cannot be imported "
            f"({type(e).__name__}: {e}). Install it with {TE_INSTALL} (on a machine with a CUDA GPU and "
            f"toolkit), or use the torch-native FP8 backend: backend=torch."
        ) from e


def _te_recipe_module():
    require_transformer_engine()
    return importlib.import_module("transformer_engine.common.recipe")


def _te_version() -> str:
    try:
        return str(importlib.import_module("transformer_engine").__version__)
    except (ImportError, AttributeError):
        return "unknown"


def gpu_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def _sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _te_support(recipe: Fp8Recipe) -> tuple[bool, str] | None:
    """TE's own verdict for the recipe on this machine (it also knows CUDA/cuBLAS versions);
    None when TE is not importable or has no such check."""
    try:
        te = require_transformer_engine()
    except TransformerEngineMissing:
        return None
    _, _, new_name, old_name = _REQUIREMENTS[recipe]
    check = getattr(te, new_name, None)
    if check is not None:
        ok, reason = check(return_reason=True)
        return bool(ok), str(reason or "")
    try:
        old = getattr(importlib.import_module("transformer_engine.pytorch.fp8"), old_name)
    except (ImportError, AttributeError):
        return None
    ok, reason = old()
    return bool(ok), str(reason or "")


def check_recipe_supported(recipe: Fp8Recipe | str) -> None:
    """Raise :class:`UnsupportedFp8Recipe` unless Transformer Engine can run ``recipe`` on
    the current GPU; the message names the GPU generation needed."""
    recipe = Fp8Recipe(recipe)
    if recipe is Fp8Recipe.ROWWISE:
        raise UnsupportedFp8Recipe(
            "the FP8 recipe 'rowwise' has no Transformer Engine recipe; use backend=torch for rowwise scaling."
        )
    needed, what, _, _ = _REQUIREMENTS[recipe]
    name = f"the FP8 recipe '{recipe.value}' with Transformer Engine"
    capability = gpu_capability()
    if capability is None:
        raise UnsupportedFp8Recipe(
            f"{name} needs a CUDA GPU ({what}, compute capability {needed[0]}.{needed[1]}+, {_sm(needed)}+); "
            "none is available. Use backend=torch, which also runs (emulated) on CPU."
        )
    if capability < needed:
        raise UnsupportedFp8Recipe(
            f"{name} needs {what} (compute capability {needed[0]}.{needed[1]}+, {_sm(needed)}+); this GPU is "
            f"{_sm(capability)}. Use a recipe this GPU supports or backend=torch."
        )
    support = _te_support(recipe)
    if support is not None and not support[0]:
        raise UnsupportedFp8Recipe(f"{name}: Transformer Engine reports it unsupported here: {support[1]}")


def te_available() -> bool:
    """Whether ``backend=auto`` should pick Transformer Engine: TE imports and the current
    GPU runs its FP8 (tensorwise/delayed) recipes. Never raises."""
    try:
        capability = gpu_capability()
        if capability is None or capability < _REQUIREMENTS[Fp8Recipe.TENSORWISE][0]:
            return False
        require_transformer_engine()
        support = _te_support(Fp8Recipe.TENSORWISE)
        return support is None or support[0]
    except Exception:
        # A broken TE install (or driver) must make auto fall back to torch, not fail.
        return False


def te_recipe(recipe: Fp8Recipe | str, amax_history_len: int = 16) -> Any:
    """The ``transformer_engine.common.recipe`` object for ``recipe`` (see the module table)."""
    recipe = Fp8Recipe(recipe)
    if recipe is Fp8Recipe.ROWWISE:
        raise UnsupportedFp8Recipe(
            "the FP8 recipe 'rowwise' has no Transformer Engine recipe; use backend=torch for rowwise scaling."
        )
    module = _te_recipe_module()
    class_name, fp8_format = _TE_RECIPES[recipe]
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UnsupportedFp8Recipe(
            f"Transformer Engine {_te_version()} has no {class_name} (needed for the FP8 recipe "
            f"'{recipe.value}'); upgrade to Transformer Engine 2.x, or use backend=torch."
        )
    fmt = getattr(module.Format, fp8_format)
    if recipe is Fp8Recipe.DELAYED:
        return cls(fp8_format=fmt, amax_history_len=amax_history_len, amax_compute_algo="max")
    return cls(fp8_format=fmt)


def convert_to_te(root: nn.Module, names: Iterable[str], recipe: Fp8Recipe | str = Fp8Recipe.TENSORWISE) -> list[str]:
    """Replace the ``nn.Linear`` at each dotted path in ``names`` by a Transformer Engine
    ``Linear`` with the same shape, bias, dtype and device, and the same weights.

    Call it once the model is on its CUDA device (or on ``meta``) and before tensor
    parallelism or FSDP touch these layers. Returns ``names`` as a list.
    """
    te = require_transformer_engine()
    names = list(names)
    alignment = _TE_MXFP8_ALIGNMENT if Fp8Recipe(recipe) is Fp8Recipe.MXFP8 else _TE_ALIGNMENT
    for name in names:
        if not name:
            raise ValueError("convert_to_te replaces submodules; the root module itself cannot be converted")
        old = root.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise TypeError(f"{name} is a {type(old).__name__}, not an nn.Linear")
        if type(old.weight) is not nn.Parameter:
            raise TypeError(
                f"{name}.weight is a {type(old.weight).__name__}: convert to Transformer Engine layers before "
                "tensor parallelism, FSDP or the FP8 all-gather wrap the weights"
            )
        if old.in_features % alignment or old.out_features % alignment:
            raise ValueError(
                f"{name} is {old.in_features} -> {old.out_features}: Transformer Engine's {Fp8Recipe(recipe).value} "
                f"GEMMs need both dimensions divisible by {alignment}; use fp8.backend=torch for this model"
            )
        new = te.Linear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            params_dtype=old.weight.dtype,
            device=old.weight.device,
        )
        if old.weight.device.type != "meta":
            with torch.no_grad():
                new.weight.copy_(old.weight)
                if old.bias is not None:
                    new.bias.copy_(old.bias)
        new.weight.requires_grad_(old.weight.requires_grad)
        if old.bias is not None:
            new.bias.requires_grad_(old.bias.requires_grad)
        new.train(old.training)
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name), child, new)
    return names


def te_autocast(
    recipe: Any, enabled: bool = True, amax_reduction_group: torch.distributed.ProcessGroup | None = None
) -> AbstractContextManager:
    """TE's autocast for one forward: ``te.autocast`` (TE >= 2.8), else ``te.fp8_autocast``.

    ``amax_reduction_group``: the ranks whose amaxes TE reduces when the context exits
    (delayed scaling), i.e. the data/context-parallel ranks that must share scales.
    """
    te = require_transformer_engine()
    autocast = getattr(te, "autocast", None)
    if autocast is not None:
        return autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)
