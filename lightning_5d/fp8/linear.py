"""``Fp8Linear``: an ``nn.Linear`` whose three GEMMs run on FP8 operands (torch-native backend).

For ``y = x @ W.T`` with ``x`` (M, K), ``W`` (N, K) and upstream gradient ``dy`` (M, N):

    GEMM    A (rows, contraction)   B (rows, contraction)   contracted
    fprop   x    (M, K)             W    (N, K)             K (features in)
    dgrad   dy   (M, N)             W.T  (K, N)             N (features out)
    wgrad   dy.T (N, M)             x.T  (K, M)             M (tokens)

Every GEMM is written as ``A @ B.T`` with both operands laid out (rows, contraction), so each
recipe's rule "quantize along the contraction dimension" is the same call for all three. Each
scale then covers one stretch of a single sum (all of it for per-tensor and rowwise scales, one
tile for blockwise and MX), so it can be factored out of that sum, or out of that tile's partial
sum, and applied after fp32 accumulation. Per recipe:

* tensorwise / delayed: one scale per tensor; E4M3 for x and W, E5M2 for dy ("hybrid"). The same
  scale (current amax, or the history's for delayed) is used for an operand in every GEMM it
  enters, so a tensor is quantized consistently in forward and backward.
* rowwise: E4M3 x/W, E5M2 dy, one scale per row of each operand above, so x and dy are
  re-quantized along the token axis for wgrad.
* blockwise (DeepSeek-V3): E4M3 everywhere; x and dy in 1x128 tiles along the contraction axis (for
  wgrad the tiles run along tokens), W in 128x128 blocks.
* mxfp8: E4M3 elements in 1x32 blocks along each contraction axis with power-of-two scales.

Accumulation is fp32: with ``torch._scaled_mm`` for tensor and row scales where the device accepts
the operands, else by dequantizing to fp32 and using an fp32 matmul ("emulation"; always the case
for tile and MX scales, which ``_scaled_mm`` on this torch cannot take). The numbers are those of the
FP8 operands either way; only speed differs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_5d.fp8.delayed import (
    DEFAULT_AMAX_HISTORY_LEN,
    advance_amax_histories,
    amax_histories,
    record_amax,
    register_amax_histories,
    scaling_amax,
)
from lightning_5d.fp8.formats import E4M3, E5M2
from lightning_5d.fp8.quantize import (
    Granularity,
    Quantized,
    quantize_blocks,
    quantize_mx,
    quantize_rowwise,
    quantize_tensorwise,
)
from lightning_5d.fp8.recipes import Fp8Recipe

ACTIVATION_TILE = (1, 128)
WEIGHT_BLOCK = (128, 128)

# --------------------------------------------------------------------------------------------
# fp8_disabled: the numerics guard reruns a step's forward in high precision to compare losses.
# A process-wide depth (not thread-local) because the guard may run the model from another thread
# than the one that entered the context, and nesting must not re-enable FP8 early.
# --------------------------------------------------------------------------------------------
_disabled_depth = 0
_disabled_lock = threading.Lock()


@contextmanager
def fp8_disabled() -> Iterator[None]:
    """Every Fp8Linear computes a plain ``F.linear`` inside, and delayed histories stay untouched,
    so a high-precision reference pass leaves the FP8 scaling state exactly as it found it."""
    global _disabled_depth
    with _disabled_lock:
        _disabled_depth += 1
    try:
        yield
    finally:
        with _disabled_lock:
            _disabled_depth -= 1


def fp8_is_disabled() -> bool:
    return _disabled_depth > 0


# --------------------------------------------------------------------------------------------
# Operand quantization and the GEMM
# --------------------------------------------------------------------------------------------


def _amax(t: Tensor) -> Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def quantize_operand(t: Tensor, role: str, recipe: Fp8Recipe, amax: Tensor | None = None) -> Quantized:
    """Quantize a GEMM operand laid out (rows, contraction) as ``recipe`` says for ``role``
    ("input", "weight" or "grad_output"). ``amax`` is the per-tensor amax for tensorwise/delayed."""
    recipe = Fp8Recipe(recipe)
    if recipe in (Fp8Recipe.TENSORWISE, Fp8Recipe.DELAYED):
        return quantize_tensorwise(t, E5M2 if role == "grad_output" else E4M3, amax=amax)
    if recipe is Fp8Recipe.ROWWISE:
        return quantize_rowwise(t, E5M2 if role == "grad_output" else E4M3, axis=-1)
    if recipe is Fp8Recipe.BLOCKWISE:
        return quantize_blocks(t, WEIGHT_BLOCK if role == "weight" else ACTIVATION_TILE, E4M3)
    if recipe is Fp8Recipe.MXFP8:
        return quantize_mx(t, E4M3, axis=-1)
    raise ValueError(f"unknown FP8 recipe {recipe!r}")


# Operand signatures _scaled_mm refused on some device: remembered so that a device without the
# kernel pays for the failed call once, not on every GEMM.
_scaled_mm_refused: set[tuple[Any, ...]] = set()


def _scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> Tensor | None:
    """``a @ b.T`` with ``torch._scaled_mm`` (fp32 accumulation), or None where it does not apply."""
    if a.granularity is not b.granularity or a.granularity not in (Granularity.TENSOR, Granularity.ROW):
        return None
    if not hasattr(torch, "_scaled_mm"):
        return None
    (m, k), n = a.shape, b.shape[0]
    device = a.data.device
    if m == 0 or k == 0 or n == 0:
        return None
    # CUDA kernels (cuBLASLt / CUTLASS) want every dimension a multiple of 16; the CPU kernel has
    # no such rule. Other refusals (formats, row scales on older GPUs, out dtypes) are learned.
    if device.type == "cuda" and (m % 16 or k % 16 or n % 16):
        return None
    key = (device.type, a.fmt.name, b.fmt.name, a.granularity, out_dtype)
    if key in _scaled_mm_refused:
        return None
    # _scaled_mm takes dequantization scales (it computes (a * scale_a) @ (b * scale_b)).
    if a.granularity is Granularity.TENSOR:
        scale_a, scale_b = a.scale.reciprocal().reshape(()), b.scale.reciprocal().reshape(())
    else:
        scale_a, scale_b = a.scale.reciprocal().reshape(m, 1), b.scale.reciprocal().reshape(1, n)
    try:
        # a row-major, b column-major: the layout the CUDA kernels require; free on CPU.
        return torch._scaled_mm(
            a.data.contiguous(), b.data.contiguous().t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
        )
    except (RuntimeError, NotImplementedError, TypeError):
        _scaled_mm_refused.add(key)
        return None


def fp8_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, use_scaled_mm: bool = True) -> Tensor:
    """``a @ b.T`` for operands quantized along their last (contraction) dimension, accumulated in
    fp32 and returned in ``out_dtype``."""
    if use_scaled_mm:
        out = _scaled_mm(a, b, out_dtype)
        if out is not None:
            return out
    return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(out_dtype)


@dataclass
class _GemmSettings:
    recipe: Fp8Recipe
    use_scaled_mm: bool
    histories: dict[str, Tensor]  # delayed only: role -> amax history buffer (module-owned)
    update_history: bool
    module: nn.Module | None = None  # delayed only: where this step's pending amaxes are kept


def _per_tensor(recipe: Fp8Recipe) -> bool:
    return recipe in (Fp8Recipe.TENSORWISE, Fp8Recipe.DELAYED)


def _tensor_amax(t: Tensor, role: str, s: _GemmSettings, push: bool) -> Tensor | None:
    """The per-tensor amax ``t`` is scaled with (tensorwise: its own; delayed: the history's)."""
    if not _per_tensor(s.recipe):
        return None
    current = _amax(t)
    if s.recipe is not Fp8Recipe.DELAYED:
        return current
    amax = scaling_amax(s.histories[role], current)
    if push:
        record_amax(s.module, role, current)
    return amax


class _Fp8LinearFunction(torch.autograd.Function):
    """``x @ W.T`` with FP8 operands in all three GEMMs. Takes 2-D ``x``; runs with autocast off."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, s: _GemmSettings, out_dtype: torch.dtype) -> Tensor:
        amax_x = _tensor_amax(x, "input", s, push=s.update_history)
        amax_w = _tensor_amax(weight, "weight", s, push=s.update_history)
        qx = quantize_operand(x, "input", s.recipe, amax_x)
        qw = quantize_operand(weight, "weight", s.recipe, amax_w)
        y = fp8_gemm(qx, qw, out_dtype, s.use_scaled_mm)
        # Backward keeps the high-precision x and W and re-quantizes them: the simplest correct
        # choice, since rowwise/blockwise/MX need them quantized along another axis for dgrad and
        # wgrad anyway. W is alive as a parameter regardless; x is the real cost (an FP8 copy
        # would be 2-4x smaller for the per-tensor recipes, whose quantization is axis-free).
        # The per-tensor amaxes are saved so that x and W get the forward's scale in backward too.
        ctx.save_for_backward(x, weight, amax_x, amax_w)
        ctx.settings = s
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, weight, amax_x, amax_w = ctx.saved_tensors
        s: _GemmSettings = ctx.settings
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(dy.device.type, enabled=False):
            amax_dy = _tensor_amax(dy, "grad_output", s, push=s.update_history and not fp8_is_disabled())
            dx = dw = None
            if need_dx:
                qdy = quantize_operand(dy, "grad_output", s.recipe, amax_dy)
                qwt = quantize_operand(weight.t(), "weight", s.recipe, amax_w)
                dx = fp8_gemm(qdy, qwt, ctx.x_dtype, s.use_scaled_mm)
            if need_dw:
                qdyt = quantize_operand(dy.t(), "grad_output", s.recipe, amax_dy)
                qxt = quantize_operand(x.t(), "input", s.recipe, amax_x)
                dw = fp8_gemm(qdyt, qxt, ctx.w_dtype, s.use_scaled_mm)
        return dx, dw, None, None


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


def _init_fp8(
    module: nn.Module,
    recipe: Fp8Recipe | str,
    device: torch.device | None,
    amax_history_len: int = DEFAULT_AMAX_HISTORY_LEN,
    use_scaled_mm: bool = True,
) -> None:
    """The FP8 settings (and, for the delayed recipe, the amax histories) of a module running FP8 GEMMs."""
    module.recipe = Fp8Recipe(recipe)
    module.use_scaled_mm = bool(use_scaled_mm)
    module.amax_history_len = int(amax_history_len)
    if module.recipe is Fp8Recipe.DELAYED:
        register_amax_histories(module, module.amax_history_len, device)


def _fp8_matmul(module: nn.Module, x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in FP8 with ``module``'s recipe, options and (delayed) amax histories."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"{type(module).__name__}: input has {x.shape[-1]} features but the weight is {tuple(weight.shape)}"
        )
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    settings = _GemmSettings(module.recipe, module.use_scaled_mm, amax_histories(module), module.training, module)
    with torch.autocast(device_type, enabled=False):
        y = _Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, settings, out_dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])

_OPTIONS = ("amax_history_len", "use_scaled_mm")


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` computing its matmul in FP8 with ``recipe``; parameters stay as they are
    (fp32 or bf16) and are quantized on the fly, so optimizers, checkpoints and ZeRO/FSDP see the
    same tensors as for the plain module.

    ``forward`` reads ``self.weight`` at call time and takes its shape from it, not from
    ``in_features``/``out_features``: tensor parallelism swaps in a local shard of the weight.
    Inputs may have any leading dimensions. The output dtype is the autocast dtype when autocast is
    on for the input's device, else the input's dtype; the bias is added after the GEMM in that
    dtype.

    Options: ``amax_history_len`` (delayed recipe; default 16) and ``use_scaled_mm`` (default True:
    use ``torch._scaled_mm`` where it applies; False always emulates, for comparisons).

    Delayed scaling: every forward in training mode (input, weight) and the matching backward
    (grad_output) records its amax as pending; :meth:`advance_history` (``FiveDPrecision`` calls it
    after each optimizer step) pushes the step's largest into the history. Within a step the scale
    therefore never changes, so an activation-checkpoint recompute quantizes as its forward did.
    Eval mode and :func:`fp8_disabled` record nothing.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Fp8Recipe | str = Fp8Recipe.TENSORWISE,
        **options: Any,
    ) -> None:
        self._check_options(options)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, self.weight.device, **options)

    def _init_fp8(self, recipe: Fp8Recipe | str, device: torch.device, **options: Any) -> None:
        _init_fp8(self, recipe, device, **options)

    @staticmethod
    def _check_options(options: dict[str, Any]) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"unknown Fp8Linear option(s) {unknown}; known: {list(_OPTIONS)}")

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Fp8Recipe | str = Fp8Recipe.TENSORWISE, **options: Any
    ) -> "Fp8Linear":
        """An Fp8Linear holding the very Parameter objects of ``linear`` (optimizers and other code
        keep references to them), in the same train/eval mode and on the same device. Hooks and
        other state registered on ``linear`` are not carried over: convert before wrapping."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        cls._check_options(options)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.register_parameter("weight", linear.weight)
        new.register_parameter("bias", linear.bias)
        new._init_fp8(recipe, linear.weight.device, **options)
        new.train(linear.training)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.value}"

    def _fp8_matmul(self, x: Tensor) -> Tensor:
        return _fp8_matmul(self, x, self.weight)

    def advance_history(self) -> None:
        """End of an optimizer step (delayed recipe): the step's amaxes enter the histories."""
        advance_amax_histories(self)

    def matmul_no_bias(self, x: Tensor) -> Tensor:
        """``x @ W.T`` in FP8, without the bias: row-parallel TP all-reduces this partial sum and
        adds the bias once afterwards."""
        if fp8_is_disabled():
            return F.linear(x, self.weight)
        return self._fp8_matmul(x)

    def forward(self, x: Tensor) -> Tensor:
        if fp8_is_disabled():
            return F.linear(x, self.weight, self.bias)
        y = self._fp8_matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Fp8Projection(nn.Module):
    """The FP8 GEMM of a projection whose weight another module holds as a bare parameter
    (``nn.MultiheadAttention``'s ``in_proj_weight``, used row block by row block): no parameters of
    its own, ``forward(x, weight, bias)`` computes ``x @ weight.T (+ bias)`` as :class:`Fp8Linear`
    does, with the same recipes, options and delayed-scaling histories (one set for every GEMM of
    that weight: the step's largest amax over q, k and v). The weight is passed at each call, so it
    is whatever the owner holds then (a tp shard, FSDP2's gathered parameter)."""

    def __init__(
        self, recipe: Fp8Recipe | str = Fp8Recipe.TENSORWISE, device: torch.device | None = None, **options: Any
    ) -> None:
        Fp8Linear._check_options(options)
        super().__init__()
        _init_fp8(self, recipe, device, **options)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe.value}"

    def advance_history(self) -> None:
        advance_amax_histories(self)

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if fp8_is_disabled():
            return F.linear(x, weight, bias)
        y = _fp8_matmul(self, x, weight)
        return y if bias is None else y + bias.to(y.dtype)
