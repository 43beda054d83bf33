"""Layer and group norms of mixed dtypes on CPU, computed as CUDA autocast computes them.

Under bf16 mixed precision (and FP8, which is bf16 mixed outside its FP8 linears) the plugin
casts parameters to bf16, norm weights included, and runs the forward under ``torch.autocast``.
A model that adds a float32 buffer (a sinusoidal position table) to its bf16 activations gets
float32 activations from then on (type promotion; an add is not an autocast op), so its next
``LayerNorm`` sees a float32 input and bf16 weights. CUDA autocast runs ``layer_norm`` and
``group_norm`` in float32 (every argument cast up), so the model trains there unchanged; CPU
autocast has no such rule, and the CPU kernels refuse the mix ("mixed dtype (CPU): expect
parameter to have scalar type of Float").

:class:`CpuNormsAsAutocast` is a torch-function mode the precision plugin enters with autocast
on CPU: a layer / group norm whose floating input and weight (or bias) dtypes differ is computed
in float32, as CUDA autocast would; every other call, and norms of one dtype, run untouched (so
numbers of models that ran before do not move).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# function -> (position of the input, positions of the weight and bias) in its signature
_NORMS = {
    F.layer_norm: (0, (2, 3)),
    torch.layer_norm: (0, (2, 3)),
    F.group_norm: (0, (2, 3)),
    torch.group_norm: (0, (2, 3)),
}


def _float32(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class CpuNormsAsAutocast(TorchFunctionMode):
    """float32 layer / group norms where CPU kernels would refuse mixed input and parameter dtypes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _NORMS.get(func)
        if spec is not None:
            args, kwargs = _upcast_if_mixed(spec, list(args), dict(kwargs))
        return func(*args, **kwargs)


def _upcast_if_mixed(spec: tuple[int, tuple[int, int]], args: list, kwargs: dict) -> tuple[list, dict]:
    at, (w_at, b_at) = spec
    x = args[at] if len(args) > at else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.device.type != "cpu":
        return args, kwargs
    params = [args[i] if len(args) > i else kwargs.get(name) for i, name in ((w_at, "weight"), (b_at, "bias"))]
    if all(not isinstance(p, torch.Tensor) or p.dtype == x.dtype for p in params):
        return args, kwargs
    args = [_float32(a) if i in (at, w_at, b_at) else a for i, a in enumerate(args)]
    kwargs = {k: _float32(v) if k in ("input", "weight", "bias") else v for k, v in kwargs.items()}
    return args, kwargs
