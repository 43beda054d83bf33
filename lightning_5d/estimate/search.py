"""Find the best layout for a cluster: the playbook's "how to find the best training configuration", executable.

1. Enumerate layouts the model allows (heads % tp, kv heads vs tp, layers % pp*v, experts % ep,
   seq % 2cp), tp kept inside a node, every global-batch split into dp x micro-batch x microbatches;
   drop those the runtime refuses for the layout alone (``lightning_5d.layout_rules``, the rules
   FiveDStrategy raises from), counting them per rule.
2. For each, take the cheapest activation recomputation that fits in memory (none, then
   selective, then full) - recomputation only ever costs time. With cp > 1, each way attention
   can cross the cp ranks (``cp_modes``: ring, allgather, alltoall where the heads per tp rank
   divide by cp, hybrid for every valid all-to-all group size) is estimated, and the one with
   the shortest predicted step that fits is kept; the row says why, against the others.
3. Rank what fits by predicted time per token (= step time for a fixed global batch), then
   exposed communication, memory headroom, bubble, ... (``ranking.py``); say why each row is
   there, and why it beats the next one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import product
from typing import Any

from lightning_5d.config import ActivationCheckpointing, ContextParallelMode, LayoutError, PipelineSchedule, ZeroStage
from lightning_5d.layout_rules import Combination, Rule, refusal

from .comm import Link, group_link
from .estimator import Estimate, estimate
from .ranking import RECOMPUTE_ORDER, Candidate, rank_key, why_ahead
from .spec import ModelSpec, load_spec
from .timing import GIB, Cluster, StepTime, predict_step_time
from .params import kv_heads_per_rank
from .training import Precision, TrainingSetup, valid_cp, valid_pp, valid_tp

ALL_DIMS = frozenset({"dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"})
LAYOUT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


class NoLayoutFitsError(LayoutError):
    """Every candidate layout needs more memory than the GPUs have."""


@dataclass(frozen=True)
class PlanEntry:
    rank: int
    estimate: Estimate
    time: StepTime
    fits: bool
    why: str
    ahead_because: str = ""  # why this row ranks above the next one ("" for the last row)

    @property
    def setup(self) -> TrainingSetup:
        return self.estimate.setup

    def layout(self) -> dict[str, Any]:
        """Sizes + ZeRO stage (+ the cp mode with cp > 1), the keyword arguments FiveDStrategy takes."""
        out: dict[str, Any] = {**{k: getattr(self.setup, k) for k in LAYOUT_KEYS}, "zero": int(self.setup.zero)}
        if self.setup.cp > 1:
            ulysses = {"ulysses": self.setup.cp_ulysses} if self.setup.cp_ulysses else {}
            out["context"] = {"mode": self.setup.cp_mode.value, **ulysses}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "layout": self.setup.describe(),
            **self.estimate.to_dict(),
            "step_time_s": self.time.total,
            "time_breakdown_s": self.time.as_dict(),
            "tokens_per_second": self.estimate.flops.tokens_per_step / self.time.total,
            "predicted_mfu": self.time.predicted_mfu,
            "fits": self.fits,
            "why": self.why,
            "ahead_because": self.ahead_because,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _normalize_dims(available_dims: Iterable[str] | None) -> frozenset[str]:
    if available_dims is None:
        return ALL_DIMS
    dims = set(available_dims)
    if "dp" in dims:
        dims |= {"dp_replicate", "dp_shard"}
        dims.discard("dp")
    unknown = dims - ALL_DIMS
    if unknown:
        raise LayoutError(f"unknown dimension(s) {sorted(unknown)}; choose from {sorted(ALL_DIMS | {'dp'})}.")
    if not dims & {"dp_replicate", "dp_shard"}:
        dims.add("dp_shard")  # data parallelism is always there to absorb the remaining ranks
    return frozenset(dims)


def _data_splits(
    dp: int, cp: int, inner: int, dims: frozenset[str], stages: list[ZeroStage], gpus_per_node: int
) -> Iterator[tuple[int, int, ZeroStage]]:
    """(dp_replicate, dp_shard, zero) candidates for dp data ranks of ``inner`` = tp*cp GPUs each.

    Plain replication (zero 0) goes to dp_replicate when available; sharding (zero >= 1) to
    dp_shard, and also as HSDP: sharded within a node, replicated across nodes. ZeRO shards over
    dp_shard*cp, so with dp = 1 it can still shard over the cp ranks.
    """
    if dp * cp == 1:
        yield 1, 1, ZeroStage.NONE  # no data-parallel peers: nothing to shard or reduce
        return
    for zero in stages:
        if zero == ZeroStage.NONE:
            yield (dp, 1, zero) if "dp_replicate" in dims else (1, dp, zero)
        elif dp == 1 or "dp_shard" in dims:
            yield 1, dp, zero
    per_node = max(gpus_per_node // inner, 1)
    if {"dp_replicate", "dp_shard"} <= dims and 1 < per_node < dp and dp % per_node == 0:
        for zero in (z for z in stages if z > ZeroStage.NONE):
            yield dp // per_node, per_node, zero


def _model_parallel_shapes(
    spec: ModelSpec, gpus: int, seq_len: int, dims: frozenset[str], max_tp: int
) -> Iterator[tuple[int, int, int]]:
    """(tp, cp, pp) whose product divides ``gpus`` and that the model allows."""
    tps = [t for t in valid_tp(spec) if gpus % t == 0 and t <= max_tp] if "tp" in dims else [1]
    cps = [c for c in valid_cp(seq_len, limit=gpus) if gpus % c == 0] if "cp" in dims else [1]
    pps = valid_pp(spec) if "pp" in dims else [1]
    for tp, cp, pp in product(tps, cps, pps):
        if gpus % (tp * cp * pp) == 0:
            yield tp, cp, pp


def _schedules(spec: ModelSpec, pp: int) -> list[tuple[PipelineSchedule, int]]:
    """1F1B, and interleaved 1F1B with v=2 where the layers split that finely."""
    out = [(PipelineSchedule.ONE_F_ONE_B, 1)]
    if pp > 1 and spec.num_layers % (pp * 2) == 0:
        out.append((PipelineSchedule.INTERLEAVED_1F1B, 2))
    return out


def enumerate_setups(
    spec: ModelSpec,
    gpus: int,
    *,
    seq_len: int,
    global_batch: int | None = None,
    micro_batch_sizes: Iterable[int] = (1, 2, 4),
    available_dims: Iterable[str] | None = None,
    zero_stages: Iterable[int] = (0, 1, 2, 3),
    gpus_per_node: int = 8,
    allow_cross_node_tp: bool = False,
    precision: Precision | str = Precision.BF16,
    fp32_grad_accumulation: bool = False,
    recompute: ActivationCheckpointing | str = ActivationCheckpointing.NONE,
    refused: Counter[Rule] | None = None,
) -> Iterator[TrainingSetup]:
    """Every buildable layout of ``gpus`` ranks (with ``recompute`` as given; plan() varies it).

    Layouts the runtime refuses (``layout_rules.refusal``) are not yielded; ``refused``, when
    given, counts them per rule."""
    dims = _normalize_dims(available_dims)
    stages = sorted({ZeroStage(z) for z in zero_stages})
    # tp's per-layer collectives sit on the critical path: keep them on NVLink unless told otherwise.
    max_tp = gpus if allow_cross_node_tp else gpus_per_node
    experts = spec.num_experts if spec.is_moe and "ep" in dims else 1
    fixed = dict(
        seq_len=seq_len,
        precision=precision,
        fp32_grad_accumulation=fp32_grad_accumulation,
        recompute=recompute,
    )
    for tp, cp, pp in _model_parallel_shapes(spec, gpus, seq_len, dims, max_tp):
        dp = gpus // (tp * cp * pp)
        splits = _data_splits(dp, cp, tp * cp, dims, stages, gpus_per_node)
        for (dp_rep, dp_shard, zero), (schedule, v), mbs in product(
            list(splits), _schedules(spec, pp), micro_batch_sizes
        ):
            batch = _batch_split(global_batch, dp, mbs, pp, schedule)
            if batch is None:
                continue
            m, ga = batch
            for ep in (e for e in _divisors(experts) if (dp_shard * cp) % e == 0):
                setup = TrainingSetup(
                    dp_replicate=dp_rep, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp, ep=ep, zero=zero,
                    # SP with tp (Megatron's default), except where ep > 1 runs without it.
                    sequence_parallel=tp > 1 and ep == 1,
                    schedule=schedule, virtual_stages=v, microbatches=m, micro_batch_size=mbs,
                    grad_accum=ga, **fixed,
                )  # fmt: skip
                found = refusal(combination(setup))
                if found is None:
                    yield setup
                elif refused is not None:
                    refused[found[0]] += 1


def combination(setup: TrainingSetup) -> Combination:
    """What ``layout_rules`` reads from a planner candidate (the planner never scales the loss or
    gathers FP8 weights, so those stay off)."""
    return Combination(
        setup.layout,
        zero=setup.zero,
        sequence_parallel=setup.sp,
        schedule=setup.schedule,
        virtual_stages=setup.v,
        microbatches=setup.m if setup.pp > 1 else None,
        fp32_accumulation=setup.fp32_grad_accumulation,
    )


def refused_text(refused: Counter[Rule]) -> str:
    """One line: how many candidates the runtime's layout rules removed, and which rules."""
    if not refused:
        return "skipped 0 candidate layouts the runtime refuses"
    parts = ", ".join(f"{n} {rule.value}" for rule, n in refused.most_common())
    return f"skipped {sum(refused.values())} candidate layouts the runtime refuses ({parts})"


