"""One forward of the parallel model on a probe batch, recording what each piece saw and made.

Hooks on every piece this rank holds record the first call's arguments (as the
dimensions' pre-hooks left them: under sequence parallelism the first block's shard, under
pp the activation received from the previous stage) and output (after the dimensions' own
forward hooks: the head's logits as a vocabulary-sharded ``DTensor``); inside
a block, the outputs of the modules the plan names (projections, attention, MLP) are
recorded too, so a wrong block can be narrowed down to the output that first goes wrong.

The probe is random token ids ``[rows, S]`` drawn from a fixed seed, the same on every
rank; the model is called as ``module(input_ids)`` (the LightningModule's ``forward``, or,
when it has none, the forward of the module that holds the embedding, blocks and head, or,
when the LightningModule holds those itself, each of them in turn: :func:`_piece_chain`).
Under cp the batch is cut by the strategy's own :class:`ContextParallel` first; under pp it
runs through the pipeline's forward-only path, each stage recording its own pieces.
"""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_5d.config import LayoutError
from lightning_5d.plan.model_plan import ModelPlan
from lightning_5d.verify.skeleton import Piece, PieceKind

PROBE_SEED = 1234  # any fixed value: every rank must draw the same ids


class ProbeError(RuntimeError):
    """The probe forward could not run; the message says how to make it run or how to skip the check."""


