"""One comparison table for an ``l5d train -m`` sweep: measured tokens/s and memory per layout, and the planner's view.

After a multirun, :class:`SweepTable` (a Hydra callback, registered in ``conf/config.yaml``) reads
every job directory of the sweep and writes ``sweep.md`` and ``sweep.json`` next to them, then
prints the table. One row per job, fastest measured first:

* the layout (sizes, ZeRO stage, sequence parallelism, pipeline schedule) as the job resolved it;
* what ``summary.json`` recorded (:mod:`lightning_5d.report`): tokens/s, the largest model state
  and peak RSS over the ranks, final loss;
* the planner's prediction for that exact layout (``l5d estimate --recipe``'s number) and where the
  layout stands in the planner's ranking of every layout of the same model and world
  (``l5d plan``); the planner's top choice is marked, or named under the table when the grid
  does not hold it;
* a job that did not finish is a row with its status and error: ``refused`` when ``l5d train``
  rejected the layout before starting any worker, ``failed`` when the workers failed.

Rebuild the table of an existing sweep with ``python -m lightning_5d.sweep_table <sweep dir>``.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

TABLE_MD = "sweep.md"
TABLE_JSON = "sweep.json"
ERROR_NAME = "error.txt"  # written by the callback for a job that raised; the table reads it back
SUMMARY_NAME = "summary.json"  # lightning_5d.train.SUMMARY_NAME; not imported, so this module stays light
RESOLVED_NAME = "resolved.yaml"  # lightning_5d.train.RESOLVED_NAME
PLAN_MARK = "← plan's choice"


@dataclass
class Row:
    """One job of the sweep."""

    job: int
    label: str  # the overrides that differ between the jobs, e.g. "layout=tp2_sp"
    status: str  # ok | refused | failed | missing
    error: str = ""
    sizes: dict[str, Any] = field(default_factory=dict)  # dp_replicate dp_shard tp cp pp ep: ints, or "auto"/"?"
    zero: Optional[int] = None
    sp: bool = False
    schedule: str = ""  # "1f1b m=4", "interleaved_1f1b v=2 m=4"; empty without pp
    tokens_per_s: Optional[float] = None
    model_state_mib: Optional[float] = None
    peak_rss_mib: Optional[float] = None
    peak_accel_mib: Optional[float] = None
    loss: Optional[float] = None
    steps: Optional[int] = None
    tokens_per_step: Optional[int] = None  # sequences per data rank x data ranks x seq_len: differs per layout
    predicted_tokens_per_s: Optional[float] = None
    plan_rank: Optional[int] = None  # the layout's place in the planner's ranking (best variant); None: not ranked
    plan_choice: bool = False
    layout_key: Optional[tuple] = None  # comparable with the planner's layouts; None when unresolved


# --------------------------------------------------------------------------- reading the sweep


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every directory under ``sweep_dir`` Hydra ran a job in (it holds ``.hydra/config.yaml``)."""
    return sorted(p.parent.parent for p in Path(sweep_dir).rglob(".hydra/config.yaml") if p.parent.parent != sweep_dir)


