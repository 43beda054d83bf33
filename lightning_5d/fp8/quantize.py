"""Scaling a high-precision tensor into FP8 and back, at the granularities the recipes use.

Convention (the one Transformer Engine and torchao use for their "scale"): ``data = cast(x * scale)``
with ``scale = fp8_max / amax`` over the group of elements sharing the scale, so each group's
largest magnitude lands on the top of the format; ``dequantize = data / scale``. A group that is all
zero gets ``scale = 1`` (any scale would do; 1 keeps dequantization exact). Values are clamped to
``±fp8_max`` before the cast: with a scale taken from an older amax (delayed scaling) a value can
exceed the range, and it must saturate rather than become inf/NaN (E5M2 would overflow to inf; E4M3
has no inf at all). The cast itself is a real cast to the torch fp8 dtype, so rounding, subnormals
and underflow are exactly those of the hardware format.

Scale layouts (``Quantized.granularity``):

* ``TENSOR``: one 0-d scale.
* ``ROW``: one scale per slice along ``axis`` (the GEMM's contraction axis); the scale keeps the
  tensor's rank with size 1 on ``axis``, so it broadcasts against ``data``.
* ``BLOCK``: one scale per ``(r, c)`` tile of a 2-D tensor, shape ``(ceil(R / r), ceil(C / c))``;
  edge tiles are partial (the tensor is zero-padded for the amax, which zeros cannot change, and the
  padding is cut off again), so ``data`` always has the original shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_5d.fp8.formats import E4M3, Fp8Format, fp8_format

# E8M0 (the MX shared scale) holds 2**-127 .. 2**127; the exponent is clamped to that range.
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
MX_BLOCK_SIZE = 32

_FP32_MAX = torch.finfo(torch.float32).max


class Granularity(str, Enum):
    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"


@dataclass(frozen=True)
class Quantized:
    """An FP8 tensor with the fp32 scales needed to recover (an approximation of) the original."""

    data: Tensor  # fp8, the original shape
    scale: Tensor  # fp32, layout given by ``granularity`` (see the module docstring)
    fmt: Fp8Format
    granularity: Granularity
    axis: int | None = None  # ROW: the axis each scale is shared along (non-negative)
    block: tuple[int, int] | None = None  # BLOCK: tile shape (rows, cols)
    power_of_two: bool = False  # scales are exact powers of two (MX / E8M0)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def expanded_scale(self) -> Tensor:
        """The scale broadcastable against ``data`` (tiles expanded to elements for BLOCK)."""
        if self.granularity is not Granularity.BLOCK:
            return self.scale
        assert self.block is not None
        r, c = self.block
        rows, cols = self.data.shape
        return self.scale.repeat_interleave(r, dim=0)[:rows].repeat_interleave(c, dim=1)[:, :cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.data.float() / self.expanded_scale()).to(dtype)


def _scale_from_amax(amax: Tensor, fmt: Fp8Format) -> Tensor:
    # The clamp only matters for amax in fp32's subnormal range, where fp8_max / amax overflows;
    # capping the scale keeps data finite (such tensors dequantize to ~0, which is what they are).
    scale = (fmt.max / amax).clamp(max=_FP32_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _cast(x32: Tensor, scale: Tensor, fmt: Fp8Format) -> Tensor:
    return (x32 * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def quantize_tensorwise(
    x: Tensor, fmt: Fp8Format | torch.dtype | str = E4M3, *, amax: Tensor | float | None = None
) -> Quantized:
    """One scale for the whole tensor, from ``amax`` if given (delayed scaling passes the history's
    max) else from the tensor's own current amax. Values beyond a given amax saturate."""
    fmt = fp8_format(fmt)
    x32 = x.float()
    if amax is None:
        amax_t = x32.abs().amax() if x32.numel() else torch.zeros((), device=x.device)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(())
    scale = _scale_from_amax(amax_t, fmt)
    return Quantized(_cast(x32, scale, fmt), scale, fmt, Granularity.TENSOR)