def _batch_split(
    global_batch: int | None, dp: int, mbs: int, pp: int, schedule: PipelineSchedule
) -> tuple[int, int] | None:
    """(microbatches per pipeline run m, grad_accum) giving ``global_batch``, or None if it does not divide.

    With pp every microbatch goes through one pipeline run (largest m, smallest bubble);
    without pp they become gradient-accumulation steps. No global batch: pp's default m = 2p.
    """
    if global_batch is None:
        return (2 * pp, 1) if pp > 1 else (1, 1)
    if global_batch % (dp * mbs):
        return None
    micro = global_batch // (dp * mbs)
    if pp == 1:
        return 1, micro
    if schedule == PipelineSchedule.INTERLEAVED_1F1B and micro % pp:
        return None
    return micro, 1


def cp_modes(spec: ModelSpec, setup: TrainingSetup) -> list[TrainingSetup]:
    """``setup`` in every cp mode the model's heads allow (itself when cp = 1).

    alltoall needs cp to divide the query and KV heads per tp rank; hybrid, an all-to-all group
    size U (1 < U < cp) dividing cp and those heads (``hybrid_attention.valid_ulysses``).
    """
    if setup.cp == 1:
        return [setup]
    from lightning_5d.parallel.context.hybrid import valid_ulysses

    heads = (spec.num_heads // setup.tp, kv_heads_per_rank(spec, setup.tp))
    out = [setup.replace(cp_mode=ContextParallelMode.RING, cp_ulysses=None),
           setup.replace(cp_mode=ContextParallelMode.ALL_GATHER, cp_ulysses=None)]  # fmt: skip
    if heads[0] % setup.cp == 0 and heads[1] % setup.cp == 0:
        out.append(setup.replace(cp_mode=ContextParallelMode.ALL_TO_ALL, cp_ulysses=None))
    out += [setup.replace(cp_mode=ContextParallelMode.HYBRID, cp_ulysses=u) for u in valid_ulysses(setup.cp, heads)]
    return out


def _cp_choice(chosen: tuple[Estimate, StepTime], others: list[tuple[TrainingSetup, StepTime | None]]) -> str:
    """Why ``chosen``'s cp mode: its predicted step and exposed cp time next to the other modes'."""
    est, time = chosen
    s = est.setup
    heads = (est.spec.num_heads // s.tp, kv_heads_per_rank(est.spec, s.tp))

    def text(setup: TrainingSetup, t: StepTime | None) -> str:
        if t is None:
            return f"{setup.cp_mode_text} does not fit"
        return f"{setup.cp_mode_text} {t.total:.3f} s (cp exposed {t.exposed['cp'] * 1e3:.0f} ms)"

    limits = "" if heads[0] % s.cp == 0 and heads[1] % s.cp == 0 else (
        f"; alltoall impossible: cp={s.cp} does not divide {heads[0]} query / {heads[1]} KV heads per tp rank"
    )  # fmt: skip
    rest = ", ".join(text(o, t) for o, t in others)
    return f"attention over cp as {text(s, time)}" + (f", vs {rest}" if rest else "") + limits


def _explain(est: Estimate, time: StepTime, cluster: Cluster, fits: bool, cp_choice: str = "") -> str:
    s, mem = est.setup, est.memory
    gpn = cluster.gpus_per_node
    parts: list[str] = []
    if s.tp > 1:
        where = "inside a node" if group_link(s, ("tp",), gpn) == Link.INTRA else "ACROSS nodes"
        parts.append(
            f"tp={s.tp} {where}{' with SP' if s.sp else ''} splits weights and activations {s.tp} ways"
        )
    if s.pp > 1:
        parts.append(
            f"pp={s.pp} {s.schedule.value} m={s.m}: bubble {100 * est.bubble_fraction:.1f}% of the step"
        )
    if s.cp > 1:
        parts.append(f"cp={s.cp} splits the {s.seq_len}-token sequence")
        if cp_choice:
            parts.append(cp_choice)
    if s.ep > 1:
        parts.append(f"ep={s.ep} spreads {est.spec.num_experts} experts")
    if s.zero > ZeroStage.NONE:
        what = {1: "optimizer states", 2: "grads + optimizer", 3: "params + grads + optimizer"}[int(s.zero)]
        hsdp = f", replicated x{s.dp_replicate} (HSDP)" if s.dp_replicate > 1 else ""
        parts.append(f"ZeRO-{int(s.zero)} shards {what} over {s.zero_group} ranks{hsdp}")
    elif s.dp > 1:
        parts.append(f"plain DP over {s.dp} replicas")
    if s.recompute != ActivationCheckpointing.NONE:
        parts.append(f"{s.recompute.value} recompute needed to fit")
    usable = cluster.usable_memory_bytes / GIB
    parts.append(f"{'fits' if fits else 'does NOT fit'}: {mem.total / GIB:.1f} of {usable:.1f} GiB usable")
    exposed = {d: t for d, t in time.exposed.items() if t >= 5e-4}
    if exposed:
        parts.append("exposed comm " + ", ".join(f"{d} {t * 1e3:.0f} ms" for d, t in exposed.items()))
    elif time.link_busy >= time.total:
        parts.append("bandwidth-bound: the busiest link sets the step time")
    elif est.comm:
        parts.append("communication hidden behind compute")
    parts.append(f"predicted MFU {100 * time.predicted_mfu:.0f}%")
    return "; ".join(parts)


def plan(
    model: Any,
    cluster: Cluster | None = None,
    *,
    seq_len: int = 4096,
    global_batch: int | None = None,
    micro_batch_sizes: Iterable[int] = (1, 2, 4),
    available_dims: Iterable[str] | None = None,
    zero_stages: Iterable[int] = (0, 1, 2, 3),
    recompute_modes: Iterable[ActivationCheckpointing | str] = RECOMPUTE_ORDER,
    precision: Precision | str = Precision.BF16,
    fp32_grad_accumulation: bool = False,
    allow_cross_node_tp: bool = False,
    top: int | None = None,
    include_unfit: bool = False,
    refused: Counter[Rule] | None = None,
) -> list[PlanEntry]:
    """Ranked layouts for ``cluster`` (fastest first). ``global_batch`` is in sequences.

    Raises ``NoLayoutFitsError`` (naming the smallest layout found) when nothing fits,
    unless ``include_unfit`` asks for the ranked unfit layouts instead. ``refused``, when given,
    counts the candidates skipped because the runtime would refuse them, per rule.
    """
    spec = load_spec(model)
    cluster = cluster or Cluster()
    modes = [ActivationCheckpointing(m) for m in recompute_modes]
    fitting: list[tuple[Estimate, StepTime]] = []
    unfit: list[tuple[Estimate, StepTime]] = []
    cp_choices: dict[int, str] = {}  # id(estimate) -> why its cp mode
    for base in enumerate_setups(
        spec,
        cluster.gpus,
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch_sizes=micro_batch_sizes,
        available_dims=available_dims,
        zero_stages=zero_stages,
        gpus_per_node=cluster.gpus_per_node,
        allow_cross_node_tp=allow_cross_node_tp,
        precision=precision,
        fp32_grad_accumulation=fp32_grad_accumulation,
        refused=refused,
    ):
        smallest = None
        fitting_modes: list[tuple[Estimate, StepTime]] = []
        tried: list[tuple[TrainingSetup, StepTime | None]] = []
        for variant in cp_modes(spec, base):
            found = None
            for mode in modes:
                est = estimate(spec, variant.replace(recompute=mode), gpus_per_node=cluster.gpus_per_node)
                if est.memory.total <= cluster.usable_memory_bytes:
                    found = (est, predict_step_time(est, cluster))
                    break
                if smallest is None or est.memory.total < smallest.memory.total:
                    smallest = est
            if found is not None:
                fitting_modes.append(found)
            tried.append((variant, found[1] if found else None))
        if fitting_modes:
            best = min(fitting_modes, key=lambda pair: pair[1].total)
            fitting.append(best)
            if base.cp > 1:
                others = [(v, t) for v, t in tried if v.replace(recompute=best[0].setup.recompute) != best[0].setup]
                cp_choices[id(best[0])] = _cp_choice(best, others)
        elif smallest is not None:
            unfit.append((smallest, predict_step_time(smallest, cluster)))
    if not fitting and not include_unfit:
        if not unfit:
            raise NoLayoutFitsError(
                f"no buildable layout of {cluster.gpus} GPUs for {spec.name} (global batch {global_batch}, "
                f"seq {seq_len}); check that the global batch divides by the data-parallel sizes."
            )
        best = min(unfit, key=lambda pair: pair[0].memory.total)[0]
        raise NoLayoutFitsError(
            f"no layout of {spec.name} fits in {cluster.gpu_memory_gib} GiB per GPU on {cluster.gpus} GPUs; "
            f"the smallest ({best.setup.describe()}) needs {best.memory.total / GIB:.1f} GiB "
            f"(usable {cluster.usable_memory_bytes / GIB:.1f}). Use more GPUs, a shorter sequence, or enable "
            f"more dimensions (available: {sorted(_normalize_dims(available_dims))})."
        )

    usable = cluster.usable_memory_bytes
    batch = max((est.flops.tokens_per_step for est, _ in fitting), default=None)
    ranked = sorted((Candidate(est, time, usable, batch) for est, time in fitting), key=rank_key)
    rows = [(c, True) for c in ranked]
    if include_unfit:
        by_memory = sorted(unfit, key=lambda pair: pair[0].memory.total)
        rows += [(Candidate(est, time, usable), False) for est, time in by_memory]
    entries = []
    for i, (c, fits) in enumerate(rows[:top]):  # the last row shown still says why it beats the next
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        if nxt is None:
            ahead = ""
        elif fits and not nxt[1]:
            ahead = f"fits; the next needs {nxt[0].estimate.memory.total / GIB:.1f} GiB"
        elif fits:
            ahead = why_ahead(c, nxt[0])
        else:
            ahead = f"less memory: {c.estimate.memory.total / GIB:.1f} vs {nxt[0].estimate.memory.total / GIB:.1f} GiB"
        why = _explain(c.estimate, c.time, cluster, fits, cp_choices.get(id(c.estimate), ""))
        entries.append(PlanEntry(i + 1, c.estimate, c.time, fits, why, ahead))
    return entries


def choose_layout(
    model: Any,
    world_size: int,
    *,
    available_dims: Iterable[str],
    seq_len: int | None = None,
    micro_batch_size: int = 1,
    global_batch: int | None = None,
    gpu_memory_gib: float = 80.0,
    gpus_per_node: int = 8,
    recompute: ActivationCheckpointing | str = ActivationCheckpointing.NONE,
    precision: Precision | str = Precision.BF16,
    **cluster_fields: Any,
) -> dict[str, int]:
    """Sizes + ZeRO stage for ``strategy="5d"`` with no sizes given.

    Only ``available_dims`` (e.g. ``lightning_5d.config.IMPLEMENTED_DIMS``) may be > 1, and the
    activation recomputation is the one the caller will actually run. Returns
    ``{"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "zero"}``; raises
    ``NoLayoutFitsError`` when nothing fits.
    """
    spec = load_spec(model)
    cluster = Cluster(
        gpus=world_size,
        gpu_memory_gib=gpu_memory_gib,
        gpus_per_node=min(gpus_per_node, world_size),
        **cluster_fields,
    )
    entries = plan(
        spec,
        cluster,
        seq_len=seq_len or spec.max_seq_len,
        global_batch=global_batch,
        micro_batch_sizes=(micro_batch_size,),
        available_dims=available_dims,
        recompute_modes=(recompute,),
        precision=precision,
        top=1,
    )
    return entries[0].layout()
