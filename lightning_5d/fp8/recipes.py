"""The FP8 recipes and backends a user can ask for (names shared by config, CLI and docs)."""

from __future__ import annotations

from enum import Enum


class Fp8Recipe(str, Enum):
    """How tensors are scaled before the cast to an 8-bit float."""

    TENSORWISE = "tensorwise"  # one scale per tensor from its current amax ("current scaling")
    DELAYED = "delayed"  # one scale per tensor from the max of an amax history of earlier steps
    ROWWISE = "rowwise"  # one scale per row along the contraction dimension of each GEMM
    BLOCKWISE = "blockwise"  # DeepSeek-V3: 1x128 tiles (activations, gradients), 128x128 blocks (weights)
    MXFP8 = "mxfp8"  # OCP microscaling: 1x32 blocks with power-of-two (E8M0) scales


class Fp8Backend(str, Enum):
    AUTO = "auto"  # Transformer Engine when installed and the GPU has FP8, else torch
    TORCH = "torch"  # our own scaling with torch._scaled_mm or emulation; runs on CPU
    TRANSFORMER_ENGINE = "transformer_engine"


# One line per recipe for CLI help, reports and docs: what each GEMM operand gets.
RECIPE_DESCRIPTIONS: dict[Fp8Recipe, str] = {
    Fp8Recipe.TENSORWISE: "one scale per tensor from its current amax; E4M3 inputs/weights, E5M2 gradients",
    Fp8Recipe.DELAYED: "one scale per tensor from the max of an amax history of earlier steps; E4M3/E5M2 as tensorwise",
    Fp8Recipe.ROWWISE: "one scale per row along each GEMM's contraction dim; E4M3 inputs/weights, E5M2 gradients",
    Fp8Recipe.BLOCKWISE: "DeepSeek-V3: E4M3 everywhere, 1x128 tiles for activations/gradients, 128x128 weight blocks",
    Fp8Recipe.MXFP8: "OCP MX: E4M3 elements in 1x32 blocks along the contraction dim, power-of-two (E8M0) scales",
}
