"""Observe the column layout of fused projections by running the model once on a probe batch.

Shapes alone cannot tell how a fused projection orders its output features: Hugging Face
Llama-style ``qkv_proj`` is ``[q | k | v]``, GPT-NeoX's ``query_key_value`` is ``[q_h | k_h | v_h]``
per head, a fused MLP may be ``[gate | up]`` or pairs ``[g_i, u_i]``. Tensor parallelism must
cut them differently (cut each segment into tp pieces, or cut the whole contiguously), and the
wrong cut trains without any error. The model's own forward decides, so we watch it:

    y = fused(x)                  (captured; made a leaf that requires grad)
    z = input of the row layer     (o_proj / down_proj, captured)
    S(j) = { i : d z_j / d y_i != 0 }   (one backward of a random cotangent on z_j)

``S`` of the first and last head (attention) or of the first and last feature (MLP) is
matched against the layouts above. The probe is ids ``[2, 16]`` through the model in eval
mode; parameters and their gradients are left untouched. When the model cannot be run on
ids (its forward wants something else, or weights are still on the meta device), the
shape-based default stays and the plan notes that it was not observed.

For a model whose forward takes no ``position_ids``, it also records where the forward reads
token positions (``ModelPlan.position_reads``, :mod:`lightning_5d.plan.position_reads`), or
that it reads none (``uses_positions`` False: NoPE), so context parallelism can give a
sequence shard its global positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, ContextManager

import torch
from torch import Tensor, nn

from lightning_5d.mha_parts import parts_forwards
from lightning_5d.module_mode import eval_mode
from lightning_5d.plan import paths, shape_sites
from lightning_5d.plan.loose_params import loose_parameter_uses
from lightning_5d.plan.model_plan import AttentionPlan, ColumnLayout, LooseParam, MLPPlan, ModelPlan, Projection
from lightning_5d.plan.position_reads import observe_reads, takes_position_ids

PROBE_SHAPE = (2, 16)  # several positions: a causal mask leaves position 0's query little to depend on


@dataclass
class _Capture:
    """The first output of a fused projection and the first input of its row layer, per block."""

    fused: Tensor | None = None
    row_input: Tensor | None = None


def observe(
    root: nn.Module, plan: ModelPlan, probe: Callable[[], ContextManager[Any]] | None = nullcontext
) -> ModelPlan:
    """``plan`` with the layout of every fused projection set from what the forward does,
    and whether the model uses token positions at all. The forwards run inside ``probe()``
    (a meta-built model's recorded values: :mod:`lightning_5d.materialize.stand_in`); None:
    the model cannot run (weights on the meta device and nothing recorded)."""
    if probe is None:
        return _noted(plan, "fused projection layouts not observed (weights on the meta device); assumed")
    with probe():
        plan = _observe_positions(root, plan)
        plan = replace(plan, loose_params=_loose_params(root, plan))
    plan = _observe_sites(root, plan, probe)
    with probe():
        return _observe_fused(root, plan)


def _observe_sites(root: nn.Module, plan: ModelPlan, probe: Callable[[], ContextManager[Any]]) -> ModelPlan:
    """The attention's shape sites (:mod:`.shape_sites`). They need sizes only, so a model on the
    meta device runs on meta ids first, recomputing no value (for a Hugging Face model these are
    discovery's only probe forwards); in ``probe()`` only where its forward cannot run on meta (a
    step that reads values, such as ``.item()``)."""
    ran: list[bool] = []

    def run(shape: tuple[int, int]) -> bool:
        ran.append(_run(root, plan, shape))
        return ran[-1]

    with eval_mode(root):
        if any(p.is_meta for p in root.parameters()):
            sited = shape_sites.observe_sites(root, plan, run)
            if all(ran):  # ran on meta (or had nothing to look for)
                return sited
        with probe():
            return shape_sites.observe_sites(root, plan, lambda shape: _run(root, plan, shape))


def _observe_fused(root: nn.Module, plan: ModelPlan) -> ModelPlan:
    targets = _targets(plan)
    if not targets:
        return plan
    captures = {key: _Capture() for key in targets}
    with _hooks(root, plan, targets, captures), eval_mode(root), torch.enable_grad():
        _run(root, plan)
    if all(c.fused is None for c in captures.values()):
        return _noted(plan, "fused projection layouts not observed (the model did not run on token ids); assumed")
    blocks = list(plan.block_plans)
    notes: list[str] = []
    for (index, kind), capture in captures.items():
        if capture.fused is None or capture.row_input is None:
            continue
        block = blocks[index]
        where = plan.block_path(index)
        if kind == "qkv":
            att = block.attention
            layout = _attention_layout(att, capture)
            notes.append(f"{where}.{att.qkv.path}: observed layout {_describe(layout)}")
            blocks[index] = replace(block, attention=replace(att, qkv=_with_layout(att.qkv, layout)))
        else:
            mlp = block.mlp
            layout = _gate_up_layout(mlp, capture)
            notes.append(f"{where}.{mlp.column[0].path}: observed layout {_describe(layout)}")
            blocks[index] = replace(block, mlp=replace(mlp, column=(_with_layout(mlp.column[0], layout),)))
    return replace(plan, block_plans=tuple(blocks), notes=tuple(dict.fromkeys([*plan.notes, *_summary(notes)])))


def _loose_params(root: nn.Module, plan: ModelPlan) -> tuple[LooseParam, ...]:
    """Parameters outside the plan's parts, with the phases of the forward that read them."""
    parts = [p for p in (plan.embedding, plan.position_embedding, plan.blocks, plan.final_norm, plan.head) if p]
    loose = {
        name: p for name, p in root.named_parameters() if not any(paths.is_within(name, part) for part in parts)
    }
    if not loose or not plan.block_plans:
        return ()
    uses = loose_parameter_uses(root, plan.blocks_of(root), loose, lambda: _run(root, plan))
    if uses is None:
        return ()
    return tuple(LooseParam(name, uses.get(name, frozenset())) for name in loose)


def _targets(plan: ModelPlan) -> dict[tuple[int, str], tuple[str, str]]:
    """(block, "qkv" | "mlp") -> (fused path, row path), both relative to the block."""
    found = {}
    for i, b in enumerate(plan.block_plans):
        att = b.attention
        if att is not None and att.qkv is not None and att.num_heads and not att.packed:
            found[(i, "qkv")] = (b.attention.qkv.path, b.attention.o.path)
        if b.mlp is not None and len(b.mlp.column) == 1 and b.mlp.column[0].segments and len(b.mlp.row) == 1:
            found[(i, "mlp")] = (b.mlp.column[0].path, b.mlp.row[0].path)
    return found


@contextmanager
def _hooks(root, plan, targets, captures) -> Iterator[None]:
    handles = []
    try:
        for key, (fused, row) in targets.items():
            block = paths.join(plan.block_path(key[0]))
            capture = captures[key]
            handles.append(root.get_submodule(paths.join(block, fused)).register_forward_hook(_leaf_output(capture)))
            handles.append(root.get_submodule(paths.join(block, row)).register_forward_pre_hook(_first_input(capture)))
        yield
    finally:
        for h in handles:
            h.remove()


def _leaf_output(capture: _Capture) -> Callable:
    def hook(_module, _args, out):
        if capture.fused is not None or not isinstance(out, Tensor) or not out.is_floating_point():
            return None
        # A leaf of its own: its gradient is what we read, and the parameters' stay untouched.
        capture.fused = out.detach().requires_grad_(True)
        return capture.fused

    return hook


def _first_input(capture: _Capture) -> Callable:
    def hook(_module, args):
        if capture.row_input is None and args and isinstance(args[0], Tensor):
            capture.row_input = args[0]

    return hook



def _observe_positions(root: nn.Module, plan: ModelPlan) -> ModelPlan:
    """``plan`` with where a model without a ``position_ids`` input reads its positions
    (:mod:`lightning_5d.plan.position_reads`): ``position_reads`` and ``uses_positions``."""
    if any(takes_position_ids(m.forward) for m in _ancestors_of_blocks(root, plan)):
        return plan  # the positions are an input: context parallelism hands them in
    run, chain = _runner(root, plan)
    if run is None:
        return plan
    # grad on: nn.TransformerEncoderLayer's fused fast path stays off; nn.MultiheadAttention from its
    # parts: its SDPA call is then one the token-wise proof can replace.
    with eval_mode(root), torch.enable_grad(), parts_forwards(root):
        reads = observe_reads(root, plan.embedding, run)
    if reads is None:
        return plan
    return replace(plan, uses_positions=bool(reads), position_reads=reads, chain_assumed=chain)


def _ancestors_of_blocks(root: nn.Module, plan: ModelPlan) -> list[nn.Module]:
    parts = plan.blocks.split(".")
    return [root.get_submodule(".".join(parts[:depth])) for depth in range(len(parts))]


def _runner(root: nn.Module, plan: ModelPlan) -> tuple[Callable[[Tensor], Tensor | None] | None, bool]:
    """How to run the model on ids ``[1, n]`` to its output: the first module on the way down to
    the blocks that runs on token ids; else, for a root with no forward of its own that holds the
    embedding, blocks and head itself (parameters on the LightningModule), the chain embedding ->
    blocks -> final norm -> head (True: context parallelism then checks that every step's calls
    follow it)."""
    device = root.get_submodule(plan.embedding).weight.device
    probe = torch.zeros(1, 8, dtype=torch.long, device=device)
    for module in _ancestors_of_blocks(root, plan):
        try:
            with eval_mode(root), torch.no_grad():
                out = _first_tensor(module(probe))
        except Exception:  # noqa: BLE001 - this module does not take token ids
            continue
        if out is not None and out.dim() >= 2:
            return (lambda ids, m=module: _first_tensor(m(ids.to(device)))), False
        return None, False
    if not _holds_the_chain(root, plan):
        return None, False

    return (lambda ids: run_chain(root, plan, ids.to(device))), True


def run_chain(root: nn.Module, plan: ModelPlan, ids: Tensor) -> Tensor:
    """embedding -> each block -> final norm -> head, for a root that holds them and has no forward."""
    x = root.get_submodule(plan.embedding)(ids)
    for block in plan.blocks_of(root):
        x = block(x)
    if plan.final_norm:
        x = root.get_submodule(plan.final_norm)(x)
    return root.get_submodule(plan.head)(x)


def _holds_the_chain(root: nn.Module, plan: ModelPlan) -> bool:
    """The root has no forward of its own and holds the embedding, blocks, final norm and head directly."""
    from lightning.pytorch import LightningModule

    own_forward = type(root).forward not in (nn.Module.forward, LightningModule.forward)
    parts = [plan.embedding, plan.blocks, plan.final_norm, plan.head]
    return not own_forward and plan.head is not None and all(p is None or "." not in p for p in parts)


def _first_tensor(out: object) -> Tensor | None:
    if isinstance(out, Tensor):
        return out if out.is_floating_point() else None
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((t for t in map(_first_tensor, values) if t is not None), None)


def _run(root: nn.Module, plan: ModelPlan, shape: tuple[int, int] = PROBE_SHAPE) -> bool:
    return run_on_ids(root, plan.embedding, plan.blocks, shape)


def run_on_ids(root: nn.Module, embedding: str, blocks: str, shape: tuple[int, int] = PROBE_SHAPE) -> bool:
    """Run the model on probe ids: the root, else each module on the way down to the blocks
    (a LightningModule without ``forward`` usually holds a model that has one)."""
    table = root.get_submodule(embedding)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, table.num_embeddings, shape, generator=generator).to(table.weight.device)
    parts = blocks.split(".")
    for depth in range(len(parts)):
        candidate = root.get_submodule(".".join(parts[:depth]))
        try:
            candidate(ids)
            return True
        except Exception:  # noqa: BLE001 - any failure means: this module does not take token ids
            continue
    return False