def quantize_rowwise(x: Tensor, fmt: Fp8Format | torch.dtype | str = E4M3, *, axis: int = -1) -> Quantized:
    """One scale per slice along ``axis``: for a GEMM operand, ``axis`` is the contraction axis, so
    every output element is a sum of products that each carry a single pair of scales and the
    scales factor out of the sum (what lets rowwise ``_scaled_mm`` apply them after accumulation)."""
    fmt = fp8_format(fmt)
    if x.dim() == 0:
        raise ValueError("rowwise quantization needs a tensor with at least one dimension")
    axis = axis % x.dim()
    x32 = x.float()
    if x32.size(axis) == 0:
        amax = x32.new_zeros(x32.shape[:axis] + (1,) + x32.shape[axis + 1 :])
    else:
        amax = x32.abs().amax(dim=axis, keepdim=True)
    scale = _scale_from_amax(amax, fmt)
    return Quantized(_cast(x32, scale, fmt), scale, fmt, Granularity.ROW, axis=axis)


def _tiles(x32: Tensor, block: tuple[int, int]) -> tuple[Tensor, int, int]:
    """``x32`` zero-padded to whole tiles and viewed as (tile_rows, r, tile_cols, c)."""
    r, c = block
    rows, cols = x32.shape
    padded = F.pad(x32, (0, (-cols) % c, 0, (-rows) % r))
    tr, tc = padded.shape[0] // r, padded.shape[1] // c
    return padded.reshape(tr, r, tc, c), tr, tc


def _quantize_tiles(x: Tensor, block: tuple[int, int], fmt: Fp8Format, power_of_two: bool) -> Quantized:
    if x.dim() != 2:
        raise ValueError(f"tile/block quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    r, c = (int(b) for b in block)
    if r < 1 or c < 1:
        raise ValueError(f"tile shape must be positive, got {block}")
    rows, cols = x.shape
    x32 = x.float()
    tiles, tr, tc = _tiles(x32, (r, c))
    amax = tiles.abs().amax(dim=(1, 3)) if tiles.numel() else x32.new_zeros(tr, tc)
    scale = _mx_scale_from_amax(amax, fmt) if power_of_two else _scale_from_amax(amax, fmt)
    data = _cast(tiles, scale[:, None, :, None], fmt).reshape(tr * r, tc * c)[:rows, :cols]
    return Quantized(data, scale, fmt, Granularity.BLOCK, block=(r, c), power_of_two=power_of_two)


def quantize_blocks(x: Tensor, block: tuple[int, int], fmt: Fp8Format | torch.dtype | str = E4M3) -> Quantized:
    """One scale per ``(r, c)`` tile of a 2-D tensor: (1, 128) tiles for activations and gradients
    and (128, 128) blocks for weights in DeepSeek-V3's recipe. An outlier then only costs precision
    to the values sharing its tile, instead of to the whole tensor."""
    return _quantize_tiles(x, block, fp8_format(fmt), power_of_two=False)


def _mx_scale_from_amax(amax: Tensor, fmt: Fp8Format) -> Tensor:
    # OCP MX v1.0, section 6.3: shared exponent X = floor(log2(amax)) - emax_elem, elements x / 2**X.
    # frexp gives floor(log2) exactly (amax = m * 2**e with m in [0.5, 1) => floor(log2 amax) = e - 1),
    # where torch.log2 could round a value just under a power of two up to it.
    _, exponent = torch.frexp(amax)
    shared = (exponent.to(torch.int32) - 1 - fmt.emax).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scale = torch.pow(2.0, (-shared).float())  # exact: integer powers of two are representable
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_mx(
    x: Tensor, fmt: Fp8Format | torch.dtype | str = E4M3, *, axis: int = -1, block_size: int = MX_BLOCK_SIZE
) -> Quantized:
    """MXFP8: blocks of ``block_size`` consecutive elements along ``axis`` of a 2-D tensor share a
    power-of-two (E8M0) scale. As the spec chooses the exponent from floor(log2(amax)), the block's
    amax lands in [2**emax, 2**(emax + 1)), so the largest elements may exceed the format's max
    (448 for E4M3) and saturate; that is the spec's behaviour, traded for scales that are pure
    exponent shifts."""
    if x.dim() != 2:
        raise ValueError(f"MX quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    axis = axis % 2
    block = (1, block_size) if axis == 1 else (block_size, 1)
    return _quantize_tiles(x, block, fp8_format(fmt), power_of_two=True)


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in float64 (0 when both are zero)."""
    exact64 = exact.double()
    denom = exact64.norm().item()
    err = (approx.double() - exact64).norm().item()
    if denom == 0:
        return 0.0 if err == 0 else math.inf
    return err / denom
