"""Models built on the meta device: record their initialization, materialize each rank's pieces.

See :mod:`.record` (what the build records), :mod:`.replay` (one tensor's full value, exact
to a single-process CPU build), :mod:`.chunks` (the same value in row chunks, keeping the
rank's region), :mod:`.apply` (capture before the dimensions, materialize
after them) and :mod:`.build` (the strategy's handle); freed pages go back to the OS through
:mod:`lightning_5d.heap`.
"""

from lightning_5d.materialize.apply import MaterializeError, has_meta
from lightning_5d.materialize.build import MetaBuild
from lightning_5d.materialize.record import InitLog, recording
from lightning_5d.materialize.replay import Replay

__all__ = ["InitLog", "MaterializeError", "MetaBuild", "Replay", "has_meta", "recording"]
