"""Expert parallelism: each rank of the ep group keeps E/ep experts of every MoE layer and
tokens travel to them by all-to-all (``dispatch``).

Two shapes of MoE are driven, as discovery reports them (``MoEPlan.experts_kind``):

* ``MODULE_LIST`` (the reference model, generic "router + list of expert MLPs"): the MoE
  module's forward is replaced. Routing is ours: router logits -> fp32 softmax -> top-k ->
  weights renormalised over the k (Mixtral's rule, the reference model's too) -> dispatch
  -> each local expert called on its rows -> combine, plus the shared experts.
* ``GROUPED`` (Hugging Face 5.x Mixtral, Qwen2-MoE): one module holds [E, ...] weights
  and is called as ``experts(x, top_k_index, top_k_weights)`` by the model's own block,
  after the model's own router. Only that call is replaced: dispatch, then the original
  forward on the received rows with local expert ids and unit weights, then combine.

Parameters: non-local experts are dropped from each rank (a ModuleList keeps an empty
placeholder at their index, so names do not move; grouped weights keep rows
[r*E/ep, (r+1)*E/ep)). ``full_state`` / ``local_state`` convert to and from the full model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_5d.materialize.apply import placement_device
from lightning_5d.config import ExpertConfig, LoadBalancing
from lightning_5d.parallel.regions import Region
from lightning_5d.mesh import ParallelMesh
from lightning_5d.parallel.expert.balance import AttachAuxLoss, load_balancing_loss, update_bias
from lightning_5d.parallel.expert.dispatch import DispatchPlan, dispatch_and_combine, exchange_counts, plan_dispatch
from lightning_5d.parallel.expert.metrics import ExpertLoad
from lightning_5d.plan import ExpertsKind, ModelPlan, MoEPlan
from lightning_5d.plan.blocks import ModelMappingError


class ExpertParallelError(ModelMappingError):
    """An MoE layout that cannot be built; the message names the value and a fix."""


class _AbsentExpert(nn.Module):
    """Stands at the index of an expert another ep rank owns."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this expert lives on another ep rank; it is reached through the all-to-all")


@dataclass
class _Layer:
    index: int  # position among the MoE layers
    path: str  # dotted path of the experts, from the discovered module
    plan: MoEPlan
    router: nn.Module
    experts: nn.Module
    shared: nn.Module | None
    shared_gate: nn.Module | None
    bias: Tensor | None = None  # aux-loss-free selection bias (a buffer on the router)
    probs: Tensor | None = None  # GROUPED: this call's router probabilities, from the router hook
    counts: Tensor | None = None  # local assignments per expert since the last read
    dropped: int = 0
    sliced: dict[str, int] = field(default_factory=dict)  # grouped parameter name -> its dim-0 size E


def _in_backward() -> bool:
    # Activation checkpointing re-runs forwards inside backward: count each token once.
    return torch._C._current_graph_task_id() != -1


