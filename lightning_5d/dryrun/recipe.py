"""``l5d train recipe=<name> --dry-run``: a recipe's start-up bytes per rank, next to the planner's.

The config is composed and validated as ``l5d train`` would (:func:`lightning_5d.train.validate`),
the worker's model (``LlamaLM(model)``) is cut for every class of ranks on the meta device
(:mod:`.startup`), and each class is put next to the planner's prediction for the same pieces
(:mod:`.prediction`) and against the recipe's GPU memory (its ``cluster:`` section, less the
planner's headroom): at the first step a rank holds its states (counted here) plus the
planner's activations and buffers; while materializing, its parameters plus the largest
tensor it recomputes whole. The verdict names the busiest class, the term that dominates it,
and what would shrink that term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_5d.config import ParallelConfig, ZeroStage
from lightning_5d.dryrun.holdings import CutClasses
from lightning_5d.dryrun.prediction import Prediction, predict
from lightning_5d.dryrun.startup import RankClass, rank_ranges, startup_classes
from lightning_5d.dryrun.state import StateRules

GIB = 2**30


@dataclass(frozen=True)
class ClassReport:
    rank_class: RankClass
    prediction: Prediction

    @property
    def first_step(self) -> float:
        """States (counted) + activations and buffers (the planner's), at the first optimizer step."""
        return self.rank_class.state.states + self.prediction.activations + self.prediction.buffers

    @property
    def peak(self) -> float:
        """Device bytes at start-up: the first step, or the plan verifier's check where it holds
        more (materialization holds only the parameters on the device; the tensor it recomputes
        whole is on the host)."""
        return max(self.first_step, self.rank_class.state.params, self.rank_class.state.check_peak)

    @property
    def check_dominates(self) -> bool:
        return self.rank_class.state.check_peak > self.first_step

    def terms(self) -> dict[str, float]:
        s = self.rank_class.state
        return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer,
                "activations": self.prediction.activations, "buffers": self.prediction.buffers}  # fmt: skip

    def state_diff(self) -> dict[str, float]:
        """Counted / predicted - 1, per state term."""
        s, p = self.rank_class.state, self.prediction.states
        terms = ("params", "grads", "optimizer")
        return {k: (getattr(s, k) / getattr(p, k) - 1) if getattr(p, k) else 0.0 for k in terms}


