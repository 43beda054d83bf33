"""Setup's proof that the applied plan computes what the model computes (design step 4, "verify").

:meth:`PlanCheck.before` keeps weightless copies of the pieces before any dimension
changes the model; :meth:`PlanCheck.after` runs the parallel model once on a probe batch,
then for each piece this rank holds rebuilds the unparallelized piece with the full
weights gathered from the parallel one, feeds it the full-shape input the parallel piece
received and compares the outputs (:mod:`.compare`) and, under ``verify="blocks"``, the
parameter gradients of one backward of each side (:mod:`.grads`; the parallel piece runs
again for it, :mod:`.rerun`). Only one piece is ever held at full size. Every rank learns
every failure (so no rank goes on to train while another stops), and setup raises
:class:`PlanVerificationError` naming the piece, the first wrong output inside it and the
numbers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_5d.module_mode import eval_mode
from lightning_5d.config import ParallelConfig, VerifyMode, ZeroStage
from lightning_5d.heap import release_freed_memory
from lightning_5d.parallel.pipeline import PipelineMode
from lightning_5d.parallel.pipeline.fsdp import drop_held_gradients, fsdp_roots
from lightning_5d.plan import discover
from lightning_5d.plan.model_plan import ModelPlan
from lightning_5d.verify.agree import first_failure
from lightning_5d.verify.compare import Difference, PieceResult, PlanVerificationError, difference, mismatch_message
from lightning_5d.verify.compare import tolerance_for
from lightning_5d.verify.gather import ActivationLayout, HeldTensors, full_weights
from lightning_5d.verify.grads import first_tensor as _first_tensor
from lightning_5d.verify.grads import HookWatch, reference_grads, trainable_names
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_5d.verify.probe import (
    ProbeError,
    Recorder,
    probe_call,
    inner_paths,
    live_module,
    probe_ids,
    probe_seq_len,
    run_probe,
)
from lightning_5d.verify.probe_memory import drop_kept_gather, probe_settings
from lightning_5d.verify.rerun import ParallelGrads, unit_owners
from lightning_5d.verify.shard_compare import keep_rank_parts, shard_differences
from lightning_5d.verify.skeleton import Piece, PieceKind, materialize, take_skeleton, tensor_names


@dataclass
class CheckReport:
    """What one verification found on this rank, and what it cost."""

    results: list[PieceResult] = field(default_factory=list)
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # pieces not compared, with the reason

    def summary(self) -> str:
        if not self.results:
            return "no piece compared" + (f" ({'; '.join(self.skipped)})" if self.skipped else "")
        worst = max(self.results, key=lambda r: r.worst_relative() / r.tolerance)
        grads = sum(len(r.grads) for r in self.results)
        what = f"outputs and {grads} parameter gradients" if grads else "outputs"
        text = (
            f"{len(self.results)} pieces on this rank match the unparallelized model ({what}) in {self.seconds:.2f} s; "
            f"closest to its tolerance: {worst.name}, relative error {worst.worst_relative():.2g} "
            f"(tolerance {worst.tolerance:g})"
        )
        return text + (f"; not compared: {'; '.join(self.skipped)}" if self.skipped else "")


class PlanCheck:
    """The check of one setup: copies taken in :meth:`before`, the comparison in :meth:`after`."""

    def __init__(
        self, pieces: list[Piece], plan: ModelPlan | None, config: ParallelConfig, required: bool = True
    ) -> None:
        self.pieces = pieces
        # False under ZeRO-3 alone: a model the probe cannot call is then skipped with a note, not refused.
        self.required = required
        self.plan = plan
        self.config = config
        self.report: CheckReport | None = None

    @classmethod
    def before(cls, module: nn.Module, plan: ModelPlan | None, config: ParallelConfig, rewrites: bool) -> "PlanCheck":
        """Copies of the pieces, if the layout changes how the model computes and the check is on.

        ``rewrites``: whether tp, cp, pp, ep/expert dispatch or FP8 will be applied. ZeRO-3 alone
        (FSDP2 replaces parameters and wraps forwards, but each piece runs its own code) is checked
        only when asked for (``blocks``/``outputs``), not by ``auto``. ZeRO-0..2 alone leave the
        forward untouched: nothing to prove.
        """
        if not config.checks_plan(rewrites):
            if config.verify == VerifyMode.AUTO and config.zero == ZeroStage.PARAMETERS:
                rank_zero_info(
                    "[lightning_5d] plan verifier: not run under ZeRO-3 alone (each piece runs its own code on "
                    "gathered weights; the check would gather the largest tensor at start-up). "
                    "verify='blocks' runs it."
                )
            return cls([], plan, config)
        if plan is None:  # ZeRO-3 alone needs no plan; the check needs one to know what to call
            try:
                plan = discover(module, config.model_plan)
            except Exception:  # noqa: BLE001 - whatever discovery trips on, ZeRO-3 alone trained before it
                return cls([], None, config)  # FSDP2 wraps, but does not rewrite, what it cannot name
        return cls(take_skeleton(module, plan), plan, config, required=rewrites)

    def after(
        self,
        module: nn.Module,
        *,
        mesh: Any,
        tp: Any | None = None,
        cp: Any | None = None,
        pp: Any | None = None,
        ep: Any | None = None,
        precision: Any | None = None,
    ) -> CheckReport | None:
        """Compare every piece this rank holds; raise :class:`PlanVerificationError` on any rank's mismatch."""
        if not self.pieces:
            return None
        start = time.perf_counter()
        device = _device_of(module)
        sp = tp is not None and tp.sequence_parallel
        seq_len = probe_seq_len(tp.size if tp is not None else 1, sp, cp.size if cp is not None else 1)
        layout = ActivationLayout(
            seq_len,
            tp=tp.size if tp is not None else 1,
            tp_group=tp.group if tp is not None else None,
            sequence_parallel=sp,
            cp=cp.size if cp is not None else 1,
            cp_group=cp.group if cp is not None else None,
            cp_sharding=cp.sharding if cp is not None else self.config.context.sharding,
        )
        rows = pp.microbatches if pp is not None else 1
        batch = {"input_ids": probe_ids(_vocab_size(module, self.plan), rows, seq_len, device)}
        batch["labels"] = batch["input_ids"]  # cp cuts labels with the ids (and refuses a batch without them)
        report = CheckReport()

        call = probe_call(module, self.plan)
        if call is None:
            if self.required:
                run_probe(module, batch, lambda _b: module(_b["input_ids"]))  # raises ProbeError with the way out
            rank_zero_warn(
                f"the plan verifier skipped {type(module).__name__}: it has no forward(input_ids) and its "
                f"embedding, blocks and head are not held by one module whose forward takes token ids."
            )
            return None
        held = self._held_pieces(module, ep, pp is not None, report)
        grads = self.config.verify != VerifyMode.OUTPUTS  # gradients too (grads.py), each piece run again
        recorder = Recorder()
        for piece, live in held:
            recorder.watch(piece.path, live, inputs=True)
            for inner, _ in inner_paths(piece):
                recorder.watch(f"{piece.path}.{inner}", live.get_submodule(inner), inputs=False)
        # Each ZeRO-3 unit's gathered parameters are freed after its forward, but glibc keeps those
        # below its mmap threshold (a block's 25 MiB matrices) for reuse, scattered over its arenas:
        # RSS grew by about every unit of the model. Give them back as each unit finishes, so the
        # probe holds one gathered unit (plus those FSDP2 keeps: the last block, the head's).
        trims = [m.register_forward_hook(_release_after_unit) for m in module.modules() if isinstance(m, FSDPModule)]
        # The probe holds the rank's share plus one unit's gather (FSDP2's buffer and unsharded
        # copy) at a time: every unit reshards after its forward and, on CPU, drops the buffer
        # FSDP2 keeps for the next unit (probe_memory.py); training's settings come back after.
        settings = probe_settings([m for m in module.modules() if isinstance(m, FSDPModule)])
        failure: ProbeError | None = None
        try:
            # Dropout off on both sides: the reference pieces run in eval mode too.
            with eval_mode(module):
                run_probe(module, batch, self._forward(call, cp, pp, precision))
        except ProbeError as err:
            failure = err  # decided together below: under pp it may have failed on one stage only
        finally:
            recorder.remove()
            for handle in trims:
                handle.remove()
            settings.restore()
            # A forward with no backward leaves FSDP2's root unit gathered (the root keeps its
            # parameters for the backward it expects); training's first step would then compute
            # with, and put its gradients on, that stale gathered copy (seen under tp+SP x ZeRO-3).
            units = [m for m in module.modules() if isinstance(m, FSDPModule)]
            if units:
                # The probe's forward (finished, or stopped by an error) also leaves the root's
                # iteration state (the forward order FSDP2 records for the backward) behind: the
                # first training step's gradients came out wrong under pp x ZeRO-3, and after a
                # probe that failed under ZeRO-3 alone. Reset it as after a failed schedule.
                drop_held_gradients(units)
            for m in units:
                m.reshard()
            # The probe's gathered units and each piece's full weights are freed, but glibc keeps
            # pages below its mmap threshold (which rises to the largest freed block, <= 32 MiB):
            # measured on a 0.5 B model under ZeRO-3 over 4 ranks, RSS after setup stayed at the
            # whole model (2.1 GB) instead of the rank's quarter. Give them back after each.
            release_freed_memory()
        agreed = first_failure(failure)  # a collective: every rank, failed or not, before any other
        if agreed is not None:
            rank, message = agreed
            err = ProbeError(f"{message} (raised on rank {rank}; every rank stops with this error)")
            if self.required:
                raise err from failure
            rank_zero_warn(f"{err} Under ZeRO-3 alone the check is skipped instead.")  # FSDP2 does not rewrite
            return None

        # The parallel pieces' backward (grads.py) runs in the probe's context, ZeRO-3 units gathered one at a time.
        parallel = ParallelGrads(lambda: _probe_context(batch, cp, precision), unit_owners(module) if grads else {},
                                 tp, cp, self.config.zero == ZeroStage.PARAMETERS, fsdp_roots(module))  # fmt: skip
        # Under bf16 mixed / FP8 a piece computes in bf16 even where its output is float32 (a model
        # that adds a float32 buffer to its activations keeps a float32 residual stream).
        compute_dtype = getattr(precision, "param_dtype", None)
        own_code = 0  # pieces whose gradients are the module's own code on both sides (not compared)
        for piece, live in held:
            piece_grads = grads and rewritten(piece, live, changes_every_piece=any(d is not None for d in (tp, cp, ep)))
            own_code += grads and not piece_grads
            try:
                report.results.append(self._compare(piece, live, recorder, layout, tp,
                                                    parallel if piece_grads else None, device, compute_dtype))  # fmt: skip
            except _NotComparable as why:
                report.skipped.append(str(why))
            # Its recorded activations are needed by no later piece: the head's compare (the
            # peak: its gathered V x h weight) then holds none of the blocks' (~1 MiB each).
            recorder.forget([piece.path, *(f"{piece.path}.{inner}" for inner, _ in inner_paths(piece))])
            release_freed_memory()
        recorder.records.clear()
        if own_code:
            report.skipped.append(f"the gradients of {own_code} pieces no dimension changed (on both sides the "
                                  f"module's own code on the same gathered weights; their outputs are compared)")
        report.seconds = time.perf_counter() - start
        self.report = report
        failed = _everyone(report.results)
        if failed:
            raise PlanVerificationError(mismatch_message(failed, mesh.layout.describe()))
        return report

    # ------------------------------------------------------------------ parts
    def _held_pieces(
        self, module: nn.Module, ep: Any | None, pipelined: bool, report: CheckReport
    ) -> list[tuple[Piece, nn.Module]]:
        """The pieces this rank holds (a pipeline stage holds some), with their live modules."""
        held = []
        for piece in self.pieces:
            live = live_module(module, piece.path)
            if ep is not None and _holds_moe(piece):
                # Expert dispatch may drop tokens (capacity) or add a routing bias by design, and
                # under ep a rank holds only its experts: the one-process MoE is not the reference.
                report.skipped.append(f"{piece.name} (MoE under expert dispatch)")
                continue
            # A pipeline placeholder may hold a tied weight, but its real module runs on another stage.
            if live is None or getattr(live, "stands_in", False) or not _holds(live, piece):
                if not pipelined:  # under pp: another stage's piece, which that stage checks
                    report.skipped.append(f"{piece.name} (its tensors are not all on this rank)")
                continue
            held.append((piece, live))
        return held

    @staticmethod
    def _forward(call: Any, cp: Any | None, pp: Any | None, precision: Any | None):
        def forward(batch: dict[str, Tensor]) -> None:
            # Under pp as training does (PipelineLoop.run): the sequence shard first, then its
            # microbatches. The pipeline keeps the first block's input shape per microbatch shape;
            # cutting each microbatch inside the step instead gave a cp-cut activation under the key
            # of an uncut microbatch, which training's (already cut) microbatches of that same shape
            # then reused: the later stages received twice what they expected (gloo aborted them).
            with _probe_context(batch, cp, precision) as local:
                if pp is None:
                    call(local["input_ids"])
                else:
                    pp.run(PipelineMode.EVAL, lambda mb: call(mb["input_ids"]), local)

        return forward

    def _compare(
        self, piece: Piece, live: nn.Module, recorder: Recorder, layout: ActivationLayout, tp: Any,
        grads: ParallelGrads | None, device, compute_dtype: torch.dtype | None = None,
    ) -> PieceResult:  # fmt: skip
        record = recorder.records[piece.path]
        inners = inner_paths(piece)
        # Every collective (gathers, the parallel backward, the sums) in the same order on every
        # rank that holds this piece. The reference's backward comes first and the parallel one
        # after it, once the reference's weights are freed: the other way round (under ZeRO-3,
        # to take the full weights from the unit gathered for the parallel backward) held the
        # parallel gradient next to the reference's full weight and gradient (measured: the
        # start-up peak of a 0.5 B model under tp2 x ZeRO-3, +94 MiB for its embedding).
        names = trainable_names(piece.copy) if grads is not None and record.done else []
        full = full_weights(live, piece.path, tensor_names(piece.copy), tp, HeldTensors.SHARE)
        args = _float(layout.full(record.args))
        kwargs = _float(layout.full(record.kwargs))
        output = layout.full(record.output)
        parts_par = {}
        for inner, segments in inners:
            value = recorder.records[f"{piece.path}.{inner}"].output
            parts_par[inner] = layout.full(value) if segments is None else layout.full_columns(value, segments)
        if not record.done:
            missing = Difference(float("inf"), float("inf"), "did not run in the parallel model's probe forward")
            return PieceResult(piece.name, piece.path, missing, tolerance_for(torch.float32))

        parallel_out = _first_tensor(output)
        tolerance = tolerance_for(parallel_out.dtype if parallel_out is not None else torch.float32)
        if compute_dtype is not None:
            tolerance = max(tolerance, tolerance_for(compute_dtype))
        # Gradients in reduced precision get twice the outputs' tolerance (compare.PieceResult).
        low_precision = tolerance > tolerance_for(torch.float32)
        grad_tolerance = 2 * tolerance if low_precision else None
        reference = materialize(piece, full, device, trainable=bool(names))
        del full
        inner_recorder = Recorder()
        order: list[str] = []
        for inner, _ in inners:
            inner_recorder.watch(inner, reference.get_submodule(inner), inputs=False)
            reference.get_submodule(inner).register_forward_hook(lambda *_a, _p=inner: order.append(_p))
        hooks = HookWatch()
        try:
            with torch.set_grad_enabled(bool(names)), hooks if names else nullcontext():
                ref_out = reference(*args, **kwargs)
        except Exception as err:
            # The parallel piece ran on these inputs; the model's own cannot take them gathered
            # (e.g. a rotary table the model cut to the local length under cp, passed as an
            # argument). Not evidence of a wrong plan: the piece is listed as not compared.
            if names:  # the collectives the other ranks of this piece run, so that none waits
                par_grads = grads.of(live, piece.path, record.args, record.kwargs, names)
                shard_differences(par_grads or {}, None, piece.path, tp)
            raise _NotComparable(f"{piece.name} (its inputs do not gather to what the model passes: "
                                 f"{type(err).__name__}: {err})") from err  # fmt: skip
        finally:
            inner_recorder.remove()
        residual = _first_tensor(args) if piece.kind == PieceKind.BLOCK else None
        if residual is None and piece.kind == PieceKind.BLOCK:
            residual = _first_tensor(kwargs)
        out = difference(parallel_out, _first_tensor(ref_out), residual)
        parts = []
        for inner in dict.fromkeys(order):  # the reference's execution order, each module once
            par = _first_tensor(parts_par.get(inner))
            ref = _first_tensor(inner_recorder.records[inner].output)
            if par is not None and ref is not None:
                parts.append((f"{piece.path}.{inner}", difference(par, ref)))
        grad_diffs = []
        if names:
            # The output comparison's float64 blocks (2 MiB, kept by glibc below its mmap
            # threshold) go back first: on the 0.5 B model's head ~20 MiB, under each backward.
            release_freed_memory()
            ref_grads = reference_grads(reference, names, _first_tensor(ref_out), release=not hooks.registered)
            held = _bytes(list(ref_grads.values()) + list(reference.parameters()))
            # The full weights and the graph are done with: only the gradients stay for the
            # comparison, of a parameter tp cut only the part this rank's shard is compared with
            # (in a file where keeping it would make the parallel backward hold more than this one).
            # The freed weights' pages go back before the parts are cut: glibc kept a block's
            # (heap-allocated) weights resident, and the parts' copies came on top (the 0.5 B
            # model's blocks under tp2 x ZeRO-3: 742-750 MiB, above the head's check).
            del reference, ref_out
            inner_recorder.records.clear()
            release_freed_memory()
            keep_rank_parts(ref_grads, piece.path, tp, reference_bytes=held)
            release_freed_memory()
            par_grads = grads.of(live, piece.path, record.args, record.kwargs, names)
            # Each parallel gradient on its own shard against the matching slice of the reference's.
            found = shard_differences(par_grads or {}, ref_grads if par_grads is not None else None, piece.path, tp)
            if par_grads is None:  # the same on every rank holding the piece
                raise _NotComparable(f"{piece.name} (parameters sharded as DTensors by something other than ZeRO-3)")
            if found is None:
                raise _NotComparable(f"{piece.name} (another tp rank could not run the reference piece)")
            grad_diffs = [(f"{piece.path}.{name}", found[name]) for name in names]
        return PieceResult(piece.name, piece.path, out, tolerance, tuple(parts), tuple(grad_diffs), grad_tolerance)


