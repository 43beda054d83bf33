"""The two 8-bit float formats FP8 training uses, and the facts the scaling code needs about them.

E4M3 (``torch.float8_e4m3fn``: no infinities, one NaN pattern, so the top binade is usable up to
448) keeps one more mantissa bit and is used for values whose precision matters (activations,
weights). E5M2 (``torch.float8_e5m2``, IEEE-like with inf) trades that bit for range and is the
usual choice for gradients, whose magnitudes spread further ("hybrid" FP8).

The error bounds here are what the tests check quantization against: round-to-nearest with ``m``
mantissa bits is off by at most half a unit in the last place, i.e. a relative error of
``2**-(m + 1)`` for numbers in the normal range; below it (subnormals) the error is at most half
the subnormal spacing in absolute terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its torch dtype, range and precision."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    max: float  # largest finite value; scaling maps a tensor's amax here and clamps past it
    emax: int  # exponent of the largest normal binade (floor(log2(max))), used by MX scales

    @property
    def min_normal(self) -> float:
        return float(torch.finfo(self.dtype).smallest_normal)

    @property
    def subnormal_step(self) -> float:
        """Spacing of the subnormals (= the smallest positive value)."""
        return self.min_normal * 2.0**-self.mantissa_bits

    @property
    def relative_error(self) -> float:
        """Worst relative rounding error for a number in the normal range (half an ulp)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def absolute_error_subnormal(self) -> float:
        """Worst absolute rounding error below the normal range (half the subnormal spacing)."""
        return self.subnormal_step / 2


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, exponent_bits=4, mantissa_bits=3, max=448.0, emax=8)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, exponent_bits=5, mantissa_bits=2, max=57344.0, emax=15)

FORMATS: dict[str, Fp8Format] = {E4M3.name: E4M3, E5M2.name: E5M2}


def fp8_format(spec: Fp8Format | torch.dtype | str) -> Fp8Format:
    """The format named by a format, a torch fp8 dtype or a name ("e4m3", "e5m2")."""
    if isinstance(spec, Fp8Format):
        return spec
    for fmt in FORMATS.values():
        if spec == fmt.dtype or spec == fmt.name:
            return fmt
    raise ValueError(f"not an FP8 format this backend supports: {spec!r} (expected one of {sorted(FORMATS)})")
