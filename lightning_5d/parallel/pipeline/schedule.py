"""Which torch schedule runs each ``pipeline.schedule``.

The runtime (``stages``) and the schedule drawings (``l5d schedule``, through ``actions``)
both start from :func:`schedule_class`, so the picture is of the schedule that runs. Where
the stages live and what each schedule accepts is plain arithmetic, in
``lightning_5d.pipeline_shape``.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_5d.config import PipelineSchedule

# afab is GPipe; zero_bubble is ZB-H1 written as torch's interleaved zero-bubble schedule,
# which with v=1 is the single-chunk ZB-H1 of Qi et al. (B and W split, W filling the drain).
_CLASSES = {
    PipelineSchedule.AFAB: "ScheduleGPipe",
    PipelineSchedule.ONE_F_ONE_B: "Schedule1F1B",
    PipelineSchedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    PipelineSchedule.ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
    PipelineSchedule.ZBV: "ScheduleZBVZeroBubble",
    PipelineSchedule.DUALPIPEV: "ScheduleDualPipeV",
}


def schedule_class(schedule: PipelineSchedule | str) -> type:
    return getattr(torch_schedules, _CLASSES[PipelineSchedule(schedule)])
