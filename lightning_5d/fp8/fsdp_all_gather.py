"""FP8 all-gather of ZeRO-3 (FSDP2) parameters: 1 byte per weight element on the wire instead of 4.

FSDP2 (``fully_shard``) lets the sharded local tensor of a parameter decide what is
all-gathered: if it defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, FSDP sends
what the first returns and builds the unsharded parameter from what the second returns.
:class:`Fp8AllGatherWeight` is such a tensor. Before the all-gather each rank

1. takes the amax of its shard and all-reduces it with MAX over the FSDP shard group, so
   every rank scales with the same tensorwise scale ``448 / amax`` of the *whole* weight;
2. casts ``shard * scale`` to ``float8_e4m3fn`` with saturation and sends the bytes viewed
   as ``uint8`` (gloo cannot all-gather float8 dtypes; FSDP gathers mixed dtypes as bytes
   anyway), the scale going along as metadata.

After the all-gather the fp8 bytes are dequantized to **float32** (``q / scale``). The
consumer (an FP8 linear) quantizes that weight again with its own tensorwise scale; since
the dequantized tensor keeps the amax up to fp32 rounding, the re-quantization yields the
very same fp8 values, so training with this all-gather is numerically the FP8-compute
training without it (the distributed tests check this to 1e-6 over AdamW steps; the runs
there agree bit for bit). A bfloat16 dequantization keeps the fp8 bytes but not the scale:
the amax rounded to 8 bits of mantissa moves the consumer's scale, and so every weight it
dequantizes, by up to 2^-8 relative (0.4% measured), where fp32 moves it by at most ulps.

Use it only for weights whose consumer quantizes them to fp8 anyway: for a plain
``nn.Linear`` it silently adds fp8 quantization error to the weight.

Limits (torch 2.13 FSDP2; see also :func:`enable_fp8_all_gather`):

- The unsharded weight is float32 whatever ``MixedPrecisionPolicy.param_dtype`` says, so its
  gradient is float32 as well. FSDP2 reduce-scatters the gradients of one ``fully_shard``
  unit in one buffer and asserts that they share a dtype: with ``param_dtype=bfloat16`` a
  unit must not mix fp8-gathered weights with other parameters that get gradients (biases,
  norms), and the consumer must accept a float32 weight next to bfloat16 activations.
- ``reshard_after_forward`` as an int strictly between 1 and the shard group size (re-shard
  to a smaller group after forward) raises ``NotImplementedError`` inside FSDP2 for
  all-gather extensions; ``True``/``False`` (and 1 or the group size) work.
- HSDP works: the amax is reduced over the shard group only, replicas hold equal weights.
- Plain (non-DTensor) weights only: a tensor-parallel weight would need its amax reduced
  over the TP group as well.
- One small amax all-reduce per weight per all-gather (forward, and backward again when
  the unit reshards after forward).
- ``state_dict()`` gives plain tensors (a state-dict hook unwraps the subclass, sharing
  storage), so ``torch.save``/``torch.load(weights_only=True)``, ``get_model_state_dict``
  and DCP see ordinary DTensors and tensors. Loading with ``load_state_dict`` copies into
  the existing parameters and keeps the FP8 all-gather; ``load_state_dict(assign=True)``
  replaces the parameters by the plain loaded tensors and turns it off for them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Fp8AllGatherWeight", "enable_fp8_all_gather", "fp8_all_gather_names"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Keeps the scale finite for an all-zero weight (torchao uses the same floor).
AMAX_EPS = 1e-12
GATHERED_DTYPE = torch.float32

aten = torch.ops.aten

# Ops after which the result must still be an Fp8AllGatherWeight. FSDP2 builds the
# padded shard with chunk/split, new_zeros, narrow (slice), copy_ and view(-1) on the
# parameter and takes the sharded local tensor from them; detach/alias come from
# nn.Parameter and .data; clone/_to_copy/empty_like keep the extension through
# deepcopy, .to(device) and meta-device initialization. Everything else (arithmetic,
# zeros_like for optimizer states, reductions) returns plain tensors.
_PRESERVE = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
    aten.clone.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A weight (any floating dtype) that FSDP2 all-gathers as tensorwise-scaled fp8.

    A wrapper subclass: ``_tensor`` holds the data and every op runs on it; the ops FSDP2
    shards with return the subclass again, in-place ops (optimizer steps, ``copy_``) return
    the wrapper they mutated, all other ops return plain tensors.
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        if isinstance(tensor, Fp8AllGatherWeight):
            tensor = tensor._tensor
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor._tensor if isinstance(tensor, Fp8AllGatherWeight) else tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers: dict[int, Fp8AllGatherWeight] = {}

        def unwrap(t: Fp8AllGatherWeight) -> torch.Tensor:
            wrappers[id(t._tensor)] = t
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)

        def rewrap(x: torch.Tensor) -> torch.Tensor:
            # In-place and out= ops return their (inner) argument: hand back its wrapper.
            mutated = wrappers.get(id(x))
            if mutated is not None:
                return mutated
            return cls(x) if func in _PRESERVE else x

        return pytree.tree_map_only(torch.Tensor, rewrap, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner_tensors["_tensor"])

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r})"

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        shard = self._tensor
        amax = shard.abs().amax().to(torch.float32) if shard.numel() else shard.new_zeros((), dtype=torch.float32)
        group = mesh.get_group()
        if dist.get_world_size(group) > 1:
            # Every rank must quantize with the scale of the whole weight, or the gathered
            # shards would carry different scales under one metadata tensor.
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = torch.full_like(amax, E4M3_MAX) / amax.clamp(min=AMAX_EPS)
        data = (shard.to(torch.float32) * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8)
        # FSDP pads uneven dim-0 shards up to ceil(rows / world); the local tensor is the
        # unpadded view, but every rank must send the padded size.
        padded_rows = data.size(0)
        if data.size(0) != outer_size[0]:
            padded_rows = math.ceil(outer_size[0] / mesh.size())
        if padded_rows != data.size(0):
            padded = data.new_zeros((padded_rows, *data.shape[1:]))
            padded[: data.size(0)].copy_(data)
            data = padded
        return (data,), (scale,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple[torch.Tensor, ...],
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        (data,) = all_gather_outputs
        (scale,) = metadata
        fp8 = data.view(E4M3)
        if out is not None:
            # After the first all-gather FSDP re-allocates the storage of the tensor we
            # returned then and passes the parameter that views it: refill it in place.
            # The version counter must not move, or autograd would reject the weight that
            # forward saved for backward when backward gathers it again.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(fp8[: out.size(0)].view(out.shape))
                out.div_(scale)
            return None
        values = fp8.to(GATHERED_DTYPE)
        values.div_(scale)
        return values, (values,)


def _unwrap_state_dict_entry(value: Any) -> Any:
    if isinstance(value, DTensor) and isinstance(value._local_tensor, Fp8AllGatherWeight):
        return DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, Fp8AllGatherWeight):
        return value._tensor
    return value


def _plain_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for attr in getattr(module, "_fp8_all_gather_attrs", ()):
        key = prefix + attr
        # keep_vars=True asks for the Parameter objects themselves: leave those alone.
        if key in state_dict and state_dict[key] is not module._parameters.get(attr):
            state_dict[key] = _unwrap_state_dict_entry(state_dict[key])


def enable_fp8_all_gather(module: nn.Module, names: Iterable[str]) -> list[str]:
    """Make FSDP2 all-gather the ``weight`` of the submodules at ``names`` in fp8.

    Call before ``fully_shard``. Each weight Parameter is replaced by a Parameter wrapping
    :class:`Fp8AllGatherWeight` (same data, same ``requires_grad``), set on every module
    that holds the old Parameter so shared weights stay shared. Already converted weights
    are left alone. Returns ``names`` as a list.
    """
    names = list(names)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, param in sub._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((sub, attr))
    for name in names:
        sub = module.get_submodule(name)
        weight = sub._parameters.get("weight")
        if weight is None:
            raise TypeError(f"{name or 'the root module'} ({type(sub).__name__}) has no weight Parameter")
        if isinstance(weight, Fp8AllGatherWeight):
            continue
        if isinstance(weight, DTensor):
            raise ValueError(
                f"{name}.weight is already a DTensor: enable the FP8 all-gather before fully_shard, and not on "
                "tensor-parallel weights (their amax would have to be reduced over the TP group too)"
            )
        if not weight.is_floating_point() or weight.dtype in (E4M3, torch.float8_e5m2):
            raise TypeError(f"{name}.weight must be a high-precision floating tensor, got {weight.dtype}")
        new = nn.Parameter(Fp8AllGatherWeight(weight.detach()), requires_grad=weight.requires_grad)
        for holder, attr in holders.get(id(weight), [(sub, "weight")]):
            setattr(holder, attr, new)
            attrs = holder.__dict__.setdefault("_fp8_all_gather_attrs", set())
            if not attrs:
                holder.register_state_dict_post_hook(_plain_state_dict_hook)
            attrs.add(attr)
    return names


def fp8_all_gather_names(module: nn.Module) -> list[str]:
    """Dotted names of the parameters of ``module`` (sharded by FSDP2 or not) that are
    all-gathered in fp8."""
    out = []
    for name, param in module.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, Fp8AllGatherWeight):
            out.append(name)
    return out
