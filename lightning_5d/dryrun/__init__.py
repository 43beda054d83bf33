"""Start-up dry run: the bytes each rank of a layout would hold, without processes or memory.

:mod:`.rank_mesh` (a rank's mesh coordinates), :mod:`.holdings` (its model cut on the meta
device by the strategy's own steps), :mod:`.state` (ZeRO's bytes per tensor),
:mod:`.startup` (every rank, grouped), :mod:`.prediction` (the planner's numbers for the same
pieces) and :mod:`.recipe` (``l5d train recipe=<name> --dry-run``).
"""
