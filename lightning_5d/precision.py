"""FiveDPrecision: bf16 mixed precision with fp32 master weights, and FP8 recipes, for FiveDStrategy.

bf16 mixed here is Megatron's, not autocast over fp32 weights: parameters and gradients are
bf16 (2 + 2 bytes per parameter), the optimizer steps fp32 masters (+4, then Adam's 8), and
gradients are reduced in fp32 by default. Where the masters live depends on the ZeRO stage,
so the strategy places them (``FiveDStrategy._parallelize``):

- ZeRO-0, or no data-parallel peers: ``MasterWeights`` swaps each bf16 parameter in the
  optimizer for an fp32 copy;
- ZeRO-1/2: the engine's fp32 master slices (one slice per rank);
- ZeRO-3: FSDP2 keeps fp32 shards and casts to bf16 for compute (``MixedPrecisionPolicy``).

The forward also runs under ``torch.autocast(bf16)`` so that the ops autocast keeps in fp32
(softmax, cross entropy, norms) do not lose the loss to bf16 rounding. On CPU, whose autocast
has no float32 rule for norms, ``cpu_norms`` computes a layer / group norm of mixed input and
weight dtypes in float32 as CUDA autocast would (a float32 buffer added to bf16 activations).

FP8 swaps the block projections that model discovery finds (attention, MLP, experts) for
FP8 linears; the head and the router stay bf16 unless asked otherwise. Backends: our own
scaling (``lightning_5d.fp8``, runs on CPU) or Transformer Engine on GPUs that support it.
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from enum import Enum
from functools import partial
from typing import Any, Callable, Generator, Mapping, Sequence

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_5d.cpu_norms import CpuNormsAsAutocast
from lightning_5d.fp8.recipes import Fp8Backend, Fp8Recipe
from lightning_5d.parallel.data.master_weights import MasterWeights


class PrecisionError(ValueError):
    """A precision setting that cannot work; the message names the value and the fix."""


class PrecisionMode(str, Enum):
    BF16_MIXED = "bf16-mixed"
    FP8 = "fp8"  # bf16 mixed whose block projections compute in FP8


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Fp8Config:
    recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    backend: Fp8Backend = Fp8Backend.AUTO
    keep_head_bf16: bool = True  # the output head sees the whole vocabulary's logits
    keep_router_bf16: bool = True  # small, and routing decisions flip on rounding
    fp8_all_gather: bool = False  # ZeRO-3: all-gather parameters as FP8 (tensorwise only)
    amax_history_len: int = 16  # delayed scaling

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", _enum(Fp8Recipe, self.recipe, "fp8.recipe"))
        object.__setattr__(self, "backend", _enum(Fp8Backend, self.backend, "fp8.backend"))
        if self.fp8_all_gather and self.recipe != Fp8Recipe.TENSORWISE:
            raise PrecisionError(
                f"fp8_all_gather=true needs recipe=tensorwise (one scale per tensor, shared by all shards); "
                f"recipe={self.recipe.value} scales per row or block. Use recipe=tensorwise or fp8_all_gather=false."
            )
        if self.amax_history_len < 1:
            raise PrecisionError(f"amax_history_len={self.amax_history_len} must be at least 1.")


@dataclass(frozen=True)
class NumericsGuard:
    """Every ``every`` steps, run the step's forward again with FP8 off and compare losses."""

    every: int = 0  # 0: off
    threshold: float = 0.0025  # DeepSeek-V3 reports < 0.25 % relative loss error for blockwise FP8

    def __post_init__(self) -> None:
        if self.every < 0 or not self.threshold > 0:
            raise PrecisionError(
                f"numerics guard every={self.every}, threshold={self.threshold}: need every >= 0, threshold > 0."
            )

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def _enum(cls: type[Enum], value: Any, what: str) -> Any:
    try:
        return cls(value.value if isinstance(value, Enum) else str(value).lower())
    except ValueError:
        choices = ", ".join(repr(c.value) for c in cls)
        raise PrecisionError(f"{what}={value!r} is not valid; choose one of {choices}.") from None