@dataclass(frozen=True)
class DryRun:
    recipe: str | None
    layout_text: str
    zero: ZeroStage
    precision: str
    gpu: str
    usable: float
    classes: tuple[ClassReport, ...]
    planner_total: float  # `l5d estimate --recipe`: the most loaded rank as the planner models it
    notes: tuple[str, ...]

    @property
    def busiest(self) -> ClassReport:
        return max(self.classes, key=lambda c: c.peak)

    @property
    def fits(self) -> bool:
        return self.busiest.peak <= self.usable

    def verdict(self) -> str:
        b = self.busiest
        head = (f"{self.recipe or 'recipe'}: busiest ranks {rank_ranges(b.rank_class.ranks)} need {b.peak / GIB:.1f} "
                f"GiB at start-up of {self.usable / GIB:.1f} GiB usable on {self.gpu}")  # fmt: skip
        if self.fits:
            return f"{head}: fits ({self.usable / GIB - b.peak / GIB:.1f} GiB to spare)."
        if b.check_dominates:
            s = b.rank_class.state
            return (f"{head}: does NOT fit; the plan verifier's check dominates (params {s.params / GIB:.1f} GiB + "
                    f"{s.check_name} unsplit in fp32, {s.check / GIB:.1f} GiB). Cut that tensor with parallel.tp "
                    f"(or parallel.pp, so fewer pieces share a rank), or set parallel.verify=off.")  # fmt: skip
        terms = b.terms()
        name, value = max(terms.items(), key=lambda kv: kv[1])
        return f"{head}: does NOT fit; {name} dominates ({value / GIB:.1f} GiB). {self._advice(name)}"

    def _advice(self, term: str) -> str:
        if term in ("params", "grads", "optimizer"):
            if self.zero < ZeroStage.PARAMETERS:
                return (f"parallel.zero={int(self.zero)} keeps whole parameters (and gradients below ZeRO-2) per "
                        f"model-parallel rank: raise parallel.zero (3 shards all three over dp_shard x cp), or cut "
                        f"the model further with parallel.tp / parallel.pp.")  # fmt: skip
            return "add ranks to shard over (parallel.dp_shard), or cut the model with parallel.tp / parallel.pp."
        if term == "activations":
            return ("set parallel.activation_checkpointing=full (or selective), raise parallel.tp with "
                    "sequence_parallel or parallel.cp, or lower data.batch_size / raise pipeline.microbatches.")
        return "see `l5d estimate --recipe` for the buffer terms (ZeRO-3 gathers, gradient buckets, cp)."

    def format(self) -> str:
        lines = [
            f"dry run     {self.recipe or ''}: {self.layout_text}, zero={int(self.zero)}, {self.precision}; "
            f"{self.gpu}, {self.usable / GIB:.1f} GiB usable",
            "            GiB per rank: states = params + grads + optimizer at the first step, counted per tensor; "
            "planner = the same pieces by lightning_5d.estimate (diff); first step = states + the planner's "
            "activations and buffers (device memory); check = params + the largest unsplit tensor in fp32, "
            "which the plan verifier holds at start-up where it runs ('-': it does not); host = the largest tensor "
            "materialization recomputes whole on the host, with its tp/ep piece (host memory per process, transient)",
            "",
            "| ranks | class | blocks | params | grads | optimizer | states | planner states (diff) | "
            "act + buf (planner) | first step | check | fits | host (largest tensor) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for c in self.classes:
            rc, s, p = c.rank_class, c.rank_class.state, c.prediction
            where = ",".join(f"{k}={v}" for k, v in rc.coords.items())
            parts = "+".join(x for x, held in (("emb", rc.first), ("head", rc.last)) if held)
            diff = (s.states / p.states.total - 1) * 100 if p.states.total else 0.0
            lines.append(
                f"| {rank_ranges(rc.ranks)} | {where}{' ' + parts if parts else ''} | {rc.blocks} | "
                f"{s.params / GIB:.2f} | {s.grads / GIB:.2f} | {s.optimizer / GIB:.2f} | {s.states / GIB:.2f} | "
                f"{p.states.total / GIB:.2f} ({diff:+.1f}%) | {(p.activations + p.buffers) / GIB:.2f} | "
                f"{c.first_step / GIB:.2f} | {f'{s.check_peak / GIB:.2f}' if s.check else '-'} | "
                f"{'yes' if c.peak <= self.usable else 'NO'} | {s.transient / GIB:.2f} "
                f"({s.transient_name}) |"
            )
        lines += ["", f"planner     l5d estimate --recipe: {self.planner_total / GIB:.1f} GiB on its most loaded rank"]
        lines += [f"note        {n}" for n in self.notes]
        lines.append(f"verdict     {self.verdict()}")
        return "\n".join(lines)


def _plain(section: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section or {})


def dry_run(cfg: Any, recipe: str | None = None, classes: CutClasses = CutClasses.STAGE) -> DryRun:
    """The dry run of a composed ``l5d train`` config (``lightning_5d.train.compose``)."""
    from lightning_5d.estimate.recipe_check import _precision, check_recipe
    from lightning_5d.estimate.training import Precision
    from lightning_5d.dimensions import rewrites_forward
    from lightning_5d.dryrun.rank_mesh import RankMesh
    from lightning_5d.models import LlamaLM
    from lightning_5d.precision import precision_plugins
    from lightning_5d.train import layout_combination, validate

    layout = validate(cfg)  # what l5d train refuses, refused here first
    check = check_recipe(cfg, recipe=recipe, validate=False)
    parallel = ParallelConfig.from_mapping(_plain(cfg.parallel))
    options = _plain(cfg.get("precision_options"))
    combination = layout_combination(cfg, parallel, layout)
    # Where a dimension rewrites the forward (the strategy's own steps decide, with the worker's
    # precision plugin), setup checks the plan.
    _, plugins = precision_plugins(cfg.precision, options)
    rewrites = rewrites_forward(parallel, RankMesh(layout, 0), plugins[0] if plugins else None, combination)
    rules = StateRules(
        zero=parallel.zero,
        low_precision_params=_precision(cfg.precision) != Precision.FP32,
        fp32_accumulation=options.get("accumulation_dtype") == "fp32",
        plan_check=parallel.checks_plan(rewrites),
    )
    model = _plain(cfg.model)
    found = startup_classes(lambda: LlamaLM(model), parallel, layout, combination, rules, classes, rewrites)
    spec, setup = check.spec, check.setup
    modelled = spec.replace(num_layers=check.modelled_layers)
    reports = tuple(ClassReport(c, predict(spec, setup, c.blocks, c.first, c.last, modelled)) for c in found)
    notes = [n for n in check.notes if not n.startswith("attention as")]
    notes += [f"planner: {p}" for p in check.problems]  # e.g. MoE with tp > 1: its diff above comes from this
    if setup.cp > 1 or parallel.activation_checkpointing.value != "none":
        notes.append("cp and activation checkpointing change no parameter: the dry run does not apply them")
    return DryRun(
        recipe=check.recipe,
        layout_text=layout.describe(),
        zero=parallel.zero,
        precision=str(cfg.precision),
        gpu=str(_plain(cfg.get("cluster")).get("gpu") or f"a {check.cluster.gpu_memory_gib:g} GiB GPU"),
        usable=check.cluster.usable_memory_bytes,
        classes=reports,
        planner_total=check.memory_bytes,
        notes=tuple(notes),
    )


def main(overrides: list[str]) -> int:
    """``l5d train <overrides> --dry-run``: print the table and verdict; exit 0 if it fits, 1 if not,
    2 for a config ``l5d train`` would refuse."""
    import sys

    from lightning_5d.config import LayoutError
    from lightning_5d.train import ConfigError, compose

    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        print(f"l5d train --dry-run: takes key=value overrides only, not {flags}; dry-run one job at a time "
              f"(e.g. l5d train recipe=llama3_70b_64gpu parallel.pp=8 --dry-run).", file=sys.stderr)  # fmt: skip
        return 2
    try:
        cfg = compose(overrides, return_hydra_config=True)
        report = dry_run(cfg)
    except (LayoutError, ConfigError) as err:
        print(f"l5d train: invalid config: {err}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.fits else 1
