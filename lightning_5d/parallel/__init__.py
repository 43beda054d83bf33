"""The five dimensions, one package each, applied by the strategy in a fixed order
(``lightning_5d.dimensions``): fp8 -> ``tensor`` -> ``expert`` -> ``context`` ->
activation checkpointing -> ``pipeline`` -> ``data`` (ZeRO/FSDP2).

Every package names its public entry in its ``__init__``; the modules inside keep the math
(shapes, index ranges, schedules) apart from the collectives. Shared by all of them:
``grad_norm`` (one global gradient norm over every split) and ``activation_checkpoint``.
"""
