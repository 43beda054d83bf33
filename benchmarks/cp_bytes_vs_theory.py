"""Bytes context-parallel attention sends per rank per step, per mode, next to the planner's formula.

Each mode trains the reference ``LlamaConfig`` (8 query / 4 KV heads, 4 layers) under
``FiveDStrategy(cp=4, context={"mode": ...})`` on 4 processes, fp32, and
``lightning_5d.collectives.CollectiveCounter`` records every collective of the timed steps
(``benchmarks/workers/train.py --count-comm``). Attention is the only sender of point-to-point
messages (the ring's hops) and of all-to-alls here (no pp, no ep), so those two kinds are its
traffic; the rest (ZeRO-1's reduce-scatter and all-gather, the loss's scalar all-reduces) is
not attention's and is left out. Theory is the planner's ``context_parallel_comm`` for the same
layout (``lightning_5d/estimate/comm.py``), per layer and micro-batch, with the local K/V block
``K = 2·b·(S/cp)·h_kv·d·4`` bytes and ``Q = b·(S/cp)·h·d·4``, where ``h_kv`` is the K/V heads
attention *receives*: ``LlamaLM`` repeats K/V to the query heads before its SDPA call, so that is
``h`` here (theory), while the planner, given the model's config, counts its 4 KV heads (planner
column; it is what a model that passes K/V unrepeated, as Hugging Face's do, sends):

    ring      (cp−1) K/V hops forward + (cp−1) backward + cp dK/dV hops, each K
    alltoall  4 all-to-alls forward (q, k, v, out) + 4 backward, each (cp−1)/cp of its tensor
    hybrid    the alltoall's over groups of U ranks ((U−1)/U) + a ring of cp/U ranks, hops of K
"""

from __future__ import annotations

import json
from collections import defaultdict

from benchmarks.common import run_worker
from lightning_5d.estimate import estimate, load_spec
from lightning_5d.models import LlamaConfig, LlamaLM

MODEL: dict = {}  # the reference LlamaConfig
SEQ_LEN, BATCH, CP = 64, 2, 4
MODES = [  # (label, mode, ulysses)
    ("ring", "ring", None),
    ("alltoall (Ulysses)", "alltoall", None),
    ("hybrid (a2a 2 × ring 2)", "hybrid", 2),
]
ATTENTION_OPS = ("send", "all_to_all")  # the planner's send_recv is the sender's bytes: the counter's "send"


def planner(mode: str, ulysses: int | None, **overrides: int) -> dict[str, float]:
    """The planner's cp bytes per rank per step, by collective kind; ``overrides`` change the model's spec."""
    spec = load_spec(LlamaLM(LlamaConfig(**MODEL)), **overrides)
    est = estimate(spec, dp_shard=1, cp=CP, cp_mode=mode, cp_ulysses=ulysses, zero=1, precision="fp32",
                   seq_len=SEQ_LEN, micro_batch_size=BATCH)  # fmt: skip
    out: dict[str, float] = defaultdict(float)
    for entry in est.comm:
        if entry.dim == "cp":
            key = "send" if entry.collective.value == "send_recv" else entry.collective.value
            out[key] += entry.bytes_per_rank
    return dict(out)


def measured(calls: list[dict], steps: int) -> dict[str, dict]:
    """Attention's collectives per step, by kind: calls, wire bytes, group sizes."""
    acc: dict[str, dict] = defaultdict(lambda: {"calls": 0, "wire_bytes": 0.0, "group_sizes": set()})
    for c in calls:
        if c["op"] in ATTENTION_OPS:
            acc[c["op"]]["calls"] += 1
            acc[c["op"]]["wire_bytes"] += c["wire_bytes"]
            acc[c["op"]]["group_sizes"].add(c["group_size"])
    return {op: {"calls": a["calls"] / steps, "wire_bytes": a["wire_bytes"] / steps,
                 "group_sizes": sorted(a["group_sizes"])} for op, a in sorted(acc.items())}  # fmt: skip