class FiveDPrecision(Precision):
    """``FiveDPrecision("bf16-mixed")`` or ``FiveDPrecision("fp8", recipe="blockwise")``.

    Strings: ``FiveDPrecision.from_string("fp8-blockwise")``; ``Trainer(strategy="5d",
    precision="bf16-mixed")`` gets this plugin too (the strategy adopts Lightning's).
    """

    # What Lightning and the planner read: compute and gradients are bf16 in both modes.
    precision = "bf16-mixed"

    def __init__(
        self,
        mode: str | PrecisionMode = PrecisionMode.BF16_MIXED,
        recipe: str | Fp8Recipe | None = None,
        *,
        reduce_dtype: str = "fp32",
        accumulation_dtype: str = "bf16",
        fp8: Mapping[str, Any] | Fp8Config | None = None,
        numerics_check_every: int = 0,
        numerics_threshold: float = 0.0025,
    ) -> None:
        self.mode = _enum(PrecisionMode, mode, "precision")
        if reduce_dtype not in REDUCE_DTYPES:
            raise PrecisionError(f"reduce_dtype={reduce_dtype!r} is not valid; choose one of {sorted(REDUCE_DTYPES)}.")
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        if accumulation_dtype not in REDUCE_DTYPES:
            raise PrecisionError(
                f"accumulation_dtype={accumulation_dtype!r} is not valid; choose one of {sorted(REDUCE_DTYPES)}."
            )
        # fp32: micro-batch gradients are reduced as they come and summed in the fp32 masters
        # (the playbook's fp32 gradient accumulation), instead of summing in bf16 first.
        self.fp32_accumulation = accumulation_dtype == "fp32"
        self.param_dtype = torch.bfloat16
        options = dict(fp8) if isinstance(fp8, Mapping) else ({} if fp8 is None else _as_dict(fp8))
        if recipe is not None:
            if "recipe" in options and str(getattr(options["recipe"], "value", options["recipe"])) != str(
                getattr(recipe, "value", recipe)
            ):
                raise PrecisionError(
                    f"two FP8 recipes given: {recipe!r} (precision) and fp8.recipe={options['recipe']!r}; give one."
                )
            options["recipe"] = recipe
        if self.mode == PrecisionMode.BF16_MIXED and (options or numerics_check_every):
            raise PrecisionError(
                "FP8 options (recipe, fp8=..., numerics_check_every) were given with precision='bf16-mixed'; "
                "use FiveDPrecision('fp8', recipe=...) to train with FP8."
            )
        unknown = sorted(set(options) - {f.name for f in fields(Fp8Config)})
        if unknown:
            raise PrecisionError(f"unknown fp8 options {unknown}; known: {[f.name for f in fields(Fp8Config)]}.")
        self.fp8 = Fp8Config(**options) if self.mode == PrecisionMode.FP8 else None
        self.guard = NumericsGuard(numerics_check_every, numerics_threshold)
        self.device_type = "cpu"
        self.attached = False  # set by FiveDStrategy; other strategies would not place masters
        self.fp8_names: list[str] = []
        self.fp8_in_projections: list[str] = []  # nn.MultiheadAttention in-projection weights in FP8
        self._te_recipe = None
        self._amax_group = None
        self._backend: Fp8Backend | None = None
        self._fp8_root: nn.Module | None = None
        self._fp8_suspended = False
        self._masters: dict[int, MasterWeights] = {}
        self.frozen_without_master: list[nn.Parameter] = []  # this fit's (MasterWeights.frozen)

    @classmethod
    def from_string(cls, text: str, **kwargs: Any) -> "FiveDPrecision":
        """'bf16-mixed', 'fp8' (tensorwise) or 'fp8-<recipe>' (e.g. 'fp8-blockwise')."""
        text = str(text).lower()
        if text.startswith("fp8-"):
            return cls(PrecisionMode.FP8, recipe=text[len("fp8-") :], **kwargs)
        return cls(text, **kwargs)

    @staticmethod
    def handles(text: Any) -> bool:
        """Whether ``text`` names one of this plugin's modes (and not a Lightning precision)."""
        return isinstance(text, str) and (text.lower() == "fp8" or text.lower().startswith("fp8-"))

    def describe(self) -> str:
        if self.fp8 is None:
            return (
                f"bf16 mixed (fp32 master weights, {_dtype_name(self.reduce_dtype)} gradient reduction, "
                f"{'fp32' if self.fp32_accumulation else 'bf16'} accumulation)"
            )
        f = self.fp8
        extra = f" and {len(self.fp8_in_projections)} attention in-projections" if self.fp8_in_projections else ""
        return f"fp8 {f.recipe.value} ({self.backend.value}) on {len(self.fp8_names)} linears{extra}, bf16 mixed " \
            "otherwise" + (", fp8 all-gather" if f.fp8_all_gather else "")

    # ------------------------------------------------------------------ model
    def convert_module(self, module: nn.Module) -> nn.Module:
        if not self.attached:
            raise PrecisionError(
                "FiveDPrecision places fp32 master weights per ZeRO stage and converts linears after model "
                "discovery, which FiveDStrategy does; use it with strategy='5d' (or FiveDStrategy(...)). With "
                "another strategy use Lightning's precision='bf16-mixed'."
            )
        return module  # FiveDStrategy converts in its fixed order (_parallelize)

    @property
    def backend(self) -> Fp8Backend:
        """The backend in use (``auto`` is resolved when the strategy applies FP8)."""
        assert self.fp8 is not None
        return self._backend or self.fp8.backend

    def _te_blockers(
        self, layout: Mapping[str, int], activation_checkpointing: bool, experts: bool = False, shapes=(),
        attentions=(),
    ) -> list[str]:  # fmt: skip
        """Why Transformer Engine cannot take this run (empty: it can). ``shapes``: (name, in, out)
        of the linears it would take; ``attentions``: nn.MultiheadAttention modules, whose bare
        in-projection weight no TE layer can take (our own FP8 GEMMs can)."""
        assert self.fp8 is not None
        # Our tp cuts nn.Linear weights, and TE keeps its own; its delayed-scaling amax reduction and
        # activation-checkpoint recompute need TE's own pipeline/expert/checkpoint plumbing.
        blockers = [f"{dim}={size}" for dim, size in layout.items() if size > 1]
        if activation_checkpointing:
            blockers.append("activation checkpointing")
        if experts and not any(size > 1 for size in layout.values()):
            blockers.append("expert dispatch")
        align = 32 if self.fp8.recipe == Fp8Recipe.MXFP8 else 16
        blockers += [f"{n} ({i} -> {o}, not multiples of {align})" for n, i, o in shapes if i % align or o % align]
        if attentions:
            blockers.append(f"nn.MultiheadAttention's in-projection ({attentions[0]})")
        if self.fp8.fp8_all_gather:
            blockers.append("fp8_all_gather")
        if self.fp8.recipe == Fp8Recipe.ROWWISE:
            blockers.append("recipe=rowwise (no Transformer Engine recipe)")
        return blockers

    def _choose_backend(
        self, layout: Mapping[str, int], activation_checkpointing: bool, experts: bool = False, shapes=(),
        attentions=(),
    ) -> Fp8Backend:  # fmt: skip
        from lightning_5d.fp8 import te_backend

        assert self.fp8 is not None
        blockers = self._te_blockers(layout, activation_checkpointing, experts, shapes, attentions)
        if self.fp8.backend == Fp8Backend.TORCH:
            return Fp8Backend.TORCH
        if self.fp8.backend == Fp8Backend.TRANSFORMER_ENGINE:
            if blockers:
                raise PrecisionError(
                    f"fp8.backend=transformer_engine cannot run with {', '.join(blockers)} here; use "
                    f"fp8.backend=torch (or auto), which composes with every dimension."
                )
            te_backend.require_transformer_engine()
            te_backend.check_recipe_supported(self.fp8.recipe)
            return Fp8Backend.TRANSFORMER_ENGINE
        if blockers or not te_backend.te_available():
            return Fp8Backend.TORCH
        try:  # auto: a recipe this GPU or TE build lacks falls back to our own scaling
            te_backend.check_recipe_supported(self.fp8.recipe)
            te_backend.te_recipe(self.fp8.recipe, amax_history_len=self.fp8.amax_history_len)
        except (te_backend.UnsupportedFp8Recipe, te_backend.TransformerEngineMissing):
            return Fp8Backend.TORCH
        return Fp8Backend.TRANSFORMER_ENGINE

    def fp8_targets(self, plan, module: nn.Module) -> list[str]:
        """Dotted paths of the nn.Linear modules that compute in FP8, from the model plan."""
        from lightning_5d.fp8.targets import fp8_targets

        assert self.fp8 is not None
        return fp8_targets(plan, module, self.fp8.keep_head_bf16, self.fp8.keep_router_bf16)

    def apply_fp8(
        self,
        module: nn.Module,
        plan,
        layout: Mapping[str, int],
        activation_checkpointing: bool = False,
        amax_group=None,
        experts: bool = False,
    ) -> list[str]:
        """Swap the planned linears for FP8 ones (the first step of the design's data path).

        ``layout``: the sizes of tp, pp and ep (Transformer Engine takes none of them here);
        ``amax_group``: the data/context-parallel ranks TE's delayed scaling reduces amaxes over.
        """
        assert self.fp8 is not None
        from lightning_5d.fp8.targets import fp8_attention_targets

        names = self.fp8_targets(plan, module)
        attentions = fp8_attention_targets(plan)
        shapes = [(n, module.get_submodule(n).in_features, module.get_submodule(n).out_features) for n in names]
        self._backend = self._choose_backend(layout, activation_checkpointing, experts, shapes, attentions)
        self._fp8_root = module
        self._amax_group = amax_group
        if self._backend == Fp8Backend.TRANSFORMER_ENGINE:
            from lightning_5d.fp8 import te_backend

            self._te_recipe = te_backend.te_recipe(self.fp8.recipe, amax_history_len=self.fp8.amax_history_len)
            self.fp8_names = te_backend.convert_to_te(module, names, self.fp8.recipe)
        else:
            from lightning_5d.fp8.convert import convert_to_fp8

            from lightning_5d.fp8.attention import convert_attention_to_fp8

            options = {"amax_history_len": self.fp8.amax_history_len}
            self.fp8_names = convert_to_fp8(module, names, self.fp8.recipe, **options)
            self.fp8_in_projections = convert_attention_to_fp8(module, attentions, self.fp8.recipe, **options)
        return self.fp8_names

    def enable_fp8_all_gather(self, module: nn.Module, names: list[str]) -> list[str]:
        """ZeRO-3 gathers these linears' weights as FP8 (before fully_shard)."""
        from lightning_5d.fp8.fsdp_all_gather import enable_fp8_all_gather

        return enable_fp8_all_gather(module, names)

    @torch.no_grad()
    def cast_parameters(self, module: nn.Module) -> None:
        """bf16 parameters (ZeRO 0-2; ZeRO-3 keeps fp32 shards and casts per all-gather)."""
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != self.param_dtype:
                p.data = p.data.to(self.param_dtype)

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    # ------------------------------------------------------------------ optimizer
    def reset_masters(self) -> None:
        """Forget the masters of an earlier fit (their optimizers are gone)."""
        self.frozen_without_master = []
        for masters in self._masters.values():
            masters.remove()
        self._masters.clear()

    def add_master_weights(self, optimizer: torch.optim.Optimizer) -> None:
        masters = MasterWeights(optimizer)
        self.frozen_without_master += masters.frozen
        if len(masters):
            self._masters[id(optimizer)] = masters
        else:
            masters.remove()

    def attach_masters(
        self, optimizers: Sequence[torch.optim.Optimizer], automatic_optimization: bool, zero: int
    ) -> None:
        """fp32 masters for the bf16 parameters ``optimizers`` hold (those ZeRO did not shard already);
        a later fit's new optimizers replace the earlier ones."""
        self.reset_masters()
        for optimizer in optimizers:
            self.add_master_weights(optimizer)
        held = [o for o in optimizers if self.masters_of(o) is not None]
        if len(optimizers) > 1 and held and not automatic_optimization:
            raise PrecisionError(
                f"manual optimization with {len(optimizers)} optimizers under bf16 mixed precision at "
                f"zero={zero}: toggle_optimizer switches requires_grad on the fp32 masters, not on the bf16 "
                f"parameters the model computes with, so one optimizer's backward would leave gradients for the "
                f"other. Use zero=1, 2 or 3 (their masters are the sharded parameters), or precision='32-true'."
            )

    def masters_of(self, optimizer: torch.optim.Optimizer) -> MasterWeights | None:
        return self._masters.get(id(getattr(optimizer, "_optimizer", optimizer)))

    def masters_by_name(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Parameter name -> its fp32 master (the optimizer's parameter, holding the gradient once moved)."""
        names = {id(p): n for n, p in module.named_parameters()}
        return {names[id(p)]: m for masters in self._masters.values() for p, m in masters._pairs if id(p) in names}

    def master_names(self, module: nn.Module) -> dict[int, str]:
        return {id(m): n for n, m in self.masters_by_name(module).items()}

    def after_backward(self, automatic_optimization: bool = True, accumulating: bool = False) -> None:
        """With fp32 accumulation, each micro-batch's gradients move into the fp32 masters now (they
        were reduced already); under manual optimization too, once reduced (not inside a no-sync
        window), so that ``self.clip_gradients`` before ``opt.step()`` sees them."""
        if self.fp32_accumulation or not (automatic_optimization or accumulating):
            for masters in self._masters.values():
                masters.move_grads()

    def refresh_masters(self) -> None:
        for masters in self._masters.values():
            masters.refresh()

    def _wrap_closure(self, model, optimizer, closure: Callable[[], Any]) -> Any:
        result = closure()
        masters = self._masters.get(id(optimizer))
        if masters is not None:  # hooks and clipping after the closure see the fp32 gradients
            masters.move_grads()
        self._after_closure(model, optimizer)
        return result

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        out = optimizer.step(closure=partial(self._wrap_closure, model, optimizer, closure), **kwargs)
        delayed = self.fp8 is not None and self.fp8.recipe == Fp8Recipe.DELAYED
        if delayed and self._fp8_root is not None and self.backend == Fp8Backend.TORCH:
            # Only delayed scaling keeps histories: the other recipes skip the walk over the modules.
            from lightning_5d.fp8.convert import advance_fp8_histories

            # Delayed scaling: the step's amaxes, the max over the data ranks (so every rank keeps the
            # same history, and any rank's checkpoint resumes all of them), enter the histories.
            advance_fp8_histories(self._fp8_root, self._amax_group)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Delayed-scaling histories (this rank's), so a resumed run scales its first step as before."""
        if self._fp8_root is None or self.backend != Fp8Backend.TORCH:
            return {}
        from lightning_5d.fp8.convert import fp8_scaling_state

        state = fp8_scaling_state(self._fp8_root)
        return {"fp8_amax_history": state} if state else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self._fp8_root is not None and "fp8_amax_history" in state_dict:
            from lightning_5d.fp8.convert import load_fp8_scaling_state

            load_fp8_scaling_state(self._fp8_root, state_dict["fp8_amax_history"])

    # ------------------------------------------------------------------ forward
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.param_dtype, cache_enabled=False))
            if self.device_type == "cpu":  # CUDA autocast runs layer/group norms in fp32; CPU's refuses mixed dtypes
                stack.enter_context(CpuNormsAsAutocast())
            if self._te_recipe is not None and not self._fp8_suspended:
                from lightning_5d.fp8.te_backend import te_autocast

                stack.enter_context(te_autocast(self._te_recipe, amax_reduction_group=self._amax_group))
            yield

    @contextmanager
    def fp8_off(self) -> Generator[None, None, None]:
        """The same forward with every FP8 linear computing in bf16 (the numerics guard)."""
        from lightning_5d.fp8.linear import fp8_disabled

        self._fp8_suspended = True
        try:
            with fp8_disabled():
                yield
        finally:
            self._fp8_suspended = False

    def check_numerics(self, fp8_loss: float, bf16_loss: float, warn: bool = True) -> float:
        """The relative loss difference of one step, with a warning past the guard's threshold."""
        rel = abs(fp8_loss - bf16_loss) / max(abs(bf16_loss), 1e-12)
        if warn and (not math.isfinite(rel) or rel > self.guard.threshold):
            warnings.warn(
                f"fp8 numerics guard: loss {fp8_loss:.6g} under fp8 {self.fp8.recipe.value} differs from "  # type: ignore[union-attr]
                f"{bf16_loss:.6g} in bf16 by {rel:.3%} (threshold {self.guard.threshold:.3%}); consider "
                f"recipe=blockwise, keeping more layers in bf16, or bf16-mixed.",
                stacklevel=2,
            )
        return rel

    def teardown(self) -> None:
        # The masters stay: the optimizer still holds them, and a checkpoint saved after fit
        # returns must name them. A new setup makes new optimizers and so new masters.
        pass


def _as_dict(config: Fp8Config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in REDUCE_DTYPES.items()}[dtype]


def precision_plugins(text: Any, options: Mapping[str, Any] | None = None) -> tuple[Any, list[Precision]]:
    """``Trainer(precision=..., plugins=...)`` for a precision string of either kind: ours go in as
    a plugin (Lightning validates its ``precision=`` strings against a fixed list)."""
    if FiveDPrecision.handles(text) or options:
        return None, [FiveDPrecision.from_string(text, **dict(options or {}))]
    return text, []


__all__ = ["FiveDPrecision", "Fp8Config", "NumericsGuard", "PrecisionError", "PrecisionMode", "precision_plugins"]
