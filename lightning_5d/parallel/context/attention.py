"""Routing an unchanged model's attention to ring attention over the cp ranks.

Two routes, chosen per model at setup:

* **SDPA call**: the attention modules found by discovery run under a ``TorchFunctionMode``
  that turns their ``F.scaled_dot_product_attention`` call into :func:`ring_attention`.
  Only those modules are intercepted, and only while a sequence shard is current, so SDPA
  elsewhere (a metric, a callback's generation) is left alone. Activation-checkpoint
  recomputation in backward goes through the same module forward, so it is routed too.
* **Hugging Face attention interface**: Hugging Face models pick their kernel by name from
  ``config._attn_implementation``; we register ours under :data:`HF_IMPLEMENTATION` and
  switch the model to it for the duration of each step (its own implementation, and with
  it its masks, is back outside steps). Because the name has no mask function, Hugging
  Face builds no attention mask during a step (ring attention applies the causal structure
  itself), which is also why zig-zag position ids are not mistaken for packed sequences;
  a mask passed in is checked instead: all ones is dropped, anything else refused.

What ring attention cannot honour is refused with the reason: explicit masks (padding,
documents), attention dropout, sliding windows, keys of another length (caches,
cross-attention), attention that spells out the softmax instead of calling a kernel. One
kind of mask is honoured: an ALiBi bias the discovery probe proved to be per-head slopes times
token distances (``AttentionPlan.linear_bias``). Each call's mask is proven again, its slopes
read from it (under tp: the rank's heads), and ring attention rebuilds every block's bias from
the global positions of its tokens (:mod:`.block_bias`); the mask itself, built from the
shard's local numbering, is not used.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.config import ContextParallelMode, SequenceSharding
from lightning_5d.parallel.context.batch import ContextParallelError
from lightning_5d.parallel.context.hybrid import hybrid_attention
from lightning_5d.parallel.context.multihead import prepare_multihead
from lightning_5d.parallel.context.ring import ring_attention
from lightning_5d.parallel.context.state import ContextState
from lightning_5d.parallel.context.ulysses import alltoall_attention
from lightning_5d.plan.linear_bias import LinearBias, read_linear_bias
from lightning_5d.plan.model_plan import AttentionKernel, ModelPlan

HF_IMPLEMENTATION = "lightning_5d_ring"
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# The ContextParallel whose step is running, for the Hugging Face interface function,
# which Hugging Face calls without any handle of ours.
_ACTIVE: list[ContextState] = []


def attend(
    cp: ContextState, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None,
    mask: Any = None, dropout: float = 0.0, where: str = "attention", bias: LinearBias | None = None,
) -> Tensor:  # fmt: skip
    """Attention of this rank's queries ([b, h, s_local, d]) over the whole sequence, by ``cp.mode``.

    ``bias``: an ALiBi bias added at the tokens' global positions (ring and allgather modes)."""
    if mask is not None:
        raise ContextParallelError(
            f"{where} got an explicit attention mask of shape {tuple(getattr(mask, 'shape', ()))}; ring attention "
            f"under cp={cp.size} applies causal (or full) attention itself and takes no mask. A causal mask built "
            f"from the length (ones(s, s).tril(), a sliced bias buffer) would be the shard's: pass is_causal=True "
            f"instead. Drop padding/document masks and mark padded positions with label -100 (right padding is then "
            f"exact), or use cp=1."
        )
    if dropout and torch.is_grad_enabled():
        raise ContextParallelError(
            f"{where} uses attention dropout p={dropout}, which ring attention does not implement; set the "
            f"model's attention dropout to 0 for cp={cp.size}."
        )
    if q.size(-2) != k.size(-2) or q.size(-2) != cp.current_shard.local_len:
        raise ContextParallelError(
            f"{where}: {q.size(-2)} queries against {k.size(-2)} keys, but this rank holds "
            f"{cp.current_shard.local_len} tokens; under cp={cp.size} attention must be self-attention over the "
            f"step's sequence shard (no KV cache, no cross-attention)."
        )
    cp.attention_calls += 1
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    if bias is not None and cp.mode not in _BIAS_MODES:
        raise ContextParallelError(_bias_mode_refusal(cp, where))
    if cp.mode is ContextParallelMode.HYBRID:
        return hybrid_attention(q, k, v, cp.ulysses_group, cp.ulysses, cp.ring_group, causal=causal,
                                sharding=cp.sharding, scale=scale, stats=cp.stats)  # fmt: skip
    if cp.mode is ContextParallelMode.ALL_TO_ALL:
        return alltoall_attention(q, k, v, cp.group, cp.size, causal=causal,
                                  zigzag=cp.sharding is SequenceSharding.ZIGZAG,
                                  scale=scale)  # fmt: skip
    return ring_attention(q, k, v, cp.group, causal=causal, mode=cp.mode, sharding=cp.sharding, scale=scale,
                          stats=cp.stats, bias=bias)  # fmt: skip


