"""Tensor parallelism (+ sequence parallelism) of an unchanged model, driven by its ModelPlan.

Per block, as in Megatron-LM and the Ultra-Scale Playbook:

    attention:  f -> q, k, v column-parallel (heads split over tp) -> attention -> o row-parallel -> g
    MLP:        f -> up/gate (fc1) column-parallel -> activation -> down (fc2) row-parallel -> g

``f`` sits on the attention / MLP module's input, so q, k and v share one all-reduce in
backward; ``g`` sits inside the row-parallel linear, before its bias (added once). With
``sequence_parallel`` the residual stream between those regions is cut along the
sequence: it is scattered at the first block's input and gathered at the last block's
output, and f/g become all-gather / reduce-scatter (f*, g*; see ``ops``). The
gathered input of a region is kept for backward as the rank's shard (``regather``).

``nn.MultiheadAttention`` (q, k and v in one ``in_proj_weight``, applied inside torch's own
call) gets a forward that runs the rank's heads and calls its row-parallel ``out_proj``
(``packed_attention``). An MLP whose linears the block holds directly (nn.TransformerEncoderLayer's
``linear1`` / ``linear2``) enters its region at each column linear, not at the block.

Outside the blocks, the token embedding and the output head are cut along the
vocabulary (``vocab``), and the head's logits stay vocabulary-sharded.

The module is changed in place and keeps its classes and parameter names: column and
row linears get smaller ``weight``/``bias`` Parameters and matching ``in_features`` /
``out_features`` (``nx``/``nf`` for GPT-2's Conv1D); row linears and the embedding get a
forward that adds their collective; attention attributes holding a full head count
(``ModelPlan``'s ``head_attributes``) are divided by tp, and reshapes the forward makes with a
full width read elsewhere (nanoGPT's ``view(B, T, C)``) get local sizes (``local_shapes``). Parameters are plain local
tensors, so ZeRO-1/2 and FSDP2 over the data ranks compose without knowing about TP;
:class:`TensorShard` records how each was cut, to rebuild full tensors for checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_5d.parallel.regions import Region, chunk_ranges
from lightning_5d.materialize.apply import placement_device
from lightning_5d.parallel.tensor import ops as tensor_ops
from lightning_5d.parallel.tensor.local_shapes import localize_shapes
from lightning_5d.parallel.tensor.head_bias import wrap_per_head_bias
from lightning_5d.parallel.tensor.packed_attention import map_qkv_inputs, run_local_heads
from lightning_5d.parallel.tensor.regather import RegatherRegion
from lightning_5d.parallel.tensor.random_stream import SharedRandomStream
from lightning_5d.parallel.tensor.validate import TensorParallelError, check_block_forwards, in_features, out_features
from lightning_5d.parallel.tensor.validate import validate_tensor_parallel
from lightning_5d.parallel.tensor.vocab import vocab_parallel_forward, vocab_range
from lightning_5d.parallel.tensor.width_norm import distributed_rms_forward, find_width_norms
from lightning_5d.plan import paths
from lightning_5d.plan.model_plan import ModelPlan, Projection, ProjectionKind


@dataclass(frozen=True)
class TensorShard:
    """How a rank's tensor is cut from the full one: along ``dim``, each of the fused
    ``segments`` (full sizes along ``dim``; one segment if empty) into ``tp`` pieces."""

    dim: int
    segments: tuple[int, ...] = ()

    def _pieces(self, full_size: int) -> list[int]:
        return list(self.segments) or [full_size]

    def slices(self, full: Tensor, rank: int, size: int) -> list[Tensor]:
        """Views of ``full``: rank ``rank``'s part of each segment, in order (what :meth:`take`
        concatenates; the verifier compares a rank's tensor with them without a copy)."""
        parts = full.split(self._pieces(full.size(self.dim)), dim=self.dim)
        return [part.chunk(size, dim=self.dim)[rank] for part in parts]

    def take(self, full: Tensor, rank: int, size: int) -> Tensor:
        return torch.cat(self.slices(full, rank, size), dim=self.dim)

    def assemble(self, locals_: list[Tensor]) -> Tensor:
        """The full tensor from every rank's piece (in rank order), written once into one output
        (nested ``cat`` calls held a second and third full-size copy)."""
        size = len(locals_)
        full_size = locals_[0].size(self.dim) * size
        per_rank = [p // size for p in self._pieces(full_size)]
        shape = list(locals_[0].shape)
        shape[self.dim] = full_size
        out = torch.empty(shape, dtype=locals_[0].dtype, device=locals_[0].device)
        start = 0
        for i, n in enumerate(per_rank):  # segment i: rank r's part of it, then rank r + 1's
            for t in locals_:
                out.narrow(self.dim, start, n).copy_(t.narrow(self.dim, sum(per_rank[:i]), n))
                start += n
        return out

    def gather(self, local: Tensor, group: dist.ProcessGroup, device: torch.device) -> Tensor:
        size = dist.get_world_size(group)
        local_dev = local.to(device).reshape(-1)
        buf = torch.empty(size * local_dev.numel(), dtype=local.dtype, device=device)
        dist.all_gather_single(buf, local_dev, group=group)
        if self.dim == 0 and len(self._pieces(local.size(0) * size)) == 1:
            # The pieces in rank order along dim 0 are the full tensor, as gathered.
            return buf.view(size * local.size(0), *local.shape[1:]).to(local.device)
        return self.assemble([t.view(local.shape) for t in buf.chunk(size)]).to(local.device)


def _column_shard(p: Projection) -> TensorShard:
    return TensorShard(dim=1 if p.kind is ProjectionKind.CONV1D else 0, segments=p.segments)


def _row_shard(p: Projection) -> TensorShard:
    return TensorShard(dim=0 if p.kind is ProjectionKind.CONV1D else 1)


def _map_hidden_states(args: tuple, kwargs: dict, fn: Callable[[Tensor], Tensor], where: str) -> tuple[tuple, dict]:
    """Apply ``fn`` to the hidden-states argument of a block/attention/MLP call."""
    if args and isinstance(args[0], Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    for name in ("hidden_states", "x", "input", "hidden", "h"):
        if isinstance(kwargs.get(name), Tensor):
            return args, {**kwargs, name: fn(kwargs[name])}
    raise RuntimeError(
        f"tensor parallelism could not find the hidden-states argument of {where} (no tensor as first "
        f"positional argument nor a `hidden_states`/`x` keyword); map this module in `model_plan`."
    )


def _map_first_output(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return type(output)([fn(output[0]), *output[1:]])
    raise RuntimeError(f"sequence parallelism expected a block to return a tensor, got {type(output).__name__}.")


def _mlp_entries(mlp) -> list[str]:
    """Where the MLP region starts: its module, or, when the block itself holds the MLP's linears
    (nn.TransformerEncoderLayer's linear1 / linear2, called between the block's norms and
    residual adds), each column linear, so the norms and residuals stay outside f / f*."""
    return [mlp.path] if mlp.path else [p.path for p in mlp.column]


def _row_forward(module: nn.Module, kind: ProjectionKind, reduce: Callable[[Tensor], Tensor]):
    """A row-parallel forward: partial matmul, the collective, then the bias once."""

    def forward(x: Tensor) -> Tensor:
        if kind is ProjectionKind.CONV1D:
            y = torch.mm(x.reshape(-1, x.size(-1)), module.weight).view(*x.shape[:-1], module.weight.size(1))
        else:
            fp8_matmul = getattr(module, "matmul_no_bias", None)  # an FP8 linear keeps its own GEMM
            y = fp8_matmul(x) if fp8_matmul is not None else F.linear(x, module.weight)
        y = reduce(y)
        return y if module.bias is None else y + module.bias

    return forward


class _LocalHeads:
    """A view of a model config whose head counts are this rank's (full // tp).

    Some attention modules read head counts from ``self.config`` at forward time (Phi-3 slices
    its fused qkv at ``config.num_attention_heads * head_dim``). Every other field, including
    ones set later (the attention implementation context parallelism selects), is read
    through from the shared config."""

    def __init__(self, config: Any, local: dict[str, int]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_local", local)

    def __getattr__(self, name: str) -> Any:
        local = object.__getattribute__(self, "_local")
        if name in local:
            return local[name]
        return getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_config"), name, value)


def _localize_config(attention: nn.Module, num_heads: int, num_kv_heads: int, tp: int) -> None:
    config = vars(attention).get("config")
    if config is None or isinstance(config, _LocalHeads):
        return
    local = {}
    for name in ("num_attention_heads", "num_heads", "n_head", "n_heads"):
        if getattr(config, name, None) == num_heads:
            local[name] = num_heads // tp
    for name in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        if num_kv_heads and getattr(config, name, None) == num_kv_heads:
            local[name] = num_kv_heads // tp
    if local:
        attention.config = _LocalHeads(config, local)


def _before_columns(block: nn.Module, mlp) -> list[str]:
    """Parameters of the MLP's own layers registered before its first column projection (the
    norm an ``nn.Sequential(norm, up, act, down)`` starts with): their output feeds only the
    rank's column shard, so their gradient is this rank's part of the sum over tp."""
    columns = {p.path for p in mlp.column}
    found = []
    for path, module in block.named_modules():
        if path in columns:
            break
        if path == mlp.path or not path.startswith(mlp.path + "."):
            continue
        found += [paths.join(path, n) for n, _ in module.named_parameters(recurse=False)]
    return found


class TensorParallel:
    """Applies TP/SP to ``root`` following ``plan``; keeps what checkpoints and clipping need."""

    def __init__(self, root: nn.Module, plan: ModelPlan, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        self.plan = plan
        self.mesh = tp_mesh
        self.group = tp_mesh.get_group()
        self.size = tp_mesh.size()
        self.rank = tp_mesh.get_local_rank()
        self.sequence_parallel = sequence_parallel
        self.device = placement_device(root, tp_mesh.device_type)  # real even for a meta-built model
        self.random_stream = SharedRandomStream(self.group, self.device)
        validate_tensor_parallel(plan, root, self.size)
        if sequence_parallel:
            check_block_forwards(plan, root, self.size)
        # Parameter names (every alias of a tied parameter) -> how that parameter was cut.
        self.shards: dict[str, TensorShard] = {}
        # Names of replicated parameters used only on a sequence shard: their gradients are
        # partial sums over the TP ranks and must be summed (sequence parallelism only).
        self.sequence_partial: set[str] = set()
        self._replaced: dict[int, nn.Parameter] = {}  # id of a full parameter -> its shard
        self._cut_of: dict[int, TensorShard] = {}  # id of a shard -> how it was cut
        self._hooks: list = []
        self.partial_grads_hooked = False  # the sums run in hooks on the trainable parameters
        self._apply(root)

    # ------------------------------------------------------------------ sharding
    def _shard_param(self, module: nn.Module, name: str, shard: TensorShard) -> None:
        old = getattr(module, name)
        new = self._replaced.get(id(old))
        if new is None:
            local = shard.take(old.detach(), self.rank, self.size).clone()
            new = nn.Parameter(local, requires_grad=old.requires_grad)
            self._replaced[id(old)] = new
            self._cut_of[id(new)] = shard
        setattr(module, name, new)

    def _column(self, block: nn.Module, p: Projection) -> None:
        module = block.get_submodule(p.path)
        if p.kind is ProjectionKind.PACKED_IN_PROJ:  # nn.MultiheadAttention: [q_r|k_r|v_r] of its [3E, E] rows
            self._shard_param(module, "in_proj_weight", TensorShard(0, p.segments))
            if module.in_proj_bias is not None:
                self._shard_param(module, "in_proj_bias", TensorShard(0, p.segments))
            for extra in ("bias_k", "bias_v"):  # add_bias_kv: [1, 1, E], the entries of the rank's heads
                if getattr(module, extra, None) is not None:
                    self._shard_param(module, extra, TensorShard(2))
            return
        shard = _column_shard(p)
        self._shard_param(module, "weight", shard)
        if getattr(module, "bias", None) is not None:
            self._shard_param(module, "bias", TensorShard(0, p.segments))
        self._set_width(module, ("out_features", "nf"), out_features(module, p))

    def _row(self, block: nn.Module, p: Projection) -> None:
        module = block.get_submodule(p.path)
        self._shard_param(module, "weight", _row_shard(p))
        self._set_width(module, ("in_features", "nx"), in_features(module, p))
        if self.sequence_parallel:
            reduce = lambda y: tensor_ops.reduce_scatter_from_tp(y, self.group)  # noqa: E731
        else:
            reduce = lambda y: tensor_ops.reduce_from_tp(y, self.group)  # noqa: E731
        module.forward = _row_forward(module, p.kind, reduce)

    @staticmethod
    def _set_width(module: nn.Module, names: Iterable[str], value: int) -> None:
        for name in names:
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, value)

    def _enter_region(self, module: nn.Module, where: str, packed: bool = False) -> None:
        """f (or f*) on the input of an attention / MLP / head module (``packed``: on the query,
        key and value of an nn.MultiheadAttention)."""
        if self.sequence_parallel and where != "head":
            region = RegatherRegion()

            def gather(shard: Tensor) -> Tensor:
                gathered = tensor_ops.gather_into_tp(shard, self.group)
                region.enter(gathered, shard, seq_dim=1, group=self.group)
                return gathered

            fn = gather
            # always_call: a forward that raises (the plan verifier's probe of a model that
            # cannot run under tp) must not leave the region's saved-tensor hooks entered; a
            # later step's tensor allocated at the old gathered address would be packed against
            # this dead region and re-gathered on one rank only (a hang, seen in a long launch).
            self._hooks.append(module.register_forward_hook(lambda *_: region.exit(), always_call=True))
        else:
            fn = lambda x: tensor_ops.copy_to_tp(x, self.group)  # noqa: E731
        if packed:
            sp = self.sequence_parallel
            hook = lambda _m, args, kwargs: map_qkv_inputs(args, kwargs, fn, sp, where)  # noqa: E731
        else:
            hook = lambda _m, args, kwargs: _map_hidden_states(args, kwargs, fn, where)  # noqa: E731
        self._hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _apply(self, root: nn.Module) -> None:
        plan = self.plan
        for i, block_plan in enumerate(plan.block_plans):
            block = root.get_submodule(plan.block_path(i))
            att = block_plan.attention
            if att is not None:  # None: a feed-forward entry of an alternating block list
                attention = block.get_submodule(att.path)
                # The full model's widths, only for rebuilding a per-head bias (a packed
                # nn.MultiheadAttention holds no per-projection weight to read them from).
                full_widths = (
                    {block.get_submodule(p.path): out_features(block.get_submodule(p.path), p) for p in att.column}
                    if att.per_head_bias
                    else {}
                )
                full_attributes = {attr: getattr(attention, attr) for attr in att.head_attributes}
                for p in att.column:
                    self._column(block, p)
                self._row(block, att.o)
                if att.packed:  # its forward from its parts, with H/t heads of E/t features
                    run_local_heads(attention, self.rank, self.size)
                else:
                    for attr in att.head_attributes:
                        setattr(attention, attr, getattr(attention, attr) // self.size)
                _localize_config(attention, att.num_heads, att.num_kv_heads, self.size)
                localize_shapes(attention, att.shape_sites, self.size)
                if att.per_head_bias:
                    wrap_per_head_bias(attention, full_attributes, full_widths, att.num_heads, self.rank, self.size)
                self._width_norms(block, plan.block_path(i), att, block_plan.norms)
                self._enter_region(attention, f"{plan.block_path(i)}.{att.path}", packed=att.packed)
            if block_plan.mlp is not None:
                for p in block_plan.mlp.column:
                    self._column(block, p)
                for p in block_plan.mlp.row:
                    self._row(block, p)
                for entry in _mlp_entries(block_plan.mlp):
                    self._enter_region(block.get_submodule(entry), f"{plan.block_path(i)}.{entry}")
            # An MoE feed-forward stays replicated over tp: token-wise, so it is exact on a
            # replicated input and, under SP, on the rank's sequence shard.
            if self.sequence_parallel:
                self._mark_sequence_partial(block, plan.block_path(i), block_plan)
            self._mark_head_partial(block, plan.block_path(i), block_plan)
        self._shard_vocab(root)
        if self.sequence_parallel and plan.num_blocks:
            first = root.get_submodule(plan.block_path(0))
            last = root.get_submodule(plan.block_path(plan.num_blocks - 1))
            scatter = lambda x: tensor_ops.scatter_to_sequence_parallel(x, self.group)  # noqa: E731
            gather = lambda x: tensor_ops.gather_from_sequence_parallel(x, self.group)  # noqa: E731
            self._hooks.append(
                first.register_forward_pre_hook(
                    lambda _m, args, kwargs: _map_hidden_states(args, kwargs, scatter, plan.block_path(0)),
                    with_kwargs=True,
                )
            )
            self._hooks.append(last.register_forward_hook(lambda _m, _i, out: _map_first_output(out, gather)))
        self._record_names(root)
        # Only needed while cutting (tied parameters are cut once). Kept, they would hold every
        # tp-local tensor alive after ZeRO-3 (FSDP2) replaces the parameters with its shards.
        self._replaced.clear()
        self._cut_of.clear()

    def _width_norms(self, block: nn.Module, prefix: str, att, pre_norms: tuple[str, ...]) -> None:
        """Norms over a q/k projection's full width: cut like its columns, statistics summed over tp."""
        head_dim = att.head_dim or 0
        widths = {att.num_heads * head_dim, (att.num_kv_heads or att.num_heads) * head_dim} - {0}
        for norm in find_width_norms(block, att.path, widths, head_dim, pre_norms):
            module = block.get_submodule(norm.path)
            if norm.eps is None:
                raise TensorParallelError(
                    f"tp={self.size} cuts the columns that {prefix}.{norm.path} ({type(module).__name__}) normalizes "
                    f"over their full width ({norm.width} features), and its forward is not an RMSNorm "
                    f"(w * x / sqrt(mean(x^2) + eps), checked on a random input), the one width norm tensor "
                    f"parallelism computes from per-rank statistics. Use tp=1 for this model (cp, pp and ZeRO do "
                    f"not cut projections)."
                )
            self._shard_param(module, "weight", TensorShard(0))
            module.forward = distributed_rms_forward(module, norm, self.group)

    def _mark_sequence_partial(self, block: nn.Module, prefix: str, block_plan) -> None:
        att = block_plan.attention
        mlp = block_plan.mlp
        inside = ([att.path] if att else []) + (_mlp_entries(mlp) if mlp else [])
        if mlp is not None and not mlp.path:  # linears held by the block itself: each one is inside
            inside += [p.path for p in mlp.row]
        rows = [p.path for p in (att.row if att else ()) + (mlp.row if mlp else ())]
        for name, _ in block.named_parameters():
            in_region = any(name.startswith(path + ".") for path in inside)
            row_bias = any(name == f"{path}.bias" for path in rows)
            if row_bias or not in_region:
                self.sequence_partial.add(f"{prefix}.{name}")

    def _mark_head_partial(self, block: nn.Module, prefix: str, block_plan) -> None:
        """Parameters inside the attention region that tp did not cut, other than the output
        projection's bias: a q/k norm applied per head (Qwen3, Gemma 3) sees only this rank's
        heads, so its gradient is this rank's part of the sum over tp, as SP's norm weights are.
        In the MLP region only the layers before its first column projection (a norm inside an
        ``nn.Sequential`` MLP); an MoE there stays replicated and sees the whole input."""
        if block_plan.attention is not None:
            inside = block_plan.attention.path
            rows = [p.path for p in block_plan.attention.row]
            for name, param in block.named_parameters():
                in_region = name.startswith(inside + ".")
                row_bias = any(name == f"{path}.bias" for path in rows)
                if in_region and not row_bias and id(param) not in self._cut_of:
                    self.sequence_partial.add(f"{prefix}.{name}")
        if block_plan.mlp is not None:
            for name in _before_columns(block, block_plan.mlp):
                self.sequence_partial.add(f"{prefix}.{name}")

    @property
    def has_partial_grads(self) -> bool:
        """Whether some replicated parameter's gradient must be summed over tp (SP's norms, q/k norms)."""
        return bool(self.sequence_partial)

    def _shard_vocab(self, root: nn.Module) -> None:
        plan = self.plan
        embedding = root.get_submodule(plan.embedding)
        vocab = plan.vocab_size
        start, _ = vocab_range(vocab, self.rank, self.size)
        rows = TensorShard(0)
        self._shard_param(embedding, "weight", rows)
        self._set_width(embedding, ("num_embeddings",), vocab // self.size)
        embedding.forward = vocab_parallel_forward(embedding, start, self.group)
        if plan.head is None:
            return
        head = root.get_submodule(plan.head)
        self._shard_param(head, "weight", rows)
        if getattr(head, "bias", None) is not None:
            self._shard_param(head, "bias", rows)
        self._set_width(head, ("out_features",), vocab // self.size)
        self._enter_region(head, "head")
        mesh = self.mesh
        self._hooks.append(
            head.register_forward_hook(
                lambda _m, _i, out: DTensor.from_local(out, mesh, [Shard(out.ndim - 1)], run_check=False)
            )
        )

    def _record_names(self, root: nn.Module) -> None:
        for name, param in root.named_parameters(remove_duplicate=False):
            if id(param) in self._cut_of:
                self.shards[name] = self._cut_of[id(param)]

    # ------------------------------------------------------------------ gradients
    def register_sequence_parallel_grad_hooks(self, root: nn.Module) -> None:
        """Sum the partial gradients of sequence-sharded replicated parameters as they are made
        (before accumulation, so micro-batches add up). Not for FSDP2, which replaces the
        parameters: there :meth:`sync_sequence_parallel_grads` runs after the backward."""
        group = self.group

        def hook(grad: Tensor) -> Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        params = dict(root.named_parameters())
        self.partial_grads_hooked = True
        for name in sorted(self.sequence_partial):
            if name in params and params[name].requires_grad:  # a frozen one: parallel/frozen.py
                self._hooks.append(params[name].register_hook(hook))

    def sync_sequence_parallel_grads(self, root: nn.Module) -> None:
        grads = []
        for name, p in root.named_parameters():
            if name in self.sequence_partial and p.grad is not None:
                grads.append(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def is_sharded(self, name: str) -> bool:
        return name in self.shards

    # ------------------------------------------------------------------ checkpoints
    def full_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict of local shards -> full tensors (collective over tp)."""
        return {k: self._full(k, v) for k, v in state.items()}

    def local_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A full model state dict -> this rank's shards (no communication)."""
        return {k: self._local(k, v) for k, v in state.items()}

    def full_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A name-keyed optimizer state (torch's full format) with local shards -> full."""
        return {**state, "state": {n: {k: self._full(n, v) for k, v in s.items()} for n, s in state["state"].items()}}

    def local_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "state": {n: {k: self._local(n, v) for k, v in s.items()} for n, s in state["state"].items()}}

    def local_region(self, name: str, region: Region) -> Region:
        """The index ranges of ``name``'s full tensor this rank keeps (what :meth:`local_state`
        would cut, without the tensor): chunk ``rank`` of each fused segment along the shard dim."""
        shard = self.shards.get(name)
        if shard is None or not region.shape:
            return region
        size = region.local_shape[shard.dim]
        return region.select(shard.dim, chunk_ranges(size, self.size, self.rank, shard.segments))

    def _full(self, name: str, value: Any) -> Any:
        shard = self.shards.get(name)
        if shard is None or not isinstance(value, Tensor) or value.dim() == 0:
            return value
        return shard.gather(value, self.group, self.device)

    def _local(self, name: str, value: Any) -> Any:
        shard = self.shards.get(name)
        if shard is None or not isinstance(value, Tensor) or value.dim() == 0:
            return value
        return shard.take(value, self.rank, self.size).clone()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