@dataclass
class Record:
    """What one piece (or one module inside a block) saw and made in its first call."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None
    done: bool = False


def probe_ids(vocab_size: int, rows: int, seq_len: int, device: torch.device) -> Tensor:
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (rows, seq_len), generator=generator).to(device)


def probe_seq_len(tp: int, sequence_parallel: bool, cp: int) -> int:
    """A sequence the layout can cut (2·cp zig-zag chunks, each split over tp under SP), >= 16 tokens."""
    unit = 2 * cp * (tp if sequence_parallel else 1)
    return unit * max(1, -(-16 // unit))


class Recorder:
    """Forward (pre-)hooks on the live pieces and on the named modules inside blocks."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self._handles: list = []

    def watch(self, path: str, module: nn.Module, inputs: bool) -> None:
        record = self.records.setdefault(path, Record())

        # One forward hook: torch hands it the arguments as every pre-hook left them (tp's
        # sequence scatter, the pipeline's received activation, registered later than this).
        def after(_m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if record.done:
                return
            if inputs:
                record.args, record.kwargs = _detached(args), _detached(kwargs)
            record.output, record.done = _detached(output), True

        self._handles.append(module.register_forward_hook(after, with_kwargs=True))

    def forget(self, paths: list[str]) -> None:
        """Drop the records of ``paths`` (a compared piece and the modules inside it)."""
        for path in paths:
            self.records.pop(path, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def inner_paths(piece: Piece) -> list[tuple[str, tuple[int, ...] | None]]:
    """Modules inside a block to compare, relative to it, with the column segments of column projections.

    ``None`` marks an output that is not column-cut (row projections, attention, MLP). For a
    sub-layer of a container block, the modules inside that sub-layer, relative to it.
    """
    plan = piece.block_plan
    if piece.kind != PieceKind.BLOCK or plan is None:
        return []
    found: list[tuple[str, tuple[int, ...] | None]] = []
    att = plan.attention
    if att is not None:  # None: a feed-forward entry of an alternating block list
        if not att.packed:  # nn.MultiheadAttention never calls its out_proj module: the whole attention only
            for p in att.column:
                found.append((p.path, p.segments))
            found.append((att.o.path, None))
        found.append((att.path, None))
    if plan.mlp is not None:
        found.extend((p.path, p.segments) for p in plan.mlp.column)
        found.extend((p.path, None) for p in plan.mlp.row)
        found.append((plan.mlp.path, None))
    if piece.within:  # the sub-layer's own output is the piece's: only what lies inside it
        prefix = piece.within + "."
        found = [(p[len(prefix):], s) for p, s in found if p.startswith(prefix)]
    seen: set[str] = set()
    return [(p, s) for p, s in found if p and not (p in seen or seen.add(p))]


def live_module(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _backbone_path(plan: ModelPlan | None) -> str:
    """The deepest module holding the embedding, the blocks and the head ("" for the root)."""
    if plan is None:
        return ""
    paths = [p.split(".") for p in (plan.embedding, plan.blocks, plan.head) if p]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common[: min(len(p) for p in paths) - 1] if paths else [])


def probe_call(module: nn.Module, plan: ModelPlan | None) -> Callable[[Tensor], Any] | None:
    """How to run the model on token ids: the LightningModule's own ``forward`` if it has one,
    else the backbone's (a Hugging Face ``*ForCausalLM`` held as an attribute), else, when the
    LightningModule holds the pieces itself and only its ``training_step`` runs them, the
    pieces in the plan's order (:func:`_piece_chain`). The call always goes through the
    LightningModule, whose hooks (FSDP2's unshard of the root's parameters) must fire. None
    without a plan to chain."""
    from lightning.pytorch import LightningModule

    if type(module).forward is not LightningModule.forward:
        return _token_call(module)
    path = _backbone_path(plan)
    if path:
        backbone = _token_call(module.get_submodule(path))
    elif plan is not None and plan.blocks:
        backbone = _piece_chain(module, plan)
    else:
        return None

    def call(ids: Tensor) -> Any:
        module.forward = lambda input_ids: backbone(input_ids)  # only for this call: an instance attribute
        try:
            return module(ids)
        finally:
            del module.forward

    return call


def _piece_chain(root: nn.Module, plan: ModelPlan) -> Callable[[Tensor], Any]:
    """``head(final_norm(blocks(embedding(ids) [+ positions])))``, each module called by itself.

    For a LightningModule that holds the embedding, blocks and head itself and has no
    ``forward`` (its ``training_step`` runs them): the check compares each piece's output with
    the unparallelized piece's output *on the input the piece received*, so the pieces only
    need realistic inputs, not the user's exact step (anything the step does between them, a
    scaling or a mask, is not part of any piece). A block that needs more than the hidden
    states fails here and the check says so. The modules are looked up at call time: under pp
    a stage holds placeholders for the pieces of other stages, whose hooks inject and stop."""

    def chain(ids: Tensor) -> Any:
        x = root.get_submodule(plan.embedding)(ids)
        if plan.position_embedding:
            positions = torch.arange(ids.size(1), device=ids.device)
            x = x + root.get_submodule(plan.position_embedding)(positions)
        for block in root.get_submodule(plan.blocks).children():
            out = block(x)
            x = out[0] if isinstance(out, (tuple, list)) else out
        if plan.final_norm:
            x = root.get_submodule(plan.final_norm)(x)
        return root.get_submodule(plan.head)(x) if plan.head else x

    return chain


def _token_call(module: nn.Module) -> Callable[[Tensor], Any]:
    """``module(ids)``, or ``module(input_ids=ids)`` for a forward whose arguments are keyword-only."""
    import inspect

    try:
        inspect.signature(module.forward).bind(None)
    except TypeError:
        return lambda ids: module(input_ids=ids)
    return module


def run_probe(
    module: nn.Module,
    batch: dict[str, Tensor],
    forward: Callable[[dict[str, Tensor]], None],
) -> None:
    """``forward(batch)`` without a graph (each piece's backward re-runs that piece alone:
    :mod:`.rerun`); a failure becomes a :class:`ProbeError` with the way out."""
    try:
        with torch.no_grad():
            forward(batch)
    except ProbeError:
        raise
    except LayoutError as err:  # a refusal of ours met at run time: its own advice, not the probe's
        raise ProbeError(
            f"the plan verifier's probe forward of {type(module).__name__} stopped on a refusal: {err}"
        ) from err
    except Exception as err:
        hint = _mixed_dtype_hint(module, err)
        if hint:
            raise ProbeError(
                f"the plan verifier could not run {type(module).__name__} on probe token ids of shape "
                f"{tuple(batch['input_ids'].shape)}: {type(err).__name__}: {err}. {hint}"
            ) from err
        raise ProbeError(
            f"the plan verifier could not run {type(module).__name__} on probe token ids of shape "
            f"{tuple(batch['input_ids'].shape)}: {type(err).__name__}: {err}{_model_line(err)}. The check calls the "
            f"LightningModule's forward with token ids (or, without one, the forward of the module holding the "
            f"embedding, blocks and head, or else the embedding, each block, the final norm and the head in turn); "
            f"give the LightningModule a `forward(input_ids)` that runs the model, or pass "
            f"FiveDStrategy(verify='off') (l5d train: parallel.verify=off) to train without the check."
        ) from err


def _model_line(err: Exception) -> str:
    """`` (at file:line: code)`` of the innermost frame of the model's own code (not torch's, not
    ours), so the message names the line that failed; empty when there is none."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not (f.filename.startswith(ours) or f.filename.startswith(torch_dir))]  # fmt: skip
    if not frames:
        return ""
    last = frames[-1]
    code = (last.line or linecache.getline(last.filename, last.lineno)).strip()
    return f" (at {os.path.basename(last.filename)}:{last.lineno}: `{code}`)"


def _mixed_dtype_hint(module: nn.Module, err: Exception) -> str:
    """Why a bf16 forward on CPU failed in a norm, and what works (empty when that is not the failure).

    The precision plugin casts parameters to bf16, not buffers (as FSDP2's mixed precision does).
    A model that adds a float32 buffer (a sinusoidal position table) to its bf16 activations
    promotes them to float32; the next LayerNorm then gets float32 input and bf16 weights, which
    CPU kernels refuse ("mixed dtype (CPU)"): CPU autocast does not run layer_norm in float32
    as CUDA autocast does. The plugin's forward context does that for F.layer_norm and
    F.group_norm (``lightning_5d.cpu_norms``); a norm computed by another kernel, or a forward run
    outside that context, still fails here. Training's forward fails the same way, so verify='off'
    would not help.
    """
    if "mixed dtype (CPU)" not in str(err):
        return ""
    params = {p.dtype for p in module.parameters() if p.is_floating_point()}
    buffers = [n for n, b in module.named_buffers() if b.is_floating_point() and b.dtype not in params]
    where = f" ({', '.join(buffers[:4])})" if buffers else ""
    return (
        f"On CPU a norm got float32 activations and {'/'.join(sorted(str(d) for d in params))} weights: the model "
        f"adds a float32 buffer{where} to its bf16 activations (the precision plugin casts parameters, not "
        f"buffers), and CPU autocast does not run layer_norm in float32 as CUDA's does; training's forward "
        f"fails the same way. Cast the buffer to the activations' dtype where the model uses it (e.g. "
        f"`x + self.pe[: x.size(1)].to(x.dtype)`), or train on CUDA, or use precision='32-true'."
    )