_BIAS_MODES = (ContextParallelMode.RING, ContextParallelMode.ALL_GATHER)


def _bias_mode_refusal(cp: ContextState, where: str) -> str:
    return (
        f"{where} passes an ALiBi attention bias, which context.mode={cp.mode.value!r} does not carry (its all-to-all "
        f"regroups heads and positions); use context.mode='ring' or 'allgather' for cp={cp.size}, which rebuild the "
        f"bias from global positions."
    )


def _proven_bias(cp: ContextState, mask: Tensor, planned: LinearBias, where: str) -> LinearBias:
    """This call's mask read as the ALiBi bias the probe proved; its slopes must be one tp rank's
    share of the probe's (all of them at tp=1), in order."""
    found = read_linear_bias(mask)
    share = len(found.slopes) if found is not None else 0
    shares = {planned.slopes[i : i + share] for i in range(0, len(planned.slopes), share or 1)}
    if found is None or (found.form, found.causal) != (planned.form, planned.causal) or found.slopes not in shares:
        raise ContextParallelError(
            f"{where} passed an attn_mask of shape {tuple(mask.shape)} that is not the ALiBi bias the discovery probe "
            f"proved (slopes {planned.slopes} x {planned.form.value} distances, causal={planned.causal}): ring attention "
            f"under cp={cp.size} rebuilds the bias from global positions, so the mask must be that shape on the "
            f"shard's own tokens (built from arange of the length it is called with). Use cp=1 for this model."
        )
    return found


class _SdpaAsRing(TorchFunctionMode):
    def __init__(self, cp: ContextState, where: str, bias: LinearBias | None = None) -> None:
        super().__init__()
        self.cp, self.where, self.bias = cp, where, bias

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        causal, mask, bias = bool(bound.get("is_causal", False)), bound.get("attn_mask"), None
        if self.bias is not None and mask is not None:
            bias = _proven_bias(self.cp, mask, self.bias, self.where)
            causal, mask = bias.causal, None
        return attend(
            self.cp, bound["query"], bound["key"], bound["value"], causal=causal, scale=bound.get("scale"),
            mask=mask, dropout=bound.get("dropout_p", 0.0), where=self.where, bias=bias,
        )  # fmt: skip


def route_sdpa(cp: ContextState, attention: nn.Module, where: str, bias: LinearBias | None = None) -> None:
    """Make ``attention``'s SDPA call ring attention while a shard is current (``bias``: the
    ALiBi bias the probe proved for its mask)."""

    def sharded(original: Any, *args: Any, **kwargs: Any) -> Any:
        with _SdpaAsRing(cp, where, bias):
            return original(*args, **kwargs)

    cp.wrap_forward(attention, sharded)


def hf_ring_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """The Hugging Face attention-interface function; SDPA when no shard is current."""
    if not _ACTIVE or _ACTIVE[-1].current is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    cp = _ACTIVE[-1]
    where = type(module).__name__
    window = kwargs.get("sliding_window")
    if window is not None and window < cp.current_shard.seq_len:
        raise ContextParallelError(
            f"{where} uses a sliding window of {window} tokens on {cp.current_shard.seq_len}-token sequences; ring "
            f"attention does not implement windows yet. Use cp=1, or sequences no longer than the window."
        )
    unsupported = [k for k in ("softcap", "s_aux", "head_mask") if kwargs.get(k) is not None]
    if unsupported:
        raise ContextParallelError(f"{where} passes {unsupported} to attention, which ring attention does not support.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attend(cp, query, key, value, causal=causal, scale=scaling, mask=attention_mask, dropout=dropout,
                 where=where)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def hugging_face_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face ``PreTrainedModel``s inside ``module`` (empty without transformers).

    Looked up in ``sys.modules``, never imported: a model built from ``transformers`` has loaded
    ``transformers.modeling_utils`` already, and importing it for a model that is not one would
    cost every cp rank ~6 MiB of resident memory for nothing (benchmarks/RESULTS.md, context_parallel_scaling).
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return []
    PreTrainedModel = modeling.PreTrainedModel  # noqa: N806 (the class, under its own name)
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(name.startswith(f"{n}.") or not n for n, _ in found):
            found.append((name, sub))
    return found


