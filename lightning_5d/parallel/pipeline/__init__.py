"""Pipeline parallelism: layers cut into S = p·v stages over the p pipeline ranks.

Public entry: :class:`PipelineParallel` (``stages``, this rank's v stages and the torch
schedule that runs them) and :class:`PipelineLoop` (``loop``, one Lightning batch as one
pipeline run of m microbatches). Playbook symbols: p ranks, v stages per rank, m
microbatches; bubble (p−1)/m for AFAB and 1F1B, (p−1)/(v·m) interleaved.

* ``split``: which contiguous blocks each stage holds (balanced by weight).
* ``schedule``: the torch schedule class per ``pipeline.schedule``; where stages live and
  what each schedule accepts is torch-free arithmetic in ``lightning_5d.pipeline_shape``.
* ``batch``: microbatches in, one step output and one logged value per name out.
* ``actions``: the per-rank action lists torch computes, and their simulation (drawings).
* ``fsdp``: ZeRO-3 units that reduce-scatter once per run instead of m times.
* ``failure``: a training run in which one rank raised: stand-ins keep the schedule's
  hand-offs going, one flag at the run's end makes every rank raise the failing rank's error.
* ``forward_only``: validation, test, predict: the stages in order, a failure flag in each hand-off.
"""

from lightning_5d.parallel.pipeline.batch import PipelineError
from lightning_5d.parallel.pipeline.failure import PipelinePeerError
from lightning_5d.parallel.pipeline.loop import PipelineLoop
from lightning_5d.parallel.pipeline.stages import PipelineMode, PipelineParallel

__all__ = ["PipelineError", "PipelineLoop", "PipelineMode", "PipelineParallel", "PipelinePeerError"]
