"""Where checkpoints live on disk: publishing a finished one, the `latest` pointer, pruning.

A checkpoint is written under a hidden temporary name and renamed once every rank has
finished, so its final name only ever holds a complete checkpoint, and `latest` (a one-line
file replaced by rename) is updated after that: a process killed at any moment leaves the
previous `latest` pointing at a loadable checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

LATEST = "latest"
COMPLETE = "COMPLETE"  # written last inside a sharded checkpoint, before the rename
_STEP = re.compile(r"step=(\d+)")


def is_local(path: str | os.PathLike) -> bool:
    return "://" not in str(path)


def partial_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def is_complete(path: Path) -> bool:
    """A full-format file, or a sharded directory whose writers all finished."""
    return path.is_file() or (path.is_dir() and (path / COMPLETE).is_file())


def publish(partial: Path, final: Path) -> None:
    """Move a finished checkpoint to its final name; an older one there is removed only after."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        remove(old)
        os.replace(final, old)  # a directory cannot be replaced by rename in one step
    os.replace(partial, final)
    remove(old)


def update_latest(final: Path) -> None:
    """Point `latest` in final's folder at it, unless a newer step is already published there."""
    root = final.parent
    current = latest_checkpoint(root)
    if current is not None and current != final and _step_of(current) > _step_of(final) >= 0:
        return
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, root / LATEST)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `root`, or None when there is none (a first start)."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.name and is_complete(named):
            return named
    # No pointer (or it names something removed by hand): the highest complete step.
    candidates = [p for p in root.glob("*.ckpt") if not p.name.startswith(".") and is_complete(p)]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_step_of(p), p.stat().st_mtime))


def prune(root: Path, keep_last_k: int, pattern: str = "*.ckpt") -> list[Path]:
    """Remove all but the newest `keep_last_k` complete checkpoints (by step); never `latest`'s."""
    if keep_last_k < 0:
        return []
    latest = latest_checkpoint(root)
    # Only step-numbered checkpoints have an order; links (save_last="link") and names like
    # last.ckpt or epoch=3.ckpt are left alone.
    done = sorted(
        (p for p in root.glob(pattern) if _step_of(p) >= 0 and not p.is_symlink() and is_complete(p)), key=_step_of
    )
    doomed = [p for p in done[: max(len(done) - keep_last_k, 0)] if p != latest]
    for path in doomed:
        remove(path)
    return doomed


def remove_stale_partials(root: Path) -> None:
    """Leftovers of a killed save: they were never published, so nothing refers to them."""
    for path in root.glob(".*.partial"):
        remove(path)


def _step_of(path: Path) -> int:
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else -1


def remove(path: Path) -> None:
    """A checkpoint file or directory, if it is there (a link: the link only)."""
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
