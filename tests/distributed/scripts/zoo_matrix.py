"""The zoo matrix: every zoo model (tests/zoo) under every layout, against one process.

    python tests/distributed/scripts/zoo_matrix.py --out outputs/zoo_matrix [--models a,b] [--layouts tp2,pp2]
    python tests/distributed/scripts/zoo_matrix_table.py outputs/zoo_matrix docs/layout_matrix.md

A cell trains ``STEPS`` steps in fp32 (fp8: FiveDPrecision tensorwise) and is judged against
one process training the same module from the same seed on the same global batches:

- **pass**: every step's loss within 1e-5 relative and the final parameter vector within
  1e-5 relative (fp8: every step's loss within 1e-2 of the fp32 process, the precision
  tests' per-step tolerance; FP8 rounds each GEMM operand to 3 mantissa bits);
- **refused**: lightning_5d raised one of its own errors (the first line is recorded); when
  the message carries a ``model_plan`` snippet, the cell is run again with it and the advice
  gets a status of its own;
- **wrong loss**: it trained, but the losses or parameters differ (the numbers are recorded;
  each is run once more alone in fresh processes to rule out a previous cell's leftovers);
- **crash**: any other exception, or no result within the cell limit (a hang).

Cells of one process count run in one set of processes (zoo_cells.py); a crash ends that set
and the next cell starts a new one, so a crash costs one process start.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the zoo package
import zoo  # noqa: E402
from tests_support import SCRIPTS, parameter_vector_error  # noqa: E402

STEPS = 3
BATCH_SIZE = 2  # sequences of 32 tokens per data rank (2 microbatches under pp)
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
FP8_LOSS_RTOL = 1e-2  # tests/distributed/test_precision.py's STEP_RTOL
# layout name -> (processes, FiveDStrategy options); zero=1 unless named
LAYOUTS: dict[str, tuple[int, dict]] = {
    "zero3": (2, {"zero": 3}),
    "tp2": (2, {"tp": 2}),
    "tp2+sp": (2, {"tp": 2, "sp": True}),
    "cp2": (2, {"cp": 2}),
    "pp2": (2, {"pp": 2}),
    "fp8": (2, {"precision": "fp8-tensorwise"}),
    "tp2 x pp2": (4, {"tp": 2, "pp": 2}),
    "tp2+sp x cp2 x pp2": (8, {"tp": 2, "sp": True, "cp": 2, "pp": 2}),
    "pp2 x zero3": (4, {"pp": 2, "zero": 3}),
    # tp2 x pp2 x ZeRO-3 over dp2: where the plan verifier's gradient check left a stage's units
    # gathered and the optimizer trained their unsharded copies (moduledict_layers, fixed).
    "tp2 x pp2 x zero3": (8, {"tp": 2, "pp": 2, "zero": 3}),
}
# The same module built on the meta device (``trainer.init_module(empty_init=True)``): every
# dimension cuts the meta model and each rank materializes only its pieces, replaying the
# module's own initialization; judged against the same eager one-process run as every cell.
META_LAYOUTS: dict[str, tuple[int, dict]] = {
    "zero3 (meta)": (2, {"zero": 3, "build": "meta"}),
    "tp2+sp (meta)": (2, {"tp": 2, "sp": True, "build": "meta"}),
    "cp2 (meta)": (2, {"cp": 2, "build": "meta"}),
    "pp2 (meta)": (2, {"pp": 2, "build": "meta"}),
    "tp2 x pp2 x zero3 (meta)": (8, {"tp": 2, "pp": 2, "zero": 3, "build": "meta"}),
}
LAYOUTS.update(META_LAYOUTS)
DEFAULTS = dict(tp=1, sp=False, cp=1, pp=1, zero=1, precision="32-true", batch_size=BATCH_SIZE, steps=STEPS,
                build="eager")  # fmt: skip
STATUSES = ("pass", "refused", "wrong loss", "crash")


def make_cell(model: str, layout: str) -> dict:
    nproc, options = LAYOUTS[layout]
    cell_id = f"{model}__{re.sub(r'[ ()]', '', layout).replace('+', 'p')}"
    return {**DEFAULTS, **options, "model": model, "layout": layout, "nproc": nproc, "id": cell_id,
            "heads": list(zoo.HEADS[model])}  # fmt: skip


VARIANT_LAYOUTS = ("cp2", "tp2+sp x cp2 x pp2")  # the variants follow cp's advice (zoo/variants.py)
MATRIX = [make_cell(model, layout) for layout in LAYOUTS for model in zoo.MODELS]
MATRIX += [make_cell(model, layout) for layout in VARIANT_LAYOUTS for model in zoo.VARIANTS]
BY_ID = {cell["id"]: cell for cell in MATRIX}


def data_ranks(cell: dict) -> int:
    return cell["nproc"] // (cell["tp"] * cell["cp"] * cell["pp"])


@functools.lru_cache(maxsize=None)
def reference(model: str, ranks: int, steps: int = STEPS, batch_size: int = BATCH_SIZE):
    """One process, fp32: the same seed, module and global batches as ``ranks`` data ranks see.

    Lightning's DistributedSampler (shuffle, seed 0, epoch 0) gives data rank r every
    ranks-th index of one permutation, so the union of the k-th batches is a slice of it."""
    import lightning as L
    from torch.utils.data import default_collate

    from tests_support import make_datamodule

    L.seed_everything(0, verbose=False)
    module = zoo.build(model)
    dm = make_datamodule(batch_size=batch_size)
    dm.setup("fit")
    optimizer = module.configure_optimizers()
    perm = torch.randperm(len(dm.train_dataset), generator=torch.Generator().manual_seed(0)).tolist()
    size, losses = batch_size * ranks, []
    for step in range(steps):
        optimizer.zero_grad()
        batch = default_collate([dm.train_dataset[i] for i in perm[step * size : (step + 1) * size]])
        loss = module.compute_loss(batch)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------- errors


def is_refusal(error: BaseException) -> bool:
    """An error lightning_5d raises on purpose (LayoutError, ModelMappingError, ...), not one from torch."""
    return any(cls.__module__.startswith("lightning_5d") for cls in type(error).__mro__[:-1])


def cause(error: BaseException) -> str | None:
    """The innermost exception of the chain (torch's pipeline stage re-raises a model's error
    with a message of its own), or None when ``error`` is it."""
    root = error
    for _ in range(20):  # bounded: a chain, never a cycle
        inner = root.__cause__ or root.__context__
        if inner is None:
            break
        root = inner
    return None if root is error else f"{type(root).__name__}: {root}"


def advice_plan(message: str, heads: list[int]) -> dict | None:
    """The ``parallel.model_plan:`` snippet of a refusal as a dict, or None (no snippet).

    Commented-out lines are left out (the message marks them optional). ``<num_heads>`` and
    ``<num_kv_heads>`` are filled in with the model's head counts, as its author would; any
    other ``<placeholder>`` stays, and the caller does not try such a plan.
    """
    message = message.replace("<num_heads>", str(heads[0])).replace("<num_kv_heads>", str(heads[1]))
    if "model_plan:" not in message:
        return _inline_advice(message, heads)
    plan = {}
    for line in message.split("model_plan:", 1)[1].splitlines()[1:]:
        match = re.match(r'^\s+"([^"]+)":\s*(.+?)\s*$', line)
        if match is None:
            if line.strip().startswith("#"):
                continue
            break
        plan[match.group(1)] = match.group(2)
    return plan or None


def _inline_advice(message: str, heads: list[int]) -> dict | None:
    """A ``model_plan={...}`` dict written inline (tp's missing head count), with ``<N>`` filled
    in and, for grouped-query attention, ``kv_heads=<K>`` added as the message says to."""
    match = re.search(r"model_plan=(\{[^{}]*\})", message)
    if match is None:
        return None
    try:
        plan = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return None
    kv = f", kv_heads={heads[1]}" if heads[1] != heads[0] and "kv_heads=<K>" in message else ""
    return {k: v.replace("heads=<N>)", f"heads={heads[0]}{kv})") for k, v in plan.items()}


# ---------------------------------------------------------------------------------- running


def _crash_record(where: Path, output: str, timed_out: bool) -> dict:
    """What the ranks left in ``where`` when the processes ended without a result."""
    errors = sorted(where.glob("error_rank*.json"), key=lambda p: p.stat().st_mtime)
    hangs = sorted(where.glob("hang_rank*.txt"))
    record: dict = {"crash": None, "hung_ranks": [p.stem.removeprefix("hang_rank") for p in hangs]}
    if errors:
        first = json.loads(errors[0].read_text())  # the first rank to fail; the others often fail after it
        record.update(crash=f"{first['type']}: {first['message']}", cause=first.get("cause"), traceback=first["traceback"],
                      rank=errors[0].stem.removeprefix("error_rank"))  # fmt: skip
    elif hangs:
        record["crash"] = f"hang: {hangs[0].read_text().strip()} (ranks {', '.join(record['hung_ranks'])})"
    else:
        what = "the launch timed out" if timed_out else "the processes ended without an error record"
        record["crash"] = f"{what}; output tail: {output[-1500:]}"
    return record


def run_cells(cells: list[dict], root: Path, cell_limit: float = 90.0) -> None:
    """Train ``cells`` (skipping those already done in ``root``): one set of processes per
    process count, a new one after each crash. Each cell ends with ``result.json`` or ``crash.json``."""
    from tests_support import run_distributed  # ranks forked from a preloaded interpreter

    def done(cell, sub=""):
        where = root / cell["id"] / sub
        return (where / "result.json").exists() or (where / "crash.json").exists()

    for nproc in sorted({c["nproc"] for c in cells}):
        pending = [c for c in cells if c["nproc"] == nproc and not done(c)]
        while pending:
            listing = root / f"cells_{pending[0]['id']}.json"
            listing.write_text(json.dumps(pending))
            limit = cell_limit * max(1, nproc // 2)
            run = run_distributed(SCRIPTS / "zoo_cells.py", nproc,
                                  ["--cells", str(listing), "--out", str(root), "--cell-limit", str(limit)],
                                  timeout=120 + 2 * limit * len(pending))  # fmt: skip
            (root / f"output_{pending[0]['id']}.txt").write_text(run.output)
            left = [c for c in pending if not done(c)]
            if left:  # the first cell without a result ended the processes (itself or its advice run)
                where = root / left[0]["id"]
                where.mkdir(parents=True, exist_ok=True)
                if (where / "result.json").exists() and not done(left[0], "advice"):
                    where = where / "advice"
                    where.mkdir(exist_ok=True)
                (where / "crash.json").write_text(json.dumps(_crash_record(where, run.output, run.timed_out), indent=1))
                if not done(left[0]):  # the advice crashed: the cell itself had its result
                    (root / left[0]["id"] / "crash.json").write_text((where / "crash.json").read_text())
            pending = [c for c in pending if not done(c)]


# ---------------------------------------------------------------------------------- judging


def first_line(text: str) -> str:
    """The message's first line (with the next one where the first only introduces it)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"[:300]
    return lines[0][:300] if lines else ""


def crash_reason(record: dict) -> str:
    """The innermost error first: torch's pipeline stage re-raises a model's error as its own."""
    if record.get("cause"):
        return f"{first_line(record['cause'])} (raised as {first_line(record['crash'])})"[:400]
    return first_line(record["crash"])


def judge(cell: dict, where: Path) -> dict:
    """The outcome of one run (the cell or its advice) in ``where``."""
    if (where / "crash.json").exists() and not (where / "result.json").exists():
        crash = json.loads((where / "crash.json").read_text())
        return {"status": "crash", "reason": crash_reason(crash), "message": crash["crash"][:3000]}
    result = json.loads((where / "result.json").read_text())
    if "refused" in result:
        outcome = {"status": "refused", "reason": first_line(result["refused"]), "message": result["refused"][:3000],
                   "steps_run": result["steps_run"]}  # fmt: skip
        if (where / "advice").exists():
            outcome["advice"] = judge(cell, where / "advice")
            plan = json.loads((where / "advice" / "result.json").read_text()).get("model_plan") \
                if (where / "advice" / "result.json").exists() else None
            outcome["advice"]["model_plan"] = plan
        elif "model_plan:" in result["refused"]:
            outcome["advice"] = {"status": "not tried", "reason": "the suggested model_plan has <placeholders>"}
        return outcome
    ref_losses, ref_params = reference(cell["model"], data_ranks(cell))
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    ref = torch.tensor(ref_losses, dtype=torch.float64)
    outcome = {"losses": result["losses"], "ref_losses": ref_losses, "seconds": result["seconds"]}
    if len(losses) != len(ref):
        return {**outcome, "status": "wrong loss", "reason": f"{len(losses)} losses recorded for {len(ref)} steps"}
    outcome["loss_error"] = float(((losses - ref).abs() / ref.abs()).max())
    params = torch.load(where / "params.pt")
    if params.keys() != ref_params.keys():
        missing, extra = sorted(ref_params.keys() - params.keys()), sorted(params.keys() - ref_params.keys())
        outcome["param_error"] = None
        return {**outcome, "status": "wrong loss", "reason": f"final parameters named differently: missing "
                f"{missing[:4]}, unexpected {extra[:4]}"}  # fmt: skip
    outcome["param_error"] = parameter_vector_error(params, ref_params)
    fp8 = cell["precision"].startswith("fp8")
    ok = outcome["loss_error"] <= (FP8_LOSS_RTOL if fp8 else LOSS_RTOL)
    ok = ok and (fp8 or outcome["param_error"] <= PARAM_RTOL)
    if ok:
        return {**outcome, "status": "pass"}
    loss_ok = outcome["loss_error"] <= LOSS_RTOL
    loss = f"loss {'within 1e-5' if loss_ok else 'off'} ({outcome['loss_error']:.1e} relative; first step " \
        f"{result['losses'][0]:.6f} vs {ref_losses[0]:.6f})"
    params = f"final parameters off by {outcome['param_error']:.1e}"
    return {**outcome, "status": "wrong loss", "reason": f"{params}, {loss}" if loss_ok else f"{loss}, {params}"}


def outcome_of(cell: dict, root: Path) -> dict:
    """The cell's outcome, with its fresh-process rerun where it trained with a wrong loss."""
    outcome = judge(cell, root / cell["id"])
    confirm = root / "confirm" / cell["id"]
    if outcome["status"] == "wrong loss" and confirm.exists():
        again = judge(cell, confirm)
        outcome["confirmed"] = again["status"] == "wrong loss" and again.get("losses") == outcome.get("losses")
        outcome["rerun"] = {k: again.get(k) for k in ("status", "reason", "losses")}
    keys = ("model", "layout", "nproc", "tp", "sp", "cp", "pp", "zero", "precision", "build")
    return {**{k: cell[k] for k in keys}, "id": cell["id"], **outcome}


def confirm_wrong_losses(cells: list[dict], root: Path) -> None:
    """Run each wrong-loss cell alone in fresh processes (a leftover of an earlier cell would vanish)."""
    for cell in cells:
        if judge(cell, root / cell["id"])["status"] == "wrong loss":
            (root / "confirm").mkdir(exist_ok=True)
            run_cells([cell], root / "confirm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (a rerun resumes it)")
    parser.add_argument("--models", default=",".join([*zoo.MODELS, *zoo.VARIANTS]))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of: {', '.join(LAYOUTS)}")
    parser.add_argument("--cell-limit", type=float, default=90.0, help="seconds per cell at 2 processes before "
                        "it counts as hung (scaled with the process count)")  # fmt: skip
    args = parser.parse_args()
    models, layouts = args.models.split(","), args.layouts.split(",")
    unknown = [m for m in models if m not in {**zoo.MODELS, **zoo.VARIANTS}]
    unknown += [lay for lay in layouts if lay not in LAYOUTS]
    if unknown:
        parser.error(f"unknown model or layout: {unknown}")
    cells = [c for c in MATRIX if c["model"] in models and c["layout"] in layouts]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run_cells(cells, args.out, args.cell_limit)
    write_outcomes(cells, args.out, (time.perf_counter() - start) / 60, confirmed=False)
    confirm_wrong_losses(cells, args.out)
    write_outcomes(cells, args.out, (time.perf_counter() - start) / 60, confirmed=True)


def write_outcomes(cells: list[dict], root: Path, minutes: float, confirmed: bool) -> None:
    """``root/outcomes/<cell id>.json`` for zoo_matrix_table.py, and a summary on stdout."""
    outcomes = root / "outcomes"
    outcomes.mkdir(exist_ok=True)
    counts = dict.fromkeys(STATUSES, 0)
    for cell in cells:
        outcome = outcome_of(cell, root)
        (outcomes / f"{cell['id']}.json").write_text(json.dumps(outcome, indent=1))
        counts[outcome["status"]] += 1
        if confirmed:
            print(f"{cell['model']:18s} {cell['layout']:20s} {outcome['status']:10s} {outcome.get('reason', '')[:150]}")
    (root / "run.json").write_text(json.dumps({"minutes": minutes, "cells": len(cells), "confirmed": confirmed}))
    print(f"{len(cells)} cells in {minutes:.1f} minutes{'' if confirmed else ' (before reruns)'}: {counts}", flush=True)


if __name__ == "__main__":
    main()