def _load_yaml(path: Path) -> Optional[DictConfig]:
    try:
        return OmegaConf.load(path)
    except (OSError, ValueError):
        return None


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def layout_key(sizes: dict[str, int], zero: int, sp: bool, schedule: Optional[str], v: int) -> tuple:
    """What makes two layouts the same run, with the settings that mean nothing dropped.

    ZeRO shards over dp_shard x cp: without that group every stage is plain replication. Sequence
    parallelism needs tp, the schedule needs pp.
    """
    zero = int(zero) if sizes["dp_shard"] * sizes["cp"] > 1 else 0
    return (
        tuple(sizes[d] for d in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")),
        zero,
        bool(sp) and sizes["tp"] > 1,
        (str(schedule), int(v)) if sizes["pp"] > 1 else None,
    )


def _job_layout(cfg: DictConfig, row: Row) -> None:
    """Fill the row's layout columns from the job's config (the raw sizes when they do not resolve)."""
    from lightning_5d.config import LayoutError, ParallelConfig

    raw = _plain(cfg.get("parallel")) or {}
    dims = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
    row.sizes = {d: raw.get(d, "?") for d in dims}
    row.zero = raw.get("zero")
    row.sp = bool(raw.get("sequence_parallel"))
    pipe_raw = raw.get("pipeline") or {}
    if raw.get("pp") not in (1, None):
        row.schedule = str(pipe_raw.get("schedule", ""))
    try:
        parallel = ParallelConfig.from_mapping(raw)
        resolved = parallel.resolve(int(cfg.devices) * int(cfg.num_nodes))
    except (LayoutError, TypeError, ValueError, KeyError):
        return  # a refused layout: the table shows what the job asked for
    row.sizes = {d: getattr(resolved, d) for d in dims}
    row.zero = int(parallel.zero)
    pipe = parallel.pipeline
    if resolved.pp > 1:
        from lightning_5d.pipeline_shape import default_microbatches

        v = pipe.virtual_stages
        m = pipe.microbatches or default_microbatches(resolved.pp, v)
        row.schedule = f"{pipe.schedule.value}{f' v={v}' if v > 1 else ''} m={m}"
    row.layout_key = layout_key(row.sizes, row.zero, row.sp, pipe.schedule.value, pipe.virtual_stages)


def read_job(job_dir: Path) -> tuple[Row, Optional[DictConfig], dict]:
    """The row for one job directory, its composed config, and Hydra's record of the job."""
    hydra_cfg = _load_yaml(job_dir / ".hydra" / "hydra.yaml")
    hydra_node = hydra_cfg.hydra if hydra_cfg is not None and "hydra" in hydra_cfg else OmegaConf.create({})
    meta = {
        "overrides": [str(o) for o in (OmegaConf.select(hydra_node, "overrides.task") or [])],
        "choices": dict(OmegaConf.select(hydra_node, "runtime.choices") or {}),
    }
    num = OmegaConf.select(hydra_node, "job.num")
    if num is None:
        num = int(job_dir.name) if job_dir.name.isdigit() else -1
    row = Row(job=int(num), label="", status="missing")
    cfg = _load_yaml(job_dir / ".hydra" / "config.yaml")
    if cfg is not None:
        _job_layout(cfg, row)
    summary_path, error_path = job_dir / SUMMARY_NAME, job_dir / ERROR_NAME
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        row.status = "ok"
        row.tokens_per_s = summary.get("tokens_per_s")
        row.model_state_mib = summary.get("model_state_mib_max")
        row.peak_rss_mib = summary.get("peak_rss_mib_max")
        accel = [r.get("peak_accel", 0) for r in summary.get("memory", [])]
        row.peak_accel_mib = max(accel) / 2**20 if any(accel) else None
        row.loss = summary.get("loss")
        row.steps = summary.get("steps")
        row.tokens_per_step = summary.get("tokens_per_step")
    elif error_path.is_file():
        # l5d train writes resolved.yaml only after the layout passed its checks.
        row.status = "failed" if (job_dir / RESOLVED_NAME).is_file() else "refused"
        row.error = error_path.read_text().strip()
    return row, cfg, meta


def _labels(metas: list[dict]) -> list[str]:
    """Per job, the overrides whose value is not the same in every job: what the sweep varied."""
    parsed = [dict(o.split("=", 1) if "=" in o else (o, "") for o in m["overrides"]) for m in metas]
    keys = sorted({k for p in parsed for k in p})
    varied = [k for k in keys if len({p.get(k) for p in parsed}) > 1] or keys
    return [" ".join(f"{k}={p[k]}" for k in varied if k in p) for p in parsed]


# --------------------------------------------------------------------------- the planner's view


@dataclass
class PlanView:
    """The planner's ranking for one model and world, as ``l5d plan`` would print it."""

    world: int
    description: str  # the planner's inputs, in words
    entries: list = field(default_factory=list)  # lightning_5d.estimate.search.PlanEntry, fastest first
    error: str = ""

    def rank_of(self, key: Optional[tuple]) -> Optional[int]:
        for entry in self.entries:
            if key is not None and _entry_key(entry) == key:
                return entry.rank
        return None

    @property
    def choice(self) -> Optional[str]:
        return self.entries[0].setup.describe() if self.entries else None


def _entry_key(entry: Any) -> tuple:
    s = entry.setup
    sizes = {d: getattr(s, d) for d in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")}
    return layout_key(sizes, int(s.zero), s.sequence_parallel, s.schedule.value, s.virtual_stages)


def plan_for(cfg: DictConfig, model_name: str) -> PlanView:
    """Every layout the planner ranks for ``cfg``'s model, world, sequence length and precision.

    The global batch is the one the job would have with every rank a data rank (``data.batch_size``
    sequences per rank): the planner compares layouts at one fixed batch, the runs each keep
    ``batch_size`` per data rank. The hardware is the recipe's ``cluster:`` section, else what
    ``l5d estimate --recipe`` assumes (H100-class GPUs, ``devices`` per node).
    """
    from lightning_5d.config import IMPLEMENTED_DIMS
    from lightning_5d.estimate.recipe_check import _precision, cluster_for, spec_from_recipe
    from lightning_5d.estimate.search import plan

    world = int(cfg.devices) * int(cfg.num_nodes)
    seq_len = int(cfg.data.seq_len)
    accumulate = int(OmegaConf.select(cfg, "trainer.accumulate_grad_batches", default=1) or 1)
    global_batch = int(cfg.data.batch_size) * world * accumulate
    precision = _precision(cfg.precision)
    view = PlanView(world=world, description="")
    try:
        cluster = cluster_for(cfg)
        view.description = (
            f"{model_name} on {world} ranks ({cluster.gpus_per_node} per node, peak "
            f"{cluster.peak_flops / 1e12:g} TFLOP/s, {cluster.gpu_memory_gib:g} GiB each), seq {seq_len}, "
            f"global batch {global_batch}, {precision.value}"
        )
        spec = spec_from_recipe(cfg, name=model_name)
        view.entries = plan(
            spec, cluster, seq_len=seq_len, global_batch=global_batch, precision=precision,
            available_dims=IMPLEMENTED_DIMS,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the measured table stands without the planner's view
        view.error = f"{type(err).__name__}: {err}"
    return view


def predicted_tokens_per_s(cfg: DictConfig) -> Optional[float]:
    """The planner's tokens/s for the job's own layout and batch (``l5d estimate --recipe``), or None."""
    from lightning_5d.estimate.recipe_check import check_recipe

    try:
        return check_recipe(cfg, validate=False).tokens_per_second
    except Exception:  # noqa: BLE001 - a refused layout has no prediction; the row stays
        return None


def _plan_inputs(cfg: DictConfig) -> str:
    """Jobs with equal values here share one planner ranking."""
    keys = ("model", "devices", "num_nodes", "data.seq_len", "data.batch_size", "precision", "cluster")
    return json.dumps({k: _plain(OmegaConf.select(cfg, k)) for k in keys}, sort_keys=True, default=str)


# --------------------------------------------------------------------------- the table


@dataclass
class Sweep:
    sweep_dir: Path
    rows: list[Row]  # fastest measured first, then the jobs that did not finish
    plans: list[PlanView]

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            d.pop("layout_key")
            rows.append(d)
        plans = [
            {
                "world": p.world,
                "inputs": p.description,
                "choice": p.choice,
                "error": p.error,
                "top": [e.to_dict() for e in p.entries[:10]],
            }
            for p in self.plans
        ]
        return {"sweep_dir": str(self.sweep_dir), "rows": rows, "plans": plans}


def build(sweep_dir: str | Path, with_plan: bool = True) -> Sweep:
    """Read every job of ``sweep_dir``; rank by measured tokens/s; add the planner's view."""
    sweep_dir = Path(sweep_dir)
    found = [read_job(d) for d in job_dirs(sweep_dir)]
    for (row, _, _), label in zip(found, _labels([meta for _, _, meta in found])):
        row.label = label
    plans: dict[str, PlanView] = {}
    if with_plan:
        for row, cfg, meta in found:
            if cfg is None:
                continue
            row.predicted_tokens_per_s = predicted_tokens_per_s(cfg)
            key = _plan_inputs(cfg)
            if key not in plans:
                plans[key] = plan_for(cfg, str(meta["choices"].get("model") or "model"))
            view = plans[key]
            row.plan_rank = view.rank_of(row.layout_key)
            row.plan_choice = row.plan_rank == 1
    rows = sorted(
        (row for row, _, _ in found),
        key=lambda r: (r.tokens_per_s is None, -(r.tokens_per_s or 0.0), r.job),
    )
    return Sweep(sweep_dir=sweep_dir, rows=rows, plans=list(plans.values()))


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pairs_in_same_order(rows: list[Row]) -> tuple[int, int]:
    """Pairs of measured rows whose measured and predicted tokens/s order agree, of all such pairs."""
    both = [r for r in rows if r.tokens_per_s is not None and r.predicted_tokens_per_s is not None]
    agree = total = 0
    for i, a in enumerate(both):
        for b in both[i + 1 :]:
            total += 1
            agree += (a.tokens_per_s - b.tokens_per_s) * (a.predicted_tokens_per_s - b.predicted_tokens_per_s) > 0
    return agree, total


def format_markdown(sweep: Sweep) -> str:
    rows = sweep.rows
    accel = any(r.peak_accel_mib for r in rows)
    head = ["#", "job", "dp_rep", "dp_shard", "zero", "tp", "sp", "cp", "pp", "schedule", "ep", "tokens/step",
            "tokens/s", "model state MiB/rank", "peak RSS MiB"] + (["peak accel MiB"] if accel else []) + [
            "loss", "predicted tokens/s", "plan rank", "status"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for place, r in enumerate(rows, 1):
        measured = r.tokens_per_s is not None
        plan_rank = "-" if r.plan_rank is None else str(r.plan_rank)
        status = r.status if not r.error else f"{r.status}: {_one_line(r.error)}"
        cells = [
            str(place) if measured else "-",
            f"{r.job} {r.label}".strip(),
            *(str(r.sizes.get(d, "?")) for d in ("dp_replicate", "dp_shard")),
            "-" if r.zero is None else str(r.zero),
            str(r.sizes.get("tp", "?")),
            "sp" if r.sp and r.sizes.get("tp") not in (1, "1") else "",
            *(str(r.sizes.get(d, "?")) for d in ("cp", "pp")),
            r.schedule,
            str(r.sizes.get("ep", "?")),
            _num(r.tokens_per_step, ",d"),
            _num(r.tokens_per_s, ",.0f"),
            _num(r.model_state_mib, ".2f"),
            _num(r.peak_rss_mib, ",.0f"),
            *([_num(r.peak_accel_mib, ",.0f")] if accel else []),
            _num(r.loss, ".4f"),
            _num(r.predicted_tokens_per_s, ",.0f"),
            f"{plan_rank} {PLAN_MARK}" if r.plan_choice else plan_rank,
            status,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += _notes(sweep)
    return "\n".join(lines) + "\n"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _notes(sweep: Sweep) -> list[str]:
    rows = sweep.rows
    lines = [f"Ranked by measured tokens/s (steps after the first); model state and peak RSS are the largest over "
             f"the ranks; every data rank reads its own batch, so tokens/step (and the loss) follow the number "
             f"of data ranks. {len(rows)} jobs in {sweep.sweep_dir}."]  # fmt: skip
    for view in sweep.plans:
        if view.error:
            lines.append(f"Planner ({view.description or f'{view.world} ranks'}): no ranking: {view.error}")
            continue
        marked = [r for r in rows if r.plan_choice and r.plan_rank is not None]
        measured = [r for r in rows if r.tokens_per_s is not None]
        if marked:
            where = ", ".join(
                f"job {r.job} ({r.label}), measured #{measured.index(r) + 1} of {len(measured)}"
                if r in measured
                else f"job {r.job} ({r.label}), {r.status}"
                for r in marked
            )
            lines.append(f"Planner's top choice (`l5d plan` for {view.description}): {view.choice}: {where}.")
        else:
            lines.append(f"Planner's top choice (`l5d plan` for {view.description}): {view.choice}: not in this grid.")
    agree, total = _pairs_in_same_order(rows)
    if total:
        lines.append(
            f"Predicted tokens/s: the planner's step-time model for each row's own layout and batch on that "
            f"hardware, so compare the order, not the values: {agree} of {total} pairs of measured rows are in "
            f"the same order. Plan rank: the layout's place in the planner's ranking of every layout it tries "
            f"(-: one it does not try, e.g. tp without sp)."
        )
    return [line + "\n" for line in lines]


def write(sweep: Sweep) -> str:
    """Write ``sweep.md`` and ``sweep.json`` into the sweep directory; return the Markdown."""
    text = format_markdown(sweep)
    for name, content in ((TABLE_MD, text), (TABLE_JSON, json.dumps(sweep.to_dict(), indent=2, default=str) + "\n")):
        path = sweep.sweep_dir / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(content, encoding="utf-8")
        tmp.replace(path)
    return text


# --------------------------------------------------------------------------- the Hydra callback


def expected_jobs(config: DictConfig) -> Optional[int]:
    """How many jobs the basic sweeper will run for this multirun config; None for other sweepers."""
    target = str(OmegaConf.select(config, "hydra.sweeper._target_") or "")
    if not target.endswith("BasicSweeper"):
        return None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = OmegaConf.select(config, "hydra.sweeper.params") or {}
        arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
        overrides = OverridesParser.create().parse_overrides(arguments)
        return sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, None))
    except Exception:  # noqa: BLE001 - a private Hydra API; without the count the table waits for the end
        return None


class SweepTable(Callback):
    """Write and print the sweep's comparison table once its last job has ended.

    Hydra's basic sweeper raises the first failed job's error after the batch, before
    ``on_multirun_end``; so the table is written after the last job (counted from the sweep's
    overrides), which includes failed ones as rows, and ``on_multirun_end`` covers sweepers whose
    jobs cannot be counted. Single runs are left alone.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._expected: Optional[int] = None
        self._ended = 0
        self._written = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._expected = expected_jobs(config) if self.enabled else None
        self._ended = 0
        self._written = False

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if not self.enabled or OmegaConf.select(config, "hydra.mode") not in (RunMode.MULTIRUN, "MULTIRUN"):
            return
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value  # what Hydra re-raises after the batch
            out = Path(str(config.hydra.runtime.output_dir)) / ERROR_NAME
            out.write_text(f"{type(error).__name__}: {error}\n", encoding="utf-8")
        self._ended += 1
        if self._expected is not None and self._ended >= self._expected:
            self._write(Path(str(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.enabled and not self._written:
            self._write(Path(str(config.hydra.sweep.dir)))

    def _write(self, sweep_dir: Path) -> None:
        self._written = True
        try:
            text = write(build(sweep_dir))
        except Exception as err:  # noqa: BLE001 - a table problem must not turn a finished sweep into a failure
            log.warning("could not write the sweep table for %s: %s", sweep_dir, err)
            return
        print(f"\n[l5d] sweep table ({sweep_dir / TABLE_MD}):\n{text}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m lightning_5d.sweep_table <sweep dir>  (writes sweep.md and sweep.json there)")
        return 2
    print(write(build(argv[0])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