def _dependencies(capture: _Capture, columns: slice) -> set[int]:
    """Features of the fused output that the row input's ``columns`` depend on."""
    target = capture.row_input[..., columns]
    cotangent = torch.randn(target.shape, generator=torch.Generator().manual_seed(1)).to(target)
    (grad,) = torch.autograd.grad(target, capture.fused, cotangent, retain_graph=True, allow_unused=True)
    if grad is None:
        return set()
    used = grad.reshape(-1, grad.size(-1)).abs().sum(0) != 0
    return set(torch.nonzero(used).flatten().tolist())


def _attention_layout(att: AttentionPlan, capture: _Capture) -> ColumnLayout:
    h, kv, d = att.num_heads, att.num_kv_heads, att.head_dim
    group = h // kv
    width = (group + 2) * d  # one kv group interleaved: its q heads, its k, its v
    concatenated = per_group = True
    for head in (0, h - 1):
        used = _dependencies(capture, slice(head * d, (head + 1) * d))
        if not used:
            return ColumnLayout.UNKNOWN
        g = head // group
        q = range(head * d, (head + 1) * d)
        k = range(h * d + g * d, h * d + (g + 1) * d)
        v = range((h + kv) * d + g * d, (h + kv) * d + (g + 1) * d)
        concatenated &= used <= {*q, *k, *v}
        per_group &= used <= set(range(g * width, (g + 1) * width))
    if concatenated:
        return ColumnLayout.SEGMENTS
    return ColumnLayout.PER_GROUP if per_group else ColumnLayout.UNKNOWN


