"""FP8 GEMMs for ``nn.MultiheadAttention``'s in-projection, which no ``nn.Linear`` computes.

The module holds q, k and v in a bare ``in_proj_weight`` (or ``q/k/v_proj_weight``) that torch's
forward multiplies by itself. Here the module gets the forward built from its parts
(:func:`lightning_5d.mha_parts.own_forward`), and each in-projection weight a parameterless
:class:`~lightning_5d.fp8.linear.Fp8Projection` registered as ``<weight>_gemm``, which that forward
calls with the weight rows of each GEMM. The parameters stay where and what they were, so the
state dict, optimizers, tp's cuts and FSDP2 see the module as before. ``out_proj`` is an
``nn.Linear`` and becomes an Fp8Linear the ordinary way (:func:`~lightning_5d.fp8.convert.convert_to_fp8`);
the parts forward calls it as a module, which torch's forward never did.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_5d.fp8.linear import Fp8Projection
from lightning_5d.fp8.recipes import Fp8Recipe
from lightning_5d.mha_parts import IN_PROJECTION_WEIGHTS, gemm_name, own_forward


def convert_attention_to_fp8(root: nn.Module, paths: list[str], recipe: Fp8Recipe | str, **options: Any) -> list[str]:
    """FP8 in-projections for the nn.MultiheadAttention at each path; returns the weights now in FP8
    (``<path>.in_proj_weight``, ...). Every path is checked before anything changes."""
    modules = []
    for path in paths:
        module = root.get_submodule(path)
        if not isinstance(module, nn.MultiheadAttention):
            kind = type(module).__name__
            raise ValueError(f"convert_attention_to_fp8: {path!r} is a {kind}, not nn.MultiheadAttention")
        modules.append((path, module))
    converted = []
    for path, module in modules:
        own_forward(module)
        for weight in IN_PROJECTION_WEIGHTS:
            param = getattr(module, weight, None)
            if param is None or isinstance(module._modules.get(gemm_name(weight)), Fp8Projection):
                continue
            gemm = Fp8Projection(recipe, device=param.device, **options)
            gemm.train(module.training)
            module.add_module(gemm_name(weight), gemm)
            converted.append(f"{path}.{weight}")
    return converted
