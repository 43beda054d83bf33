"""Where a hung process waits: its threads' Python and native stacks, for a launcher's report.

A rank stuck inside a C++ call (a gloo collective, a process group's shutdown) shows nothing
in its output, and the launcher that stops it at its time limit then reports only the time.
Two views are collected before it is stopped:

- Python: :func:`faulthandler.register` on :data:`DUMP_SIGNAL` makes the process write every
  thread's Python stack to its stderr when signalled. faulthandler writes from the signal
  handler without taking the GIL, so it works while the main thread is inside C++.
- native: ``gdb -batch`` attached for a moment (when gdb is installed): each thread's C/C++
  frames, which say which collective or which lock a thread waits in.
"""

from __future__ import annotations

import faulthandler
import shutil
import signal
import subprocess

# SIGUSR1 is SLURM's requeue signal (Lightning's SLURM environment and lightning_5d.requeue).
DUMP_SIGNAL = signal.SIGUSR2


def dump_python_stacks_on_signal() -> None:
    """In a rank: write every thread's Python stack to stderr on :data:`DUMP_SIGNAL`."""
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)


def native_stacks(pid: int, frames: int = 16, timeout_s: float = 60.0) -> str:
    """Each thread's innermost ``frames`` native frames of process ``pid`` (gdb attached for a
    moment, about 5 s for a process that loaded torch); a line saying why not when gdb is
    missing or cannot attach."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no native stacks: gdb is not installed)\n"
    command = [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off", "-ex", f"thread apply all bt {frames}"]
    try:
        found = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"(no native stacks: gdb did not finish in {timeout_s:.0f} s)\n"
    # gdb's own chatter (symbol loading, "[New LWP ...]") before the first thread is noise.
    lines = found.stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("Thread ")), None)
    if first is None:
        return f"(no native stacks: gdb could not attach: {(found.stderr or found.stdout).strip()[-300:]})\n"
    return "\n".join(lines[first:]) + "\n"
