"""How much data-parallel traffic compute hides, following what the runtime actually overlaps.

A stream (the playbook's bucketed overlap): k equal pieces (DP buckets; ZeRO-3 layer units)
become ready at an even pace over a compute window W and go out one after another on one link,
T seconds in all. The last piece can start only when the window ends, and if the link is the
slower side the stream runs T from the first piece (ready at W/k). So the stream ends

    exposed = max(T/k, T - W·(1 - 1/k))

after the window: at least one piece is always on the critical path, and overlap is never
perfect. The windows, per ZeRO stage, are those of ``lightning_5d/parallel/data/zero.py`` (stages
0-2) and FSDP2 (stage 3):

* Z0 gradient all-reduce, Z1 reduce-scatter: once per step, buckets launched as the last
  microbatch's backward produces them; window = that backward.
* Z2 reduce-scatter: every microbatch, waited for at the end of each backward (the autograd
  callback), so the window is one microbatch's backward, per microbatch.
* Z1/Z2 all-gather of the updated parameters: launched and waited for in the optimizer's
  post-step hook, before the next forward - fully exposed.
* Z1/Z2 HSDP all-reduce across replicas: launched after the reduce-scatters are waited for -
  fully exposed.
* Z3 (FSDP2, which prefetches the next layer): gathers, reduce-scatters and the HSDP
  all-reduce are per layer and spread over the whole microbatch (forward and backward); one
  stream per microbatch with window = that microbatch's compute.

The backward's share of a microbatch is (hardware FLOPs - forward model FLOPs) / hardware
FLOPs: 2/3 without recompute, more with it (the recomputed forward runs inside backward).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_5d.config import ZeroStage

from .comm import Collective, CommEntry


def stream_exposed(total_s: float, pieces: int, window_s: float) -> float:
    """Seconds a stream of ``pieces`` pieces, ``total_s`` of link time, outlasts a ``window_s`` window."""
    if total_s <= 0:
        return 0.0
    k = max(1, pieces)
    return max(total_s / k, total_s - window_s * (1 - 1 / k))


def data_parallel_exposed(
    entries: Sequence[CommEntry],
    seconds: Sequence[float],
    zero: ZeroStage,
    microbatches: int,
    compute_s: float,
    backward_share: float,
) -> float:
    """Exposed seconds of the ``dp`` entries (``seconds[i]`` = link time of ``entries[i]`` per step).

    ``compute_s`` is the step's compute on one rank (bubble-free), run as ``microbatches``
    equal microbatches.
    """
    per_microbatch = compute_s / max(1, microbatches)
    backward = per_microbatch * backward_share
    exposed = 0.0
    pooled_s, pooled_launches = 0.0, 0  # ZeRO-3: every dp collective of the step, one stream per microbatch
    for entry, t in zip(entries, seconds, strict=True):
        if entry.dim != "dp" or t <= 0:
            continue
        if zero == ZeroStage.PARAMETERS:
            pooled_s += t
            pooled_launches += entry.launches
        elif entry.collective == Collective.REDUCE_SCATTER or (
            entry.collective == Collective.ALL_REDUCE and zero == ZeroStage.NONE
        ):
            # Gradient buckets streamed behind one backward, once per call.
            exposed += entry.calls * stream_exposed(t / entry.calls, entry.launches_per_call, backward)
        else:
            exposed += t  # Z1/Z2 post-step all-gather, HSDP replica all-reduce: nothing to hide behind
    if pooled_s > 0:
        m = max(1, microbatches)
        exposed += m * stream_exposed(pooled_s / m, max(1, pooled_launches // m), per_microbatch)
    return exposed
