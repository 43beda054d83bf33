"""Bytes each rank sends per optimizer step, per collective, next to the playbook and the planner.

Every collective the training step launches is recorded by
``lightning_5d.collectives.CollectiveCounter`` (it wraps the public ``torch.distributed``
functions, which our ZeRO-0..2 engine and FSDP2 both call) over whole loop iterations after
the warm-up, in real ``Trainer(strategy=FiveDStrategy(...))`` runs, and converted to bytes on
the wire with the ring algorithm. Theory, per step, Ψ parameters, fp32 (4 bytes), N ranks that
shard (dp_shard), R replicas (dp_replicate), one micro-batch:

    ZeRO-0   all-reduce          2Ψ·(N-1)/N·4  (N = every data rank)
    ZeRO-1/2 reduce-scatter      Ψ·(N-1)/N·4   + all-gather of the updated params Ψ·(N-1)/N·4
    ZeRO-3   all-gather fwd+bwd  2Ψ·(N-1)/N·4  + reduce-scatter Ψ·(N-1)/N·4
    HSDP     + all-reduce of each rank's gradient shard across replicas 2(R-1)/R·4Ψ/N

Tensor parallelism (t ranks, no data parallelism, L layers; A = b·s·h·4 bytes, one fp32
hidden-state tensor of the micro-batch; T = b·s·4, one fp32 number per token), per step,
as Megatron-LM and the Ultra-Scale Playbook lay it out:

    TP       all-reduce      per layer 2 forward (g after attention and MLP) + 2 backward (f before them)
                             + the vocab-parallel embedding's g (forward) + the head input's f (backward)
                             + the vocab-parallel loss: max, sum of exp, target logit (3T)
    TP + SP  all-gather      per layer 2 forward (f*) + 2 backward (conjugate of g*) + 2 backward
                             (re-gather of the saved region inputs, lightning_5d/parallel/tensor/regather.py)
                             + the embedding output's reduce-scatter (its backward) + the head input (forward)
             reduce-scatter  per layer 2 forward (g*) + 2 backward (conjugate of f*)
                             + the embedding output (forward) + the head input's gradient (backward)
             all-reduce      the loss (3T) + one per norm weight, 2L + 1 (its gradient is a partial
                             sum over the sequence shards)

each all-reduce 2(t-1)/t·B, each all-gather / reduce-scatter (t-1)/t·A.

Context parallelism (c ranks share each sequence, no other data parallelism, ZeRO-1 over the
c ranks as above; L layers; K = 2·b·(s/c)·H·d·4 bytes, one fp32 packed K/V block of the local
shard, H the heads as ``lightning_5d/parallel/context/ring.py`` receives them: LlamaLM repeats
K/V to the query heads before attention), per step:

    ring        send             per layer (c-1) forward K/V hops + (c-1) backward K/V hops + c dK/dV hops
                                 (the last one lands each accumulator on its owner); B = K each
                recv             as many calls, 0 bytes (the sender's bytes)
    all-gather  all-gather       per layer 2 of the c·K block (forward, and backward's re-gather)
                reduce-scatter   per layer 1 of the c·K block gradient (backward)

plus the ZeRO-1 reduce-scatter and all-gather of Ψ, and the loss's scalar all-reduces over the cp
group (control). The planner's number is ``lightning_5d.estimate``'s ``comm`` for the same layout
(its ``send_recv`` is listed as ``send``).
"""

from __future__ import annotations

import json
from collections import defaultdict

from benchmarks.common import pending_note, run_worker
from lightning_5d.collectives import wire_bytes
from lightning_5d.estimate import estimate, load_spec
from lightning_5d.models import LlamaConfig, LlamaLM

# The memory benchmark's model: the reference LlamaConfig (Ψ = 853,120; every dim divisible by 4).
MODEL: dict = {}
SEQ_LEN, BATCH = 64, 2
LAYOUTS = [  # (label, nproc, zero, dp_replicate)
    ("ZeRO-0", 4, 0, 1),
    ("ZeRO-1", 4, 1, 1),
    ("ZeRO-2", 4, 2, 1),
    ("ZeRO-3", 4, 3, 1),
    ("HSDP ZeRO-1 (2×2)", 4, 1, 2),
    ("HSDP ZeRO-3 (2×2)", 4, 3, 2),
]
TP_LAYOUTS = [  # (label, nproc, tp, sequence_parallel): zero=0, one data rank
    ("TP", 2, 2, False),
    ("TP + SP", 2, 2, True),
]
CP_LAYOUTS = [  # (label, nproc, cp, mode): zero=1 over the cp ranks, one data rank
    ("CP (ring)", 2, 2, "ring"),
    ("CP (all-gather)", 2, 2, "allgather"),
]
DATA_OPS = ("all_reduce", "reduce_scatter", "all_gather")
PENDING_ROWS = [("PP", "pp"), ("EP", "ep")]