def _gate_up_layout(mlp: MLPPlan, capture: _Capture) -> ColumnLayout:
    inner = mlp.column[0].segments[0]
    halves = pairs = True
    partner_seen = False
    for j in (0, inner - 1):
        used = _dependencies(capture, slice(j, j + 1))
        if not used:
            return ColumnLayout.UNKNOWN
        halves &= used <= {j, inner + j}
        pairs &= used <= {2 * j, 2 * j + 1}
        partner_seen |= len(used) > 1
    if not partner_seen:
        # One feature alone (an activation that zeroed its partner on every probe position):
        # no evidence either way; keep the shape-based [gate | up] default.
        return ColumnLayout.SEGMENTS if halves else ColumnLayout.UNKNOWN
    if halves:
        return ColumnLayout.SEGMENTS
    return ColumnLayout.PER_GROUP if pairs else ColumnLayout.UNKNOWN


def _with_layout(p: Projection, layout: ColumnLayout) -> Projection:
    if layout is ColumnLayout.SEGMENTS:
        return replace(p, layout=layout)
    return replace(p, segments=(), layout=layout)


def _describe(layout: ColumnLayout) -> str:
    return {
        ColumnLayout.SEGMENTS: "fused segments side by side",
        ColumnLayout.PER_GROUP: "interleaved per head group (cut contiguously)",
        ColumnLayout.UNKNOWN: "fused in an order not recognized (tensor parallelism refuses it)",
    }[layout]


def _summary(notes: list[str]) -> list[str]:
    """One note per distinct observation, naming the first block it was seen in."""
    seen: dict[str, str] = {}
    for note in notes:
        path, _, what = note.partition(": ")
        seen.setdefault(what, path)
    return [f"{path} (and alike): {what}" for what, path in seen.items()]


def _noted(plan: ModelPlan, note: str) -> ModelPlan:
    return replace(plan, notes=tuple(dict.fromkeys([*plan.notes, note])))
