"""Part 3: the per-block attention kernel of context parallelism vs the model's SDPA on the same block.

Every cp rank computes, for each KV block it sees, the block's partial output and its log-sum-exp,
and merges them; ``ring_block`` below is the one place this benchmark calls that kernel, so a new
block function (fused SDPA kernels returning the log-sum-exp) is measured by repointing one line.
Today it is ``ring_attention`` with no process group: one rank, one block, through the ring's block
forward, merge and block backward.

Two blocks per length L, on ``[1, heads, L, head_dim]`` bf16 tensors shaped as the part 1 model's
attention (GQA: fewer KV heads):

- diagonal (causal): the block holding the query positions themselves, what cp=1 computes whole;
- full (non-causal): an off-diagonal block, what every other step of the ring computes.

The model's SDPA is ``F.scaled_dot_product_attention`` after repeating K/V to the query heads, as
``lightning_5d.models.llama.Attention`` calls it (flash attention on a CUDA GPU). Per kernel: median
time of forward, and of forward + backward, over ``attention_repeats`` calls after one warm-up; peak
memory beyond the inputs during forward + backward. A kernel that runs out of memory is recorded
as such and the next one runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.gpu.hardware import Card, allocated, peak_allocated, release_memory, reset_peak, sync
from benchmarks.gpu.part import PartContext, size, ms, table
from benchmarks.gpu.workload import Sizes

DTYPE = torch.bfloat16  # what the attention receives under bf16 autocast


def ring_block(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """Context parallelism's per-block kernel on one block (forward; backward through autograd).

    The adapter: repoint this when the ring's block function changes. With no process group the
    ring is one rank holding the whole sequence, so exactly one block goes through the block math.
    """
    from lightning_5d.parallel.context.ring import ring_attention

    return ring_attention(q, k, v, None, causal=causal)


def model_sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The reference model's attention call on the same block: K/V repeated to the query heads, then SDPA."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


KERNELS: dict[str, Callable[[Tensor, Tensor, Tensor, bool], Tensor]] = {"sdpa": model_sdpa, "ring_block": ring_block}
BLOCKS = {"diagonal": True, "full": False}  # block name -> causal


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_kernel(kernel: Callable, length: int, causal: bool, heads: int, kv_heads: int, head_dim: int,
                   device: torch.device, repeats: int) -> dict[str, Any]:  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(h: int) -> Tensor:
        return torch.randn(1, h, length, head_dim, device=device, dtype=DTYPE, generator=generator).requires_grad_()

    q, k, v = randn(heads), randn(kv_heads), randn(kv_heads)
    grad = torch.randn(1, heads, length, head_dim, device=device, dtype=DTYPE, generator=generator)

    def forward() -> None:
        with torch.no_grad():
            kernel(q, k, v, causal)

    def forward_backward() -> None:
        kernel(q, k, v, causal).backward(grad)
        q.grad = k.grad = v.grad = None

    try:
        forward_backward()  # warm-up: kernel selection, workspaces, lazy initialisation
        fwd = _timed(forward, device, repeats)
        fwd_bwd = _timed(forward_backward, device, repeats)
        reset_peak(device)
        base = allocated(device)
        forward_backward()
        sync(device)
        peak = peak_allocated(device)
    except torch.OutOfMemoryError as err:  # the caller frees what this call held once it has returned
        return {"out_of_memory": str(err).splitlines()[0]}
    except Exception as err:  # one kernel's failure at one length leaves the other cells to run
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    return {"forward_s": fwd, "forward_backward_s": fwd_bwd,
            "peak_extra_bytes": None if peak is None else peak - base}  # fmt: skip


def measure(ctx: PartContext) -> dict[str, Any]:
    sizes, device = ctx.sizes, ctx.device
    m = sizes.model
    heads, kv_heads, head_dim = m["num_heads"], m["num_kv_heads"], m["hidden_size"] // m["num_heads"]
    repeats = sizes.attention_repeats
    rows, not_run = [], []
    longest = 0.0
    for length in sizes.attention_lengths:
        if rows and not ctx.deadline.allows(4 * longest):  # a length costs about 4x the one before (L^2)
            not_run.append(length)
            continue
        started = time.perf_counter()
        for block, causal in BLOCKS.items():
            for name, kernel in KERNELS.items():
                cell = measure_kernel(kernel, length, causal, heads, kv_heads, head_dim, device, repeats)
                rows.append({"length": length, "block": block, "kernel": name, **cell})
                release_memory(device)
        longest = time.perf_counter() - started
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(DTYPE).replace("torch.", ""),
            "rows": rows, "not_run_at_budget": not_run}  # fmt: skip


def _cell(rows: list[dict], length: int, block: str, kernel: str) -> dict:
    return next(r for r in rows if r["length"] == length and r["block"] == block and r["kernel"] == kernel)


def markdown(r: dict[str, Any], sizes: Sizes, card: Card) -> list[str]:
    out_rows = []
    for length in sorted({row["length"] for row in r["rows"]}):
        for block in BLOCKS:
            sdpa, ring = _cell(r["rows"], length, block, "sdpa"), _cell(r["rows"], length, block, "ring_block")

            def show(c: dict, key: str, fmt: Callable) -> str:
                return "OOM" if "out_of_memory" in c else "failed" if "error" in c else fmt(c[key])

            both = all("out_of_memory" not in c and "error" not in c for c in (sdpa, ring))
            ratio = f"{ring['forward_backward_s'] / sdpa['forward_backward_s']:.2f}" if both else "n/a"
            out_rows.append([f"{length:,}", block, show(sdpa, "forward_s", ms), show(ring, "forward_s", ms),
                             show(sdpa, "forward_backward_s", ms), show(ring, "forward_backward_s", ms), ratio,
                             show(sdpa, "peak_extra_bytes", size), show(ring, "peak_extra_bytes", size)])  # fmt: skip
    lines = [
        f"One block of L query and L key positions, batch 1, {r['heads']} query / {r['kv_heads']} KV heads of "
        f"{r['head_dim']}, {r['dtype']}; median of the timed calls after a warm-up; peak memory beyond the inputs "
        "during forward + backward. `ring_block`: `lightning_5d.parallel.context.ring` on one rank (the block "
        "kernel every cp rank runs per KV block). No target is set: the figures show what the block kernel costs "
        "against the fused kernel the model uses without cp.",
        "",
        *table(["L", "block", "SDPA fwd", "ring fwd", "SDPA fwd+bwd", "ring fwd+bwd", "ring / SDPA", "SDPA memory",
                "ring memory"], out_rows),  # fmt: skip
    ]
    failures = [f"L={c['length']} {c['block']} {c['kernel']}: `{c['error']}`" for c in r["rows"] if "error" in c]
    if failures:
        lines += ["", "Failed: " + "; ".join(failures) + "."]
    if r["not_run_at_budget"]:
        lines += ["", f"Lengths not run (part's time budget): {', '.join(str(n) for n in r['not_run_at_budget'])}."]
    return lines