def theory(zero: int, psi: int, n_shard: int, replicas: int) -> dict[str, float]:
    """The playbook's bytes per rank per step, by collective (module docstring)."""
    b = 4 * psi  # fp32 gradients and parameters
    n = n_shard
    if zero == 0:
        world = n * replicas
        return {"all_reduce": 2 * (world - 1) / world * b}
    out = {"all_gather": (2 if zero == 3 else 1) * (n - 1) / n * b, "reduce_scatter": (n - 1) / n * b}
    if replicas > 1:
        out["all_reduce"] = 2 * (replicas - 1) / replicas * b / n
    return out


def tp_terms(cfg: LlamaConfig, t: int, sp: bool) -> list[dict]:
    """The playbook's TP (+SP) collectives per step (module docstring): kind, calls, tensor bytes, what."""
    a = 4 * BATCH * SEQ_LEN * cfg.hidden_size  # A: one fp32 hidden-state tensor of the micro-batch
    tok = 4 * BATCH * SEQ_LEN  # T: one fp32 number per token
    n = cfg.num_layers

    def term(op: str, calls: int, size: int, what: str) -> dict:
        return {"op": op, "calls": calls, "tensor_bytes": size, "what": what,
                "wire_bytes": calls * wire_bytes(op, size, t)}  # fmt: skip

    loss = [term("all_reduce", 3, tok, "vocab-parallel loss: max, sum of exp, target logit")]
    if not sp:
        return [
            term("all_reduce", 4 * n, a, "per layer: g after attention and MLP (fwd), f before them (bwd)"),
            term("all_reduce", 1, a, "vocab-parallel embedding: g (fwd)"),
            term("all_reduce", 1, a, "head input: f (bwd)"),
            *loss,
        ]
    return [
        term("all_gather", 4 * n, a, "per layer: f* (fwd), conjugate of g* (bwd)"),
        term("all_gather", 2 * n, a, "per layer: re-gather of the saved region inputs (bwd)"),
        term("all_gather", 1, a, "embedding output: conjugate of its reduce-scatter (bwd)"),
        term("all_gather", 1, a, "head input (fwd)"),
        term("reduce_scatter", 4 * n, a, "per layer: g* (fwd), conjugate of f* (bwd)"),
        term("reduce_scatter", 1, a, "embedding output (fwd)"),
        term("reduce_scatter", 1, a, "head input gradient (bwd)"),
        *loss,
        term("all_reduce", 2 * n + 1, 4 * cfg.hidden_size, "norm weight gradients (partial over sequence shards)"),
    ]


