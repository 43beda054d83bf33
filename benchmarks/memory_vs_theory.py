"""Model-state bytes per rank, measured in real runs, next to the playbook's formula and the planner.

Runs ``l5d train -m recipe=<recipe> parallel.zero=0,1,2,3`` (tiny reference model, fp32,
AdamW) on N CPU processes, once per layout; each job's ``summary.json`` holds the bytes
every rank held before its last optimizer step (``lightning_5d.accounting.model_state_bytes``).
Layouts: plain data parallelism (``recipe=tiny_dp``: dp_shard = N) and tensor parallelism
(``recipe=tiny_tp``: tp = 2 with sequence parallelism, dp_shard = N/2).

Formula, fp32 + Adam: 4Ψ_r + 4Ψ_r + 8Ψ_r, each term divided by N_d from its ZeRO stage on,
where Ψ_r is what one rank holds before ZeRO: Ψ without TP; with TP (t ranks), per layer
the attention and MLP projections / t plus the two norms (replicated), plus the embedding
and the head / t (vocabulary-parallel) and the final norm (replicated). Sequence
parallelism changes no model state.
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
DEVICES, STEPS = 4, 3
STAGES = [0, 1, 2, 3]
LAYOUTS = [  # (label, recipe, tp): the recipe sets the model, data and parallel group; zero is swept
    ("dp_shard=4", "tiny_dp", 1),
    ("tp=2 (SP) × dp_shard=2", "tiny_tp", 2),
]


def playbook_bytes(zero: int, psi: float, n: int) -> dict[str, float]:
    """fp32 + Adam: 4Ψ + 4Ψ + 8Ψ, each term divided by N from its ZeRO stage on."""
    return {"params": 4 * psi / (n if zero >= 3 else 1), "grads": 4 * psi / (n if zero >= 2 else 1),
            "optimizer": 8 * psi / (n if zero >= 1 else 1)}  # fmt: skip


def psi_per_tp_rank(cfg: LlamaConfig, tp: int) -> float:
    """Ψ_r: parameters one rank holds under tensor parallelism, before any ZeRO sharding (module docstring)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * cfg.num_heads * d + 2 * h * cfg.num_kv_heads * d + cfg.num_heads * d * h  # q, k, v, o
    mlp = 3 * h * cfg.intermediate_size  # gate, up, down
    layer = (attention + mlp) / tp + 2 * h  # + attention_norm, mlp_norm (replicated)
    vocab = cfg.vocab_size * h / tp * (1 if cfg.tie_embeddings else 2)  # embedding (+ head)
    return cfg.num_layers * layer + vocab + h  # + the final norm (replicated)


def _sweep(recipe: str, tmp: str) -> tuple[list[str], list[dict]]:
    cmd = [sys.executable, "-m", "lightning_5d.cli", "train", "-m", f"recipe={recipe}",
           f"parallel.zero={','.join(map(str, STAGES))}", f"devices={DEVICES}", f"trainer.max_steps={STEPS}",
           f"hydra.sweep.dir={tmp}"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=900, capture_output=True, text=True)
    return cmd, [json.loads((Path(tmp) / str(i) / "summary.json").read_text()) for i in range(len(STAGES))]


def run(quick: bool) -> dict:
    # --quick changes nothing here: the runs are the benchmark.
    rows, commands, layouts = [], [], []
    for label, recipe, tp in LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            cmd, summaries = _sweep(recipe, tmp)
        commands.append(" ".join(["l5d"] + cmd[3:-1]))
        cfg = compose([f"recipe={recipe}", f"devices={DEVICES}"])
        assert cfg.parallel.tp == tp, f"recipe {recipe} has tp={cfg.parallel.tp}, expected {tp}"
        model_cfg = LlamaConfig(**cfg.model)
        spec = load_spec(LlamaLM(model_cfg))
        psi = psi_per_tp_rank(model_cfg, tp)
        n_d = DEVICES // tp
        layouts.append({"label": label, "recipe": recipe, "tp": tp, "dp_shard": n_d, "psi_rank": psi,
                        "sequence_parallel": bool(cfg.parallel.sequence_parallel)})  # fmt: skip
        for zero, summary in zip(STAGES, summaries):
            planned = estimate(spec, tp=tp, dp_shard=n_d, zero=zero, precision="fp32", seq_len=cfg.data.seq_len,
                               micro_batch_size=cfg.data.batch_size,
                               sequence_parallel=bool(cfg.parallel.sequence_parallel)).memory  # fmt: skip
            formula = playbook_bytes(zero, psi, n_d)
            for rank_row in summary["memory"]:
                for kind in KINDS:
                    rows.append({
                        "layout": label, "zero": zero, "rank": rank_row["rank"], "kind": kind,
                        "measured": rank_row[kind], "formula": formula[kind], "planner": getattr(planned, kind),
                    })  # fmt: skip
    psi = sum(p.numel() for p in LlamaLM(LlamaConfig(**compose([f"devices={DEVICES}"]).model)).parameters())
    return {
        "command": "python -m benchmarks run --only memory_vs_theory",
        "runs": commands, "psi": psi, "devices": DEVICES, "layouts": layouts, "rows": rows,
    }  # fmt: skip


def markdown(result: dict) -> str:
    lines = [
        f"Ψ = {result['psi']:,} parameters (tiny reference model), fp32 + AdamW, {result['devices']} CPU processes; "
        "bytes per rank held before an optimizer step (rank 0; all ranks are listed in results.json). Formula: "
        "4Ψ_r + 4Ψ_r + 8Ψ_r, each term divided by N_d (dp_shard) from its ZeRO stage on, with Ψ_r the parameters "
        "one rank holds before ZeRO.",
        "",
    ]
    for layout in result["layouts"]:
        if layout["tp"] > 1:
            lines.append(
                f"- {layout['label']}: Ψ_r = {layout['psi_rank']:,.0f} = per layer (attention + MLP projections) "
                f"/ {layout['tp']} + 2 norms, + (embedding + head) / {layout['tp']} + final norm; N_d = "
                f"{layout['dp_shard']}; sequence parallelism changes no model state."
            )
        else:
            lines.append(f"- {layout['label']}: Ψ_r = Ψ, N_d = {layout['dp_shard']}.")
    lines += ["", "Runs:", ""] + [f"- `{c}`" for c in result["runs"]]
    lines += [
        "",
        "| layout | ZeRO | kind | measured | formula | planner | measured / formula |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if r["rank"] != 0:
            continue
        lines.append(f"| {r['layout']} | {r['zero']} | {r['kind']} | {r['measured']:,} | {r['formula']:,.0f} "
                     f"| {r['planner']:,.0f} | {r['measured'] / r['formula']:.4f} |")  # fmt: skip
    worst = max(abs(r["measured"] / r["formula"] - 1) for r in result["rows"])
    worst_planner = max(abs(r["planner"] / r["formula"] - 1) for r in result["rows"])
    lines += [
        "",
        f"Largest deviation over all ranks, layouts and stages: {worst:.2%} (target ≤ 2 %); planner vs formula: "
        f"{worst_planner:.2%}.",
    ]
    return "\n".join(lines)
