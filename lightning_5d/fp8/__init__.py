"""FP8 training for the torch-native backend: formats, quantizers, delayed scaling, Fp8Linear."""

from lightning_5d.fp8.convert import (
    advance_fp8_histories,
    convert_to_fp8,
    fp8_linears,
    fp8_scaling_state,
    load_fp8_scaling_state,
)
from lightning_5d.fp8.delayed import DEFAULT_AMAX_HISTORY_LEN, amax_histories, push_amax, scaling_amax
from lightning_5d.fp8.formats import E4M3, E5M2, Fp8Format, fp8_format
from lightning_5d.fp8.linear import Fp8Linear, fp8_disabled, fp8_gemm, fp8_is_disabled, quantize_operand
from lightning_5d.fp8.quantize import (
    Granularity,
    Quantized,
    quantize_blocks,
    quantize_mx,
    quantize_rowwise,
    quantize_tensorwise,
    relative_error,
)
from lightning_5d.fp8.recipes import RECIPE_DESCRIPTIONS, Fp8Backend, Fp8Recipe

__all__ = [
    "DEFAULT_AMAX_HISTORY_LEN",
    "E4M3",
    "E5M2",
    "Fp8Backend",
    "Fp8Format",
    "Fp8Linear",
    "Fp8Recipe",
    "Granularity",
    "Quantized",
    "RECIPE_DESCRIPTIONS",
    "advance_fp8_histories",
    "amax_histories",
    "convert_to_fp8",
    "fp8_disabled",
    "fp8_format",
    "fp8_gemm",
    "fp8_is_disabled",
    "fp8_linears",
    "fp8_scaling_state",
    "load_fp8_scaling_state",
    "push_amax",
    "quantize_blocks",
    "quantize_mx",
    "quantize_operand",
    "quantize_rowwise",
    "quantize_tensorwise",
    "relative_error",
    "scaling_amax",
]