def cp_kv_bytes(cfg: LlamaConfig, c: int) -> int:
    """K: one fp32 packed K/V block [2, b, H, 1, s/c, d], H the query heads (LlamaLM repeats K/V)."""
    return 4 * 2 * BATCH * cfg.num_heads * (SEQ_LEN // c) * (cfg.hidden_size // cfg.num_heads)


def cp_terms(cfg: LlamaConfig, c: int, mode: str, psi: int) -> list[dict]:
    """The exact CP collectives per step (module docstring): kind, calls, tensor bytes, what."""
    kv, n = cp_kv_bytes(cfg, c), cfg.num_layers

    def term(op: str, calls: int, size: int, what: str) -> dict:
        return {"op": op, "calls": calls, "tensor_bytes": size, "what": what,
                "wire_bytes": calls * wire_bytes(op, size, c)}  # fmt: skip

    zero = [
        term("reduce_scatter", 1, 4 * psi, "ZeRO-1 gradients over dp×cp"),
        term("all_gather", 1, 4 * psi, "ZeRO-1 updated parameters over dp×cp"),
    ]
    if mode == "ring":
        return [
            term("send", 2 * (c - 1) * n, kv, "per layer: K/V hops, forward and backward"),
            term("send", c * n, kv, "per layer: dK/dV accumulator hops (backward, the last to the owner)"),
            term("recv", (3 * c - 2) * n, kv, "the matching receives (0 B: the sender's)"),
            *zero,
        ]
    return [
        term("all_gather", 2 * n, c * kv, "per layer: K/V of all ranks (forward, backward re-gather)"),
        term("reduce_scatter", n, c * kv, "per layer: dK/dV (backward)"),
        *zero,
    ]


def by_op(terms: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for t in terms:
        out[t["op"]] += t["wire_bytes"]
    return dict(out)


def planner(
    module: LlamaLM, zero: int, n_shard: int, replicas: int, tp: int = 1, sp: bool = False, cp: int = 1
) -> dict:
    est = estimate(load_spec(module), dp_replicate=replicas, dp_shard=n_shard, zero=zero, precision="fp32",
                   seq_len=SEQ_LEN, micro_batch_size=BATCH, tp=tp, sequence_parallel=sp, cp=cp)  # fmt: skip
    out: dict[str, float] = defaultdict(float)
    for entry in est.comm:
        # The planner's send_recv is the sender's bytes: the counter's "send" (its "recv" is 0 B).
        key = "send" if entry.collective.value == "send_recv" else entry.collective.value
        out[key] += entry.bytes_per_rank
    return dict(out)


# A call on a tensor this small carries flags, not parameters, gradients or activations (the
# smallest of those here: 512 B, one fp32 per token of the TP loss and a norm weight's gradient).
CONTROL_BYTES = 256


def _per_step(calls: list[dict], steps: int) -> dict[str, dict]:
    """Per collective kind: calls, wire bytes and group sizes per step; small calls go to "control".

    DTensor's functional collectives (counted by the worker's dispatch mode) get keys of their own.
    """
    acc: dict[str, dict] = defaultdict(lambda: {"calls": 0, "wire_bytes": 0.0, "group_sizes": set(), "ops": set()})
    for c in calls:
        functional = " (functional)" if c["api"].startswith("functional.") else ""
        key = "control" if c["tensor_bytes"] < CONTROL_BYTES else c["op"] + functional
        acc[key]["calls"] += 1
        acc[key]["wire_bytes"] += c["wire_bytes"]
        acc[key]["group_sizes"].add(c["group_size"])
        acc[key]["ops"].add(c["op"])
    return {key: {"calls": a["calls"] / steps, "wire_bytes": a["wire_bytes"] / steps,
                  "group_sizes": sorted(a["group_sizes"]), "ops": sorted(a["ops"])}
            for key, a in sorted(acc.items())}  # fmt: skip


def run(quick: bool) -> dict:
    # One run per layout, no repeats: the bytes are the same on every step (`ranks agree` and the
    # per-step averages show it), unlike timings.
    steps, warmup = (2, 2) if quick else (4, 2)
    module = LlamaLM(LlamaConfig(**MODEL))
    psi = sum(p.numel() for p in module.parameters())
    # FSDP2 gathers again in backward only the units it resharded after forward: every block but
    # the last (kept on purpose) and not the root (embedding, final norm, head; FSDP2's default).
    psi_last_block = sum(p.numel() for p in module.model.layers[-1].parameters())
    psi_root = psi - sum(p.numel() for b in module.model.layers for p in b.parameters())
    rows = []
    for label, nproc, zero, replicas in LAYOUTS:
        args = ["--strategy", "5d", "--zero", str(zero), "--dp-replicate", str(replicas), "--model", json.dumps(MODEL),
                "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--warmup", str(warmup), "--steps", str(steps),
                "--count-comm"]  # fmt: skip
        result = run_worker(nproc, args)
        per_rank = [_per_step(r["comm"], steps) for r in result["ranks"]]
        n_shard = nproc // replicas
        rows.append({
            "label": label, "nproc": nproc, "zero": zero, "dp_replicate": replicas, "dp_shard": n_shard,
            "measured": per_rank[0], "measured_all_ranks": per_rank,
            "ranks_agree": all(p == per_rank[0] for p in per_rank),
            "theory": theory(zero, psi, n_shard, replicas), "planner": planner(module, zero, n_shard, replicas),
        })  # fmt: skip
        if zero == 3:
            regathered = psi - psi_last_block - psi_root
            rows[-1]["fsdp2_all_gather"] = (n_shard - 1) / n_shard * 4 * (psi + regathered)
    cfg = LlamaConfig(**MODEL)
    for label, nproc, tp, sp in TP_LAYOUTS:
        args = ["--strategy", "5d", "--zero", "0", "--tp", str(tp), *(["--sp"] if sp else []), "--model",
                json.dumps(MODEL), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--warmup", str(warmup),
                "--steps", str(steps), "--count-comm"]  # fmt: skip
        result = run_worker(nproc, args)
        per_rank = [_per_step(r["comm"], steps) for r in result["ranks"]]
        terms = tp_terms(cfg, tp, sp)
        rows.append({
            "label": label, "nproc": nproc, "zero": 0, "dp_replicate": 1, "dp_shard": nproc // tp, "tp": tp,
            "sequence_parallel": sp, "num_layers": cfg.num_layers,
            "activation_bytes": 4 * BATCH * SEQ_LEN * cfg.hidden_size, "norm_weight_bytes": 4 * cfg.hidden_size,
            "measured": per_rank[0], "measured_all_ranks": per_rank,
            "ranks_agree": all(p == per_rank[0] for p in per_rank),
            "not_counted": sorted({u for r in result["ranks"] for u in r["comm_unknown"]}),
            "theory": by_op(terms), "theory_terms": terms, "planner": planner(module, 0, nproc // tp, 1, tp, sp),
        })  # fmt: skip
    for label, nproc, cp, mode in CP_LAYOUTS:
        args = ["--strategy", "5d", "--zero", "1", "--cp", str(cp), "--cp-mode", mode, "--model", json.dumps(MODEL),
                "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--warmup", str(warmup), "--steps", str(steps),
                "--count-comm"]  # fmt: skip
        result = run_worker(nproc, args)
        per_rank = [_per_step(r["comm"], steps) for r in result["ranks"]]
        terms = cp_terms(cfg, cp, mode, psi)
        rows.append({
            "label": label, "nproc": nproc, "zero": 1, "dp_replicate": 1, "dp_shard": nproc // cp, "cp": cp,
            "cp_mode": mode, "num_layers": cfg.num_layers, "heads_passed": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "kv_block_bytes": cp_kv_bytes(cfg, cp),
            "zero_bytes": wire_bytes("all_gather", 4 * psi, nproc),
            "measured": per_rank[0], "measured_all_ranks": per_rank,
            "ranks_agree": all(p == per_rank[0] for p in per_rank),
            "not_counted": sorted({u for r in result["ranks"] for u in r["comm_unknown"]}),
            "theory": by_op(terms), "theory_terms": terms, "planner": planner(module, 1, nproc // cp, 1, cp=cp),
        })  # fmt: skip
    return {
        "command": "python -m benchmarks run" + (" --quick" if quick else "") + " --only comm_vs_theory",
        "psi": psi, "seq_len": SEQ_LEN, "batch_size": BATCH, "timed_steps": steps, "rows": rows,
        "pending": [{"label": label, "note": pending_note(dim)} for label, dim in PENDING_ROWS],
    }  # fmt: skip


CONTROL_NOTE = (
    "flags, not model data: Lightning broadcasts an 8-byte SIGTERM flag from rank 0 every batch; "
    "the ZeRO-0..2 engine all-reduces one byte per parameter tensor (which got gradients)"
)
CP_CONTROL_NOTE = "; with cp, the loss all-reduces its sum and its token count over the cp group (scalars)"
ZERO3_GATHER_NOTE = (
    "below theory, as designed: FSDP2 does not re-gather in backward what stays gathered after forward — "
    "the last block (reshard_after_forward=False) and the root unit (embedding, final norm, head)"
)


def _note(row: dict, key: str, ratio: float | None) -> str:
    if key == "control":
        return CONTROL_NOTE + (CP_CONTROL_NOTE if row.get("cp", 1) > 1 else "")
    if row.get("tp", 1) > 1:
        return _tp_note(row, key, ratio)
    if row.get("cp", 1) > 1:
        return _cp_note(row, key, ratio)
    if ratio is not None and 0.95 <= ratio <= 1.05:
        return ""
    if key == "all_gather" and row["zero"] == 3 and ratio is not None and ratio < 1:
        expected = row["fsdp2_all_gather"]
        return (
            f"{ZERO3_GATHER_NOTE}; forward Ψ + backward (Ψ − last block − root) = {expected:,.0f} B, "
            f"measured / that = {row['measured']['all_gather']['wire_bytes'] / expected:.4f}"
        )
    return "✗ unexplained"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1.0)


def _tp_note(row: dict, key: str, ratio: float | None) -> str:
    """What a TP row's collective is made of, and why measured, theory and planner differ where they do.

    Every explanation is checked against the numbers: a difference it does not account for
    byte for byte is marked unexplained.
    """
    t, n, a = row["tp"], row["num_layers"], row["activation_bytes"]
    ag = wire_bytes("all_gather", a, t)  # one all-gather / reduce-scatter of A
    ar = wire_bytes("all_reduce", a, t)  # one all-reduce of A
    norm = wire_bytes("all_reduce", row["norm_weight_bytes"], t)
    m = row["measured"].get(key, {}).get("wire_bytes", 0.0)
    th, pl = row["theory"].get(key, 0.0), row["planner"].get(key, 0.0)
    parts = []
    if not row["sequence_parallel"]:
        if key == "all_reduce" and _close(m, th):
            parts.append(
                f"{4 * n} in the blocks (2 fwd + 2 bwd per layer) + the embedding (fwd) + the head input (bwd) + "
                "the loss in 2 calls (max; sum of exp and target logit share one): the theory's bytes"
            )
    elif key == "all_gather" and _close(m, th):
        parts.append(f"{6 * n} in the blocks (4 per layer: f*, conjugate of g*; 2 per layer: re-gathers) + the "
                     "last block's output (fwd; = the head input) + the first block's scatter (bwd; = the "
                     "embedding output's conjugate)")  # fmt: skip
    elif key == "reduce_scatter" and _close(th - m, 2 * ag):
        parts.append(f"below theory by {th - m:,.0f} B, the embedding output (fwd) and the head input gradient "
                     "(bwd): this implementation all-reduces those two (see all_reduce)")  # fmt: skip
    elif key == "all_reduce" and _close(m - th, 2 * ar - norm):
        share = (2 * ar - 2 * ag) / sum(v["wire_bytes"] for v in row["measured"].values())
        parts.append(
            f"✗ above theory by {m - th:,.0f} B: the vocab-parallel embedding all-reduces its output and then "
            f"keeps its sequence chunk, and the head's f all-reduces its input gradient, 2 × 2(t−1)/t·A = "
            f"{2 * ar:,.0f} B, where Megatron-LM reduce-scatters both ((t−1)/t·A each, {2 * ag:,.0f} B, see "
            f"reduce_scatter): net +{2 * ar - 2 * ag:,.0f} B per step, {share:.1%} of the step's total; the final "
            f"norm runs on the whole sequence (after the last block's gather), so its weight needs no all-reduce: "
            f"{2 * n} norm-weight all-reduces, not {2 * n + 1} (−{norm:,.0f} B). A saving left to take: "
            f"reduce-scatter the embedding output into the first block, and run the final norm on the sequence "
            f"shard before gathering the head input"
        )
    elif ratio is None or not 0.95 <= ratio <= 1.05:
        parts.append("✗ unexplained")
    if not _close(pl, th):
        regathers = (
            f"the planner leaves out the {2 * n} re-gathers of saved region inputs and the embedding output's "
            "backward all-gather"
        )
        norms = f"the planner leaves out the {2 * n + 1} norm-weight gradient all-reduces"
        gaps = {
            ("all_gather", True): (th - pl, (2 * n + 1) * ag, regathers),
            ("all_reduce", True): (th - pl, (2 * n + 1) * norm, norms),
        }
        diff, expected, why = gaps.get((key, row["sequence_parallel"]), (None, None, None))
        if diff is not None and _close(diff, expected):
            parts.append(f"planner {pl - th:+,.0f} B vs theory: {why}")
        else:
            parts.append(f"✗ planner {pl - th:+,.0f} B vs theory, unexplained")
    return "; ".join(parts)


def _cp_note(row: dict, key: str, ratio: float | None) -> str:
    """What a CP row's collective is made of, and why measured, theory and planner differ where they do.

    As for TP: every explanation is checked against the numbers, byte for byte, or marked unexplained.
    """
    c, n, kv, zero = row["cp"], row["num_layers"], row["kv_block_bytes"], row["zero_bytes"]
    h, g = row["heads_passed"], row["kv_heads"]
    m = row["measured"].get(key, {}).get("wire_bytes", 0.0)
    th, pl = row["theory"].get(key, 0.0), row["planner"].get(key, 0.0)
    ring = row["cp_mode"] == "ring"
    parts = []
    if key not in row["measured"] and th == 0:
        pass  # the planner's alone (below)
    elif key == "recv" and m == 0 and th == 0:
        parts.append("the receives of the sends above: counted as calls, their bytes are the sender's")
    elif key == "send" and ring and _close(m, th):
        parts.append(f"{(3 * c - 2) * n} sends of K = {kv:,} B: per layer {c - 1} forward + {c - 1} backward "
                     f"K/V hops and {c} dK/dV hops, the theory's bytes")  # fmt: skip
    elif key in ("all_gather", "reduce_scatter") and _close(m, th):
        what = "the ZeRO-1 " + ("updated parameters" if key == "all_gather" else "gradients") + f" ({zero:,.0f} B)"
        if not ring:
            cp_calls = 2 * n if key == "all_gather" else n
            cp_what = "K/V gathers (forward + backward)" if key == "all_gather" else "dK/dV reduce-scatters"
            what += f" + {cp_calls} {cp_what} of the {c}·K block ({th - zero:,.0f} B)"
        parts.append(what + ": the theory's bytes")
    elif ratio is None or not 0.95 <= ratio <= 1.05:
        parts.append("✗ unexplained")
    if not _close(pl, th):
        # The planner: our ring's 3c-2 hops per layer of a block of the config's kv heads, whatever the mode.
        planner_send = (3 * c - 2) * n * kv * g / h
        if ring and key == "send" and _close(pl, planner_send):
            parts.append(
                f"✗ planner {pl - th:+,.0f} B vs theory (theory / planner = {th / pl:.4f}): it counts a block of the "
                f"config's {g} kv heads, where LlamaLM repeats K/V to the {h} query heads before attention and ring "
                f"attention passes what it is given (×{h / g:g}; passing the {g} kv heads would halve the ring's "
                f"traffic); its {3 * c - 2} hops per layer are the ring's"
            )
        elif not ring and key == "send" and _close(pl, planner_send) and m == 0:
            parts.append(
                f"✗ planner {pl - th:+,.0f} B vs theory: it models every cp layout as the ring (the ring's "
                f"{3 * c - 2} hops per layer of a {g}-kv-head block), not the all-gather mode's collectives"
            )
        elif not ring and key in ("all_gather", "reduce_scatter") and _close(th - pl, th - zero):
            parts.append(f"✗ planner {pl - th:+,.0f} B vs theory: it has no all-gather-mode K/V collectives "
                         "(see send)")  # fmt: skip
        else:
            parts.append(f"✗ planner {pl - th:+,.0f} B vs theory, unexplained")
    return "; ".join(parts)


def _functional_count(result: dict) -> str:
    rows = [r["label"] for r in result["rows"] for p in r["measured_all_ranks"] if any("functional" in k for k in p)]
    return f"in {', '.join(sorted(set(rows)))}" if rows else "none occur, on any rank"


def _tp_intro(result: dict) -> list[str]:
    rows = [r for r in result["rows"] if r.get("tp", 1) > 1]
    if not rows:
        return []
    r = rows[0]
    return [
        f"TP rows: {r['nproc']} processes, tp = {r['tp']}, no data parallelism (`FiveDStrategy(tp={r['tp']}, "
        f"sequence_parallel=..., zero=0)`), {r['num_layers']} layers; A = b·s·h·4 = {r['activation_bytes']:,} B "
        "(one fp32 hidden-state tensor of the micro-batch). Theory: Megatron-LM / the Ultra-Scale Playbook per "
        "block — TP: 2 all-reduces of A forward + 2 backward per layer; TP+SP: 2 all-gathers + 2 reduce-scatters "
        "forward, 2 reduce-scatters + 4 all-gathers backward (2 of them re-gather the saved region inputs, "
        "`lightning_5d/parallel/tensor/regather.py`) — plus the vocab-parallel embedding (all-reduce; with SP "
        "reduce-scatter forward, all-gather backward), the head input (all-reduce of its gradient; with SP "
        "all-gather forward, reduce-scatter backward), the vocab-parallel loss (3 fp32 numbers per token "
        "all-reduced) and, with SP, one all-reduce per norm weight (2L + 1). Collective by collective: "
        "benchmarks/comm_vs_theory.py.",
        "",
    ]


def _cp_intro(result: dict) -> list[str]:
    rows = [r for r in result["rows"] if r.get("cp", 1) > 1]
    if not rows:
        return []
    r = rows[0]
    return [
        f"CP rows: {r['nproc']} processes, cp = {r['cp']}, no other data parallelism (`FiveDStrategy(cp={r['cp']}, "
        f'context={{"mode": "ring" | "allgather"}}, zero=1)`, ZeRO-1 over dp×cp = {r["nproc"]} ranks), '
        f"{r['num_layers']} layers; K = 2·b·(s/cp)·H·d·4 = {r['kv_block_bytes']:,} B, one fp32 packed K/V block "
        f"of the local shard, with H = {r['heads_passed']} heads as ring attention receives them (LlamaLM repeats "
        f"its {r['kv_heads']} kv heads to the query heads before attention). Theory, per layer — ring: (cp−1) "
        "K/V sends forward, (cp−1) again backward and cp sends of the dK/dV accumulator (the last lands it on its "
        "owner), `dist.batch_isend_irecv`, counted as isend = K, irecv = 0; all-gather: an all-gather of the "
        "cp·K block forward and again backward, a reduce-scatter of its gradient backward — plus ZeRO-1's "
        "reduce-scatter and all-gather of Ψ. Collective by collective: benchmarks/comm_vs_theory.py.",
        "",
    ]


def markdown(result: dict) -> str:
    lines = [
        f"Ψ = {result['psi']:,} parameters (reference `LlamaConfig`), fp32 + AdamW, seq {result['seq_len']}, "
        f"micro-batch {result['batch_size']}, one micro-batch per step; bytes each rank sends per optimizer step "
        f"(ring algorithm), averaged over {result['timed_steps']} steps after the warm-up. Rank 0 shown; "
        "`ranks agree` says whether every rank measured the same. Target: measured / theory ≤ 1.05. "
        "Counted by wrapping the public `torch.distributed` functions, which our ZeRO-0..2 engine and FSDP2 "
        "(torch 2.13: `dist.all_gather_single`, `dist.reduce_scatter_single`, `dist.all_reduce`) and our TP "
        "call, so all of their traffic is seen; DTensor's functional collectives are counted too, by a dispatch "
        f"mode in the worker (listed as *functional*; {_functional_count(result)}); C++ callers (the DDP reducer) "
        "would not be seen — the byte-exact agreement below shows none carries model data here.",
        "",
        *_tp_intro(result),
        *_cp_intro(result),
        "| layout | collective | calls / step | measured (B) | theory (B) | planner (B) | measured / theory "
        "| ranks agree | note |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result["rows"]:
        keys = sorted(set(row["measured"]) - {"control"} | set(row["theory"]) | set(row["planner"]))
        keys += ["control"] if "control" in row["measured"] else []
        total_m = sum(v["wire_bytes"] for v in row["measured"].values())
        total_t = sum(row["theory"].values())
        for key in keys:
            m = row["measured"].get(key, {"calls": 0, "wire_bytes": 0.0, "group_sizes": [], "ops": []})
            t, p = row["theory"].get(key), row["planner"].get(key)
            ratio = m["wire_bytes"] / t if t else None
            name = f"control (<{CONTROL_BYTES} B: {', '.join(m['ops'])})" if key == "control" else key
            lines.append(
                f"| {row['label']} | {name} (group {','.join(map(str, m['group_sizes'])) or '-'}) | {m['calls']:g} "
                f"| {m['wire_bytes']:,.0f} | {'' if t is None else f'{t:,.0f}'} | {'' if p is None else f'{p:,.0f}'} "
                f"| {'' if ratio is None else f'{ratio:.4f}'} | {'yes' if row['ranks_agree'] else 'no'} "
                f"| {_note(row, key, ratio)} |"
            )
        lines.append(f"| {row['label']} | **total** | | {total_m:,.0f} | {total_t:,.0f} | "
                     f"{sum(row['planner'].values()):,.0f} | {total_m / total_t:.4f} | | |")  # fmt: skip
    for p in result["pending"]:
        lines.append(f"| {p['label']} | | | | | | | | {p['note']} |")
    worst = max(sum(v["wire_bytes"] for v in r["measured"].values()) / sum(r["theory"].values())
                for r in result["rows"])  # fmt: skip
    lines += ["", f"Largest total measured / theory: {worst:.4f} (target ≤ 1.05)."]
    return "\n".join(lines)