def route_hugging_face(cp: ContextState, models: list[tuple[str, nn.Module]]) -> None:
    """Register our attention implementation; :class:`HuggingFaceSwitch` selects it per step."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_IMPLEMENTATION, hf_ring_attention)
    for name, model in models:
        if not model._can_set_attn_implementation():
            raise ContextParallelError(
                f"{name or 'the model'} ({type(model).__name__}) does not dispatch attention through Hugging Face's "
                f"AttentionInterface, so cp={cp.size} cannot route it to ring attention; use cp=1 for this model."
            )
        signature = inspect.signature(model.forward)
        check = functools.partial(_check_hf_call, cp, name, signature)
        handle = model.register_forward_pre_hook(check, with_kwargs=True)
        cp.undo.append(handle.remove)


class HuggingFaceSwitch:
    """Selects ring attention for the models while a shard is current and restores their own after.

    Outside steps the models keep their implementation and with it their masks: generation
    or evaluation with padding, a KV cache or another Trainer work as without cp.
    """

    def __init__(self, models: list[tuple[str, nn.Module]]) -> None:
        self.models = [m for _, m in models]
        self._saved: list[str] | None = None

    def on(self) -> None:
        if self._saved is None and self.models:
            self._saved = [m.config._attn_implementation for m in self.models]
            for m in self.models:
                m.set_attn_implementation(HF_IMPLEMENTATION)

    def off(self) -> None:
        if self._saved is not None:
            for m, implementation in zip(self.models, self._saved):
                m.set_attn_implementation(implementation)
            self._saved = None


def _check_hf_call(
    cp: ContextState, name: str, signature: inspect.Signature, model: nn.Module, args: tuple, kwargs: dict
) -> Any:  # fmt: skip
    if cp.current is None:
        return None
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    if bound.get("labels") is not None:
        raise ContextParallelError(
            f"{name or 'the model'}({type(model).__name__}) was called with labels=: Hugging Face's own loss shifts "
            f"the labels inside each sequence shard under cp={cp.size}, losing every chunk's boundary token. Compute "
            f"the loss in training_step from aligned labels: F.cross_entropy(out.logits.flatten(0, 1), "
            f"batch['labels'].flatten())."
        )
    mask = bound.get("attention_mask")
    if isinstance(mask, Tensor):
        # Every cp rank must agree, or one would raise while the others enter the ring.
        padded = (mask == 0).any().to(torch.int32).reshape(1) if mask.dim() == 2 else torch.ones(1, dtype=torch.int32)
        dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=cp.group)
        if padded.item():
            raise ContextParallelError(
                f"the attention_mask passed to {name or 'the model'} masks tokens (padding, or a custom 4-D mask); "
                f"ring attention under cp={cp.size} takes no mask. Pack or right-pad sequences, mark padding with "
                f"label -100 and drop attention_mask, or use cp=1."
            )
    return None


def route_attention(
    cp: ContextState, module: nn.Module, plan: ModelPlan, models: list[tuple[str, nn.Module]]
) -> str:  # fmt: skip
    """Install the route for every block's attention; returns a one-line description.

    ``models``: the Hugging Face models in ``module`` (:func:`hugging_face_models`).
    """
    if models:
        route_hugging_face(cp, models)
        return f"Hugging Face attention interface '{HF_IMPLEMENTATION}' (selected during steps)"
    biased = False
    for i, att in plan.attentions:
        path = f"{plan.block_path(i)}.{att.path}"
        attention = module.get_submodule(path)
        where = f"{path} ({type(attention).__name__})"
        if isinstance(attention, nn.MultiheadAttention):
            # Its SDPA call sits inside F.multi_head_attention_forward, out of the route's reach: it
            # runs the forward built from its parts, whose own SDPA call is routed below.
            prepare_multihead(cp, attention, where)
        if att.kernel is AttentionKernel.EXPLICIT_SOFTMAX:
            raise ContextParallelError(
                f"{where} computes softmax(QKᵀ)V itself, which ring attention cannot replace; call "
                f"F.scaled_dot_product_attention in its forward to use cp={cp.size}, or use cp=1."
            )
        if att.linear_bias is not None:
            # Proven ALiBi by the discovery probe: rebuilt from global positions in each block.
            if cp.mode not in _BIAS_MODES:
                raise ContextParallelError(_bias_mode_refusal(cp, where))
            route_sdpa(cp, attention, where, att.linear_bias)
            biased = True
            continue
        if att.per_head_bias:
            # Seen by the discovery probe: ALiBi-style slopes times token distances, built inside
            # the model. Ring attention takes no bias, and distances built from the shard's own
            # length would be the shard's, not the sequence's.
            raise ContextParallelError(
                f"{where} passes a per-head attention bias (a float attn_mask with one slice per head, as ALiBi's "
                f"slopes x token distances) to F.scaled_dot_product_attention; ring attention under cp={cp.size} "
                f"applies causal attention itself and takes no bias, and distances built from the local length "
                f"would be the shard's. Use cp=1 for this model (ZeRO, tp, sp, pp and FP8 run it), or a position "
                f"encoding without an attention bias (RoPE from position_ids) to use cp."
            )
        route_sdpa(cp, attention, where)
    alibi = " (its ALiBi bias rebuilt from global positions)" if biased else ""
    return f"F.scaled_dot_product_attention in each block's attention{alibi}"
