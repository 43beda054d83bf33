"""Start-up memory of loading weights: ``pretrained=`` (safetensors) and a resume, per rank.

The same ~0.5 B reference model and 4 CPU processes as startup_memory.py, built on the meta
device under ``FiveDStrategy(zero=3)`` and ``(tp=2, zero=3)``: peak RSS per rank until
``on_train_start`` above the rank's baseline, as a fraction of the whole fp32 model, for

* the bare meta build (no weights loaded; what the load rows add to),
* ``pretrained=`` a safetensors file of the whole model (each rank reads its slices),
* a resume (``ckpt_path=``) of a sharded checkpoint written under ZeRO-3 after one AdamW step
  (model + 2 moments: the rank's share of those is 3/4 of the model under 4-way ZeRO-3; under
  tp2 x zero3 the same, re-laid out from the ZeRO-3 checkpoint).

The file and the checkpoint are written first (the file by this process, the checkpoint by a
4-process ZeRO-3 run). ``STARTUP_LOAD_LIB=/path/to/other/checkout`` runs the workers on another
copy of lightning_5d (how the rows before this change were measured).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import WorkerFailed, first_error
from benchmarks.startup_memory import MODEL, NPROC, QUICK_MODEL, param_count
from lightning_5d.testing import run_distributed

WORKER = Path(__file__).parent / "workers" / "startup_memory_load.py"
VARIANTS = [
    ("bare_zero3", "`FiveDStrategy(zero=3)`, meta build, nothing loaded"),
    ("pretrained_zero3", "`FiveDStrategy(zero=3, pretrained=file.safetensors)`"),
    ("resume_zero3", "`FiveDStrategy(zero=3)`, resume of the zero3 checkpoint (model + AdamW)"),
    ("bare_tp2_zero3", "`FiveDStrategy(tp=2, zero=3)`, meta build, nothing loaded"),
    ("pretrained_tp2_zero3", "`FiveDStrategy(tp=2, zero=3, pretrained=file.safetensors)`"),
    ("resume_tp2_zero3", "`FiveDStrategy(tp=2, zero=3)`, resume of the zero3 checkpoint (re-laid out)"),
]


def _env() -> dict:
    env = {"OMP_NUM_THREADS": "1"}
    lib = os.environ.get("STARTUP_LOAD_LIB")
    if lib:
        env["PYTHONPATH"] = lib
    return env


def _one(variant: str, model: dict, files: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        start = time.time()
        args = ["--variant", variant, "--model", json.dumps(model), "--weights", str(files / "model.safetensors"),
                "--checkpoint", str(files / "zero3.ckpt"), "--out", str(out)]  # fmt: skip
        run = run_distributed(WORKER, NPROC, args, timeout=1200, env=_env())
        if run.returncode != 0 or not out.exists():
            raise WorkerFailed(first_error(run.output) or f"exit {run.returncode}", run.output)
        result = json.loads(out.read_text())
        result["wall_s"] = time.time() - start
        return result


def write_weights(model: dict, path: Path) -> None:
    """The whole model's fp32 weights as one safetensors file (names of the LightningModule)."""
    import torch

    from lightning_5d.checkpoint.export import save_safetensors
    from lightning_5d.models import LlamaConfig, LlamaLM

    torch.manual_seed(1)
    module = LlamaLM(LlamaConfig(**model))
    save_safetensors({k: v.detach() for k, v in module.state_dict().items()}, path)
    del module
    gc.collect()


def run(quick: bool, variants: list[str] | None = None) -> dict:
    model = QUICK_MODEL if quick else MODEL
    full = 4 * param_count(model)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("STARTUP_LOAD_TMP")) as tmp:
        files = Path(tmp)
        selected = [(v, label) for v, label in VARIANTS if variants is None or v in variants]
        write_weights(model, files / "model.safetensors")
        if any(v.startswith("resume") for v, _ in selected):
            _one("save", model, files)
        for variant, label in selected:
            try:
                r = _one(variant, model, files)
            except WorkerFailed as err:  # a variant that cannot start is a finding: recorded, the others still run
                rows.append({"variant": variant, "label": label, "error": str(err)})
                continue
            above = [rank["peak"] - rank["baseline"] for rank in r["ranks"]]
            rows.append({"variant": variant, "label": label, "above_baseline": above, "max_above": max(above),
                         "fraction": max(above) / full, "ranks": r["ranks"], "wall_s": r["wall_s"]})  # fmt: skip
    cmd = "python -m benchmarks run --only startup_memory_load" + (" --quick" if quick else "")
    return {"command": cmd, "nproc": NPROC, "model": model, "full_bytes": full, "rows": rows,
            "lib": os.environ.get("STARTUP_LOAD_LIB")}  # fmt: skip


def markdown(result: dict) -> str:
    full = result["full_bytes"]
    lines = [
        f"Reference model {result['model']} ({full // 4 / 1e9:.2f} B parameters, {full / 2**20:,.0f} MiB in fp32), "
        f"{result['nproc']} CPU processes, built on the meta device. Peak RSS per rank from start to "
        f"`on_train_start` (after setup, the pretrained load, a resume's model and optimizer restore), above the "
        f"rank's RSS before the model existed; the largest rank; as a fraction of the whole fp32 model. The resume "
        f"rows hold the rank's AdamW moments too (2 x its share of the model).",
        "",
        "| variant | peak above baseline (MiB) | fraction of the model | before | held at `on_train_start` (MiB) "
        "| wall (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | |")
            continue
        held = max(k["rss_after_setup"] - k["baseline"] for k in r["ranks"])
        note = " (not rerun: previous run's row)" if r.get("kept") else ""
        before = f"{r['before']:.2f}" if r.get("before") is not None else ""  # rows merged by hand over a previous run
        lines.append(f"| {r['label']}{note} | {r['max_above'] / 2**20:,.0f} | {r['fraction']:.2f} | {before} | "
                     f"{held / 2**20:,.0f} | {r['wall_s']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":  # some variants by hand: python -m benchmarks.startup_memory_load [VARIANT ...]
    import sys

    print(json.dumps(run(bool(os.environ.get("QUICK")), sys.argv[1:] or None), indent=1))
