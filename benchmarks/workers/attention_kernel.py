"""Attention kernels alone, one process: ``F.scaled_dot_product_attention`` vs ring attention's fused block.

Started by ``benchmarks/context_parallel_scaling.py`` in a fresh process, 1 thread, twice:
once for time (the default allocator), once with ``--memory`` for memory (glibc's mmap
threshold pinned low through ``MALLOC_MMAP_THRESHOLD_``, so that freed large tensors go back
to the OS and the resident set follows the live tensors; every large allocation then pays
its page faults, so that run is not timed). For each length ``L`` and kernel, causal
attention forward + backward on ``[1, heads, L, head_dim]`` fp32 tensors shaped as the
reference model passes them (K/V already repeated to the query heads):

- ``sdpa``: what the model runs without context parallelism (``is_causal=True``);
- ``ring``: ``lightning_5d.parallel.context.ring.ring_attention`` with no process group,
  i.e. one rank's diagonal block (the whole ``L × L`` causal block) through the fused block
  kernel, online-softmax merge and backward every cp rank runs on each of its blocks.

Measured after one warm-up call: the median time of ``--repeats`` forward + backward calls,
or (``--memory``) the peak resident-set growth of one call (``VmHWM`` reset through
``/proc/self/clear_refs`` before it, minus ``VmRSS`` then): the transient memory the kernel
needs beyond its inputs.
Writes one JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_5d.parallel.context.ring import ring_attention


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="measure peak RSS growth instead of time")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for length in args.lengths:
        shape = (1, args.heads, length, args.head_dim)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        kernels = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "ring": lambda: ring_attention(q, k, v, None, causal=True),
        }
        for name, kernel in kernels.items():

            def call() -> None:
                kernel().sum().backward()
                for t in (q, k, v):
                    t.grad = None

            call()  # warm-up: one-time allocations and lazy initialisation
            row = {"length": length, "kernel": name}
            if args.memory:
                peak_known = _reset_peak()
                before = _status("VmRSS")
                call()
                row["peak_growth_bytes"] = _status("VmHWM") - before if peak_known else None
            else:
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                row.update(fwd_bwd_s=statistics.median(times), times_s=times)
            rows.append(row)
    Path(args.out).write_text(json.dumps({"heads": args.heads, "head_dim": args.head_dim, "rows": rows}))


if __name__ == "__main__":
    main()