class ExpertParallel:
    def __init__(self, module: nn.Module, plan: ModelPlan, mesh: ParallelMesh, config: ExpertConfig) -> None:
        self.module = module
        self.config = config
        self.ep = mesh.layout.ep
        self.group = mesh.group("ep") if self.ep > 1 else None
        self.rank = mesh.local_rank("ep") if self.ep > 1 else 0
        # dp x cp: the ranks that route different tokens through the same layers (tp peers
        # route the same ones); for logged totals, pp adds the other stages' layers.
        self._data_group = mesh.group("dp_cp") if mesh.size("dp_cp") > 1 else None
        stages = mesh.group("pp") if mesh.size("pp") > 1 else None
        self._count_groups = [g for g in (self._data_group, stages) if g is not None]
        self.device = placement_device(module, mesh.root.device_type)  # real even for a meta-built model
        self.aux_scale = 1.0  # d(loss Lightning backpropagates)/d(the user's loss); the strategy sets it
        self.layers: list[_Layer] = []
        self._aux_values: list[Tensor] = []
        self._pending: Tensor | None = None  # global counts since the last bias update
        self.last_plans: list[DispatchPlan] = []  # this step's dispatch plans (tests read the splits)
        for i, block_plan in enumerate(plan.block_plans):
            if block_plan.moe is not None:
                self._add_layer(plan.block_path(i), module.get_submodule(plan.block_path(i)), block_plan.moe)
        if not self.layers:
            raise ExpertParallelError(
                f"ep={self.ep} / expert settings {config} need MoE layers, but discovery found none in "
                f"{type(module).__name__}; name them with "
                f"model_plan, e.g. {{'model.layers.*.moe': 'moe', 'model.layers.*.moe.router': 'moe.router', "
                f"'model.layers.*.moe.experts': 'moe.experts'}}, or use ep=1 and the default expert settings."
            )
        experts = max(layer.plan.num_experts for layer in self.layers)
        self.num_layers = len(self.layers)  # stays: pp ranks sum [num_layers, E] counts together
        self.load = ExpertLoad(self.num_layers, experts).to(self.device)

    # ------------------------------------------------------------------ setup
    def _add_layer(self, block_path: str, block: nn.Module, moe: MoEPlan) -> None:
        E = moe.num_experts
        if E % self.ep:
            fits = [d for d in range(1, E + 1) if E % d == 0]
            raise ExpertParallelError(
                f"{block_path}.{moe.experts} holds {E} experts, which do not split over ep={self.ep}; "
                f"use an ep that divides {E} (and dp_shard*cp): {fits}."
            )
        layer = _Layer(
            index=len(self.layers),
            path=f"{block_path}.{moe.experts}",
            plan=moe,
            router=block.get_submodule(moe.router),
            experts=block.get_submodule(moe.experts),
            shared=block.get_submodule(moe.shared_experts) if moe.shared_experts else None,
            shared_gate=block.get_submodule(moe.shared_expert_gate) if moe.shared_expert_gate else None,
        )
        if self.config.load_balancing == LoadBalancing.BIAS:
            layer.router.register_buffer("expert_bias", torch.zeros(E, device=self.device), persistent=True)
            layer.bias = layer.router.expert_bias
        lo, hi = self.local_range(E)
        if moe.experts_kind == ExpertsKind.GROUPED:
            for name, p in list(layer.experts.named_parameters(recurse=False)):
                if p.dim() >= 1 and p.shape[0] == E:
                    setattr(layer.experts, name, nn.Parameter(p.detach()[lo:hi].clone(), p.requires_grad))
                    layer.sliced[name] = E
            if hasattr(layer.experts, "num_experts"):
                layer.experts.num_experts = hi - lo
            layer.experts.forward = functools.partial(self._grouped_forward, layer, layer.experts.forward)
            layer.router.register_forward_hook(functools.partial(self._on_router, layer))
        else:
            if not moe.top_k:
                raise ExpertParallelError(
                    f"{block_path}.{moe.path or '(block)'}: discovery could not tell how many experts each token "
                    f"picks; give the MoE module a `top_k` attribute."
                )
            for j in range(E):
                if not lo <= j < hi:
                    layer.experts[j] = _AbsentExpert()
            moe_module = block.get_submodule(moe.path) if moe.path else block
            moe_module.forward = functools.partial(self._list_forward, layer)
        layer.counts = torch.zeros(E, dtype=torch.long, device=self.device)
        self.layers.append(layer)

    def drop_absent(self, module: nn.Module) -> None:
        """Forget MoE layers no longer in ``module`` (other pipeline stages), so they can be freed."""
        present = {id(m) for m in module.modules()}
        self.layers = [layer for layer in self.layers if id(layer.router) in present]

    def local_range(self, num_experts: int) -> tuple[int, int]:
        local = num_experts // self.ep
        return self.rank * local, (self.rank + 1) * local

    def local_expert_modules(self) -> list[nn.Module]:
        """The modules whose forward runs this rank's experts (what ZeRO-3 shards over edp)."""
        modules: list[nn.Module] = []
        for layer in self.layers:
            if layer.plan.experts_kind == ExpertsKind.GROUPED:
                modules.append(layer.experts)
            else:
                lo, hi = self.local_range(layer.plan.num_experts)
                modules.extend(layer.experts[j] for j in range(lo, hi))
        return modules

    def is_expert(self, name: str) -> bool:
        """Whether a parameter name (from the discovered module) belongs to routed experts."""
        return any(name.startswith(layer.path + ".") for layer in self.layers)

    # ------------------------------------------------------------------ forward
    def _select(self, layer: _Layer, probs: Tensor, k: int) -> Tensor:
        scores = probs if layer.bias is None else probs + layer.bias
        return scores.topk(k, dim=-1).indices

    def _list_forward(self, layer: _Layer, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = layer.router(x).float().softmax(dim=-1)
        top_i = self._select(layer, probs, layer.plan.top_k)
        top_w = probs.gather(1, top_i)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        lo, _ = self.local_range(layer.plan.num_experts)

        def run_local(rows: Tensor, counts: list[int]) -> Tensor:
            # Every local expert runs, even on no rows, so each gets a (zero) gradient every step.
            chunks = rows.split(counts)
            return torch.cat([layer.experts[lo + j](chunk) for j, chunk in enumerate(chunks)])

        out = self._route(layer, x, top_i, top_w, probs, run_local)
        if layer.shared is not None:
            shared = layer.shared(x)
            out = out + (torch.sigmoid(layer.shared_gate(x)) * shared if layer.shared_gate is not None else shared)
        return out.view(shape)

    def _on_router(self, layer: _Layer, router: nn.Module, args: tuple, output: Any) -> Any:
        # Hugging Face routers return (logits, top-k weights, top-k indices).
        if not (isinstance(output, tuple) and len(output) == 3):
            if self.config.load_balancing == LoadBalancing.NONE:
                return None
            raise ExpertParallelError(
                f"expert.load_balancing={self.config.load_balancing.value} needs the router {type(router).__name__} "
                f"to return (logits, top-k weights, top-k indices) as Hugging Face routers do; it returned "
                f"{type(output).__name__}. Use load_balancing=none for this model."
            )
        logits, weights, indices = output
        layer.probs = logits.float().softmax(dim=-1)
        if layer.bias is None:
            return None
        indices = self._select(layer, layer.probs, indices.shape[-1])
        picked = layer.probs.gather(1, indices)
        if getattr(router, "norm_topk_prob", True):
            picked = picked / picked.sum(dim=-1, keepdim=True)
        return logits, picked.to(weights.dtype), indices

    def _grouped_forward(self, layer: _Layer, original: Callable, x: Tensor, top_i: Tensor, top_w: Tensor) -> Tensor:
        def run_local(rows: Tensor, counts: list[int]) -> Tensor:
            sizes = torch.tensor(counts, device=rows.device)
            ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), sizes)
            ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
            return original(rows, ids.unsqueeze(1), ones)

        probs, layer.probs = layer.probs, None
        return self._route(layer, x, top_i, top_w, probs, run_local)

    def _route(
        self, layer: _Layer, x: Tensor, top_i: Tensor, top_w: Tensor, probs: Tensor | None, run_local: Callable
    ) -> Tensor:
        cfg = self.config
        plan = plan_dispatch(
            top_i,
            top_w,
            layer.plan.num_experts,
            self.ep,
            lambda counts: exchange_counts(counts, self.group),
            cfg.capacity_factor,
            cfg.drop_policy,
        )
        out = dispatch_and_combine(x, plan, self.group, run_local)
        recording = self.module.training and not _in_backward()
        if recording:
            layer.counts += plan.tokens_per_expert
            layer.dropped += plan.dropped
            self.last_plans.append(plan)
        if cfg.load_balancing == LoadBalancing.AUX_LOSS and probs is not None and torch.is_grad_enabled():
            aux = load_balancing_loss(probs, self._global(plan.tokens_per_expert.clone()))
            out = AttachAuxLoss.apply(out, aux, cfg.aux_loss_coef * self.aux_scale)
            if recording:
                self._aux_values.append(aux.detach())
        return out

    def _global(self, counts: Tensor) -> Tensor:
        if self._data_group is not None:
            dist.all_reduce(counts, group=self._data_group)
        return counts

    # ------------------------------------------------------------------ per step
    def start_step(self) -> None:
        self.last_plans = []

    def take_step_stats(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Counts [layers, E] and dropped assignments since the last call, summed over every rank
        that routes different tokens (a collective: call on every rank), and the mean aux loss."""
        width = self.load.tokens.shape[1]
        counts = torch.zeros(self.num_layers, width + 1, dtype=torch.long, device=self.device)
        for layer in self.layers:
            counts[layer.index, : layer.plan.num_experts] = layer.counts
            counts[layer.index, width] = layer.dropped
            layer.counts.zero_()
            layer.dropped = 0
        for group in self._count_groups:
            dist.all_reduce(counts, group=group)
        aux = None
        if self._aux_values:
            aux = torch.stack(self._aux_values).mean().reshape(1)
            if self._data_group is not None:
                dist.all_reduce(aux, group=self._data_group)
                aux = aux / dist.get_world_size(self._data_group)
            self._aux_values = []
        return counts[:, :width], counts[:, width].sum(), aux

    def after_step(self, module: nn.Module) -> None:
        """Log the step's expert load (and aux loss); accumulate counts for the bias update."""
        counts, dropped, aux = self.take_step_stats()
        if self.config.load_balancing == LoadBalancing.BIAS:
            self._pending = counts if self._pending is None else self._pending + counts
        if self.config.log_load:
            self.load.update(counts, dropped)
            values = self.load.compute()
            self.load.reset()
            module.log("moe/load_imbalance", values["load_imbalance"], on_step=True, on_epoch=False)
            module.log("moe/dropped_tokens", values["dropped_tokens"], on_step=True, on_epoch=False)
            for e, n in enumerate(values["tokens_per_expert"].tolist()):
                module.log(f"moe/expert_{e}_tokens", float(n), on_step=True, on_epoch=False)
        if aux is not None:
            module.log("moe/aux_loss", aux[0], on_step=True, on_epoch=False)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        if self._pending is None:
            return
        for layer in self.layers:
            if layer.bias is not None:
                update_bias(
                    layer.bias, self._pending[layer.index, : layer.plan.num_experts], self.config.bias_update_rate
                )
        self._pending = None

    # ------------------------------------------------------------------ checkpoints
    def _owner_entries(self, state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(grouped slices, list experts held here) among the state's entries."""
        grouped, listed = {}, {}
        for key, value in state.items():
            for layer in self.layers:
                if not key.startswith(layer.path + "."):
                    continue
                rest = key[len(layer.path) + 1 :]
                if layer.plan.experts_kind == ExpertsKind.GROUPED:
                    if rest in layer.sliced:
                        grouped[key] = value
                else:
                    listed[key] = value
        return grouped, listed

    def full_state(self, state: dict[str, Any], gather_listed: bool = True) -> dict[str, Any]:
        """Local expert entries -> every expert (collective over ep). Experts kept as a list are
        already named by their global index: ``gather_listed=False`` leaves each rank its own
        (what a sharded checkpoint writes), only grouped slices are gathered."""
        if self.group is None:
            return state
        grouped, listed = self._owner_entries(state)
        out = dict(state)
        for key, value in grouped.items():
            parts = [torch.empty_like(value) for _ in range(self.ep)]
            dist.all_gather(parts, value.contiguous(), group=self.group)
            out[key] = torch.cat(parts)
        if not gather_listed:
            return out
        gathered: list[Any] = [None] * self.ep
        dist.all_gather_object(gathered, {k: v.cpu() for k, v in listed.items()}, group=self.group)
        for part in gathered:
            for k, v in part.items():
                out.setdefault(k, v.to(self.device))
        return _ordered_like(out, state)

    def local_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A full state dict -> the entries this rank keeps (no communication)."""
        if self.group is None:
            return state
        out = {}
        for key, value in state.items():
            layer = next((la for la in self.layers if key.startswith(la.path + ".")), None)
            if layer is None:
                out[key] = value
                continue
            rest = key[len(layer.path) + 1 :]
            lo, hi = self.local_range(layer.plan.num_experts)
            if layer.plan.experts_kind == ExpertsKind.GROUPED:
                out[key] = value[lo:hi].clone() if rest in layer.sliced else value
            elif lo <= int(rest.split(".")[0]) < hi:
                out[key] = value
        return out


    def local_region(self, name: str, region: Region) -> Region:
        """The rows of a grouped experts tensor this rank keeps (:meth:`local_state` without the tensor);
        experts kept as a list are whole tensors of their own, held by name."""
        if self.group is None:
            return region
        layer = next((la for la in self.layers if name.startswith(la.path + ".")), None)
        if layer is None or layer.plan.experts_kind != ExpertsKind.GROUPED or name[len(layer.path) + 1 :] not in layer.sliced:
            return region
        return region.select(0, [self.local_range(layer.plan.num_experts)])


def _ordered_like(out: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    # Keep the model's own key order where it has the key; experts from other ranks follow.
    ordered = {k: out[k] for k in reference}
    ordered.update({k: v for k, v in out.items() if k not in ordered})  # gathered in rank = expert order
    return ordered