@contextmanager
def _probe_context(batch: dict[str, Tensor], cp: Any | None, precision: Any | None) -> Iterator[dict[str, Tensor]]:
    """What the probe forward runs in, and each piece's backward (:class:`.ParallelGrads`): the
    precision plugin's forward context (autocast under bf16-mixed), as in training; FP8 linears computing in
    bf16 (the check proves the layout; FP8's own error is the numerics guard's job,
    FiveDPrecision(numerics_check_every=...)); under cp the batch cut to this rank's sequence
    shard and attention routed over the cp ranks. Yields the batch as this rank holds it."""
    fp8 = precision is not None and getattr(precision, "fp8", None) is not None
    with precision.forward_context() if precision is not None else nullcontext():
        with precision.fp8_off() if fp8 else nullcontext():
            if cp is None:
                yield batch
                return
            local = cp.begin(batch)
            try:
                yield local
            finally:
                cp.end()


def _holds_moe(piece: Piece) -> bool:
    """Whether the piece holds its block's MoE (a sub-layer of a container block may not)."""
    moe = piece.block_plan.moe if piece.block_plan is not None else None
    if moe is None:
        return False
    return not piece.within or moe.path == piece.within or moe.path.startswith(piece.within + ".")


def _holds(live: nn.Module, piece: Piece) -> bool:
    names = set(dict(live.named_parameters(remove_duplicate=False))) | set(dict(live.named_buffers()))
    return all(n in names for n in tensor_names(piece.copy) if n in dict(piece.copy.named_parameters()))


