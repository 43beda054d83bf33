"""Model-state bytes per rank, measured in real runs, next to the playbook's formula and the planner.

Runs ``l5d train -m parallel.zero=0,1,2,3`` (tiny reference model, fp32, AdamW) on N CPU
processes; each job's ``summary.json`` holds the bytes every rank held before its last
optimizer step (``lightning_5d.accounting.model_state_bytes``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from lightning_5d.estimate import estimate, load_spec
from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.train import compose

KINDS = ("params", "grads", "optimizer")


def playbook_bytes(zero: int, psi: int, n: int) -> dict[str, float]:
    """fp32 + Adam: 4Ψ + 4Ψ + 8Ψ, each term divided by N from its ZeRO stage on."""
    return {"params": 4 * psi / (n if zero >= 3 else 1), "grads": 4 * psi / (n if zero >= 2 else 1),
            "optimizer": 8 * psi / (n if zero >= 1 else 1)}  # fmt: skip


def run(quick: bool) -> dict:
    devices, steps = 4, 3
    stages = [0, 1, 2, 3]  # --quick changes nothing here: the four runs are the benchmark
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lightning_5d.cli", "train", "-m", f"parallel.zero={','.join(map(str, stages))}",
               f"devices={devices}", f"trainer.max_steps={steps}", f"hydra.sweep.dir={tmp}"]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=900, capture_output=True, text=True)
        summaries = [json.loads((Path(tmp) / str(i) / "summary.json").read_text()) for i in range(len(stages))]
    cfg = compose([f"devices={devices}"])
    module = LlamaLM(LlamaConfig(**cfg.model))
    spec = load_spec(module)
    psi = sum(p.numel() for p in module.parameters())
    rows = []
    for zero, summary in zip(stages, summaries):
        planned = estimate(spec, dp_shard=devices, zero=zero, precision="fp32", seq_len=cfg.data.seq_len,
                           micro_batch_size=cfg.data.batch_size).memory  # fmt: skip
        formula = playbook_bytes(zero, psi, devices)
        for rank_row in summary["memory"]:
            for kind in KINDS:
                rows.append({
                    "zero": zero, "rank": rank_row["rank"], "kind": kind, "measured": rank_row[kind],
                    "formula": formula[kind], "planner": getattr(planned, kind),
                })  # fmt: skip
    return {"command": " ".join(["l5d"] + cmd[3:-1]), "psi": psi, "devices": devices, "rows": rows}


def markdown(result: dict) -> str:
    lines = [
        f"Ψ = {result['psi']:,} parameters, fp32 + AdamW, dp_shard = {result['devices']}; bytes per rank "
        "(rank 0; all ranks are listed in results.json).",
        "",
        "| ZeRO | kind | measured | formula | planner | measured / formula |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if r["rank"] != 0:
            continue
        lines.append(f"| {r['zero']} | {r['kind']} | {r['measured']:,} | {r['formula']:,.0f} | {r['planner']:,.0f} "
                     f"| {r['measured'] / r['formula']:.4f} |")  # fmt: skip
    worst = max(abs(r["measured"] / r["formula"] - 1) for r in result["rows"])
    lines += ["", f"Largest deviation over all ranks and stages: {worst:.2%} (target ≤ 2 %)."]
    return "\n".join(lines)
