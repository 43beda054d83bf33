"""The first thing an ``l5d train`` worker runs: catch the requeue signals before any import.

torchrun starts ``python <this file> [--catch SIGUSR1,SIGTERM] <run dir>/resolved.yaml``.
Importing torch and Lightning, building the model and restoring a checkpoint take seconds to
minutes; a SLURM preemption notice (SIGTERM, or ``--signal=USR1@<s>``) arriving then would end
the worker by the signal's default action, and SLURM would never be asked to requeue. So the
signals are only recorded here, with the standard library alone, and handed to the requeue
handler once the config is read (``SignalFlag.take_over`` in lightning_5d/requeue.py), which
acts on them at the first optimizer step. A script rather than ``-m lightning_5d.worker``:
``-m`` imports the package, and with it torch, before any line of the module runs.
"""

import os
import signal
import sys


def catch(names: str) -> tuple[dict, list]:
    """Record ``names`` (comma-separated) from now on: ({signal: previous handler}, [signals received])."""
    received: list = []

    def remember(signum, frame):  # only a list append: safe at any point of the interpreter
        received.append(signal.Signals(signum))

    previous = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        signum = signal.Signals[name]
        previous[signum] = signal.signal(signum, remember)
    return previous, received


if __name__ == "__main__":
    argv = sys.argv[1:]
    early = catch(argv[1]) if argv[:1] == ["--catch"] else None
    argv = argv[2:] if early is not None else argv
    # This file's folder is the package itself: its modules must not shadow top-level ones.
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)
    from lightning_5d.worker import main

    sys.exit(main(argv, early=early))