def measure_mode(label: str, mode: str, ulysses: int | None, steps: int = 2, warmup: int = 2) -> dict:
    """One mode's row: attention's measured bytes per step (rank 0 and agreement) and the planner's."""
    args = ["--strategy", "5d", "--zero", "1", "--cp", str(CP), "--cp-mode", mode, "--model", json.dumps(MODEL),
            "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--warmup", str(warmup), "--steps", str(steps),
            "--count-comm", *(["--cp-ulysses", str(ulysses)] if ulysses else [])]  # fmt: skip
    result = run_worker(CP, args)
    per_rank = [measured(r["comm"], steps) for r in result["ranks"]]
    return {"label": label, "mode": mode, "ulysses": ulysses, "measured": per_rank[0],
            "ranks_agree": all(p == per_rank[0] for p in per_rank),
            # theory: K/V with the query heads' count, as LlamaLM passes them to attention
            "theory": planner(mode, ulysses, num_kv_heads=LlamaConfig(**MODEL).num_heads),
            "planner": planner(mode, ulysses)}  # fmt: skip


def run(quick: bool) -> dict:
    steps, warmup = (2, 2) if quick else (3, 2)
    rows = [measure_mode(label, mode, ulysses, steps, warmup) for label, mode, ulysses in MODES]
    return {
        "command": "python -m benchmarks run" + (" --quick" if quick else "") + " --only cp_bytes_vs_theory",
        "seq_len": SEQ_LEN, "batch_size": BATCH, "cp": CP, "timed_steps": steps, "rows": rows,
    }  # fmt: skip


def row_ratio(row: dict) -> float:
    """measured / theory of one mode's attention bytes per step."""
    return sum(v["wire_bytes"] for v in row["measured"].values()) / sum(row["theory"].values())


def markdown(result: dict) -> str:
    cfg = LlamaConfig(**MODEL)
    lines = [
        f"Attention's bytes per rank per optimizer step under cp={result['cp']} on {result['cp']} processes "
        f"(reference `LlamaConfig`: {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, {cfg.num_layers} layers; "
        f"fp32, seq {result['seq_len']}, micro-batch {result['batch_size']}, ZeRO-1), averaged over "
        f"{result['timed_steps']} steps after the warm-up; rank 0 shown, `ranks agree` compares every rank. "
        "Measured: the point-to-point sends and all-to-alls that `lightning_5d.collectives.CollectiveCounter` "
        "recorded (attention is their only caller here). Theory: the planner's `context_parallel_comm` "
        "(benchmarks/cp_bytes_vs_theory.py has the formulas) for K/V with the heads attention receives: "
        f"`LlamaLM` repeats its {cfg.num_kv_heads} KV heads to the {cfg.num_heads} query heads before SDPA. "
        f"Planner: the same formula from the model's config ({cfg.num_kv_heads} KV heads), i.e. what a model that "
        "passes K/V unrepeated (Hugging Face's) sends; the reference model would halve its K/V traffic by calling "
        "SDPA with `enable_gqa=True`. Target: measured / theory ≤ 1.05.",
        "",
        "| mode | collective (group) | calls / step | measured (B) | theory (B) | measured / theory | planner (B) "
        "| ranks agree |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        for op in sorted(set(row["measured"]) | set(row["theory"])):
            m = row["measured"].get(op, {"calls": 0, "wire_bytes": 0.0, "group_sizes": []})
            t, p = row["theory"].get(op, 0.0), row["planner"].get(op, 0.0)
            ratio = f"{m['wire_bytes'] / t:.4f}" if t else ""
            groups = ",".join(map(str, m["group_sizes"])) or "-"
            lines.append(f"| {row['label']} | {op} ({groups}) | {m['calls']:g} | {m['wire_bytes']:,.0f} | {t:,.0f} "
                         f"| {ratio} | {p:,.0f} | {'yes' if row['ranks_agree'] else 'NO'} |")  # fmt: skip
        total_m = sum(v["wire_bytes"] for v in row["measured"].values())
        total_t, total_p = sum(row["theory"].values()), sum(row["planner"].values())
        lines.append(f"| {row['label']} | **total** | | {total_m:,.0f} | {total_t:,.0f} | {total_m / total_t:.4f} "
                     f"| {total_p:,.0f} | |")  # fmt: skip
    worst = max(row_ratio(row) for row in result["rows"])
    lines += ["", f"Largest measured / theory: {worst:.4f} (target ≤ 1.05)."]
    return "\n".join(lines)