def _bytes(tensors: list[Tensor]) -> int:
    """The bytes of the storages behind ``tensors`` (each once: tied weights share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def _float(value: Any) -> Any:
    """Floating tensors in fp32 (the reference computes in fp32); ids and masks unchanged.

    A key/value cache (Hugging Face's ``Cache``, made even in training when ``use_cache`` is
    on) becomes None: the parallel blocks already filled it with their own (head-sharded)
    keys and values, and a block given none computes the same attention without storing it.
    """
    if any(c.__name__ == "Cache" for c in type(value).__mro__):
        return None
    if isinstance(value, Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_float(v) for v in value)
    if isinstance(value, dict):
        return {k: _float(v) for k, v in value.items()}
    return value


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _vocab_size(module: nn.Module, plan: ModelPlan | None) -> int:
    if plan is not None and plan.vocab_size:
        return plan.vocab_size
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else 2


def _everyone(results: list[PieceResult]) -> list[PieceResult]:
    """The failures of every rank, once per piece, in model order (a collective over the world)."""
    mine = [r for r in results if r.failed]
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    gathered: list[list[PieceResult] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    seen: dict[str, PieceResult] = {}
    for rank_results in gathered:
        for r in rank_results or []:
            seen.setdefault(r.path, r)
    return list(seen.values())


class _NotComparable(Exception):
    """A piece whose reference cannot run on the gathered inputs (reported, not a mismatch)."""


def _release_after_unit(module: nn.Module, _args: Any, _output: Any) -> None:
    # Runs after FSDP2's own post-forward hook (registered at fully_shard, before this one),
    # which has already freed the unit's gathered parameters (the probe reshards every unit).
    drop_kept_gather(module)
    release_freed_memory()


def rewritten(piece: Piece, live: nn.Module, changes_every_piece: bool) -> bool:
    """Whether a dimension changed how ``live`` computes, so its gradients are worth comparing.

    ``changes_every_piece``: tp (cut weights, region hooks), cp (attention routed in the
    probe's context) or ep (expert dispatch) is on. Otherwise a piece is changed only where a
    module of it is no longer the class the model had (FP8's linears; FSDP2's own subclass of
    the module's class does not count) or carries a forward of its own (the parts forward of
    ``nn.MultiheadAttention``, shape-site replays). An unchanged piece under ZeRO-3 or pp runs
    the same code on the same gathered weights in the parallel model and in the reference, so
    its backward would be compared with itself: the check would cost a full gradient of its
    largest weight on each side (the start-up peak of a 0.5 B model under ZeRO-3 rose from
    0.47 to 0.59 of the model) and could not fail.
    """
    if changes_every_piece:
        return True
    before = dict(piece.copy.named_modules())
    for path, module in live.named_modules():
        original = before.get(path)
        if original is None or "forward" in vars(module):
            return True
        cls = type(module)
        if issubclass(cls, FSDPModule):  # fully_shard's FSDP<cls>(FSDPModule, cls)
            cls = next((b for b in cls.__bases__ if b is not FSDPModule), cls)
        if cls is not type(original):
            return True
    return False
