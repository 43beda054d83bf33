"""Where checkpoints live on disk: publishing a finished one, the `latest` pointer, pruning.

A checkpoint is written under a hidden temporary name and renamed once every rank has
finished, so its final name only ever holds a complete checkpoint, and `latest` (a one-line
file replaced by rename) is updated after that: a process killed at any moment leaves the
previous `latest` pointing at a loadable checkpoint. ``lineage.json`` (lineage.py) says which
run wrote which checkpoint: `latest` and pruning follow the current run's lineage, and a
damaged newest checkpoint gives way to the newest intact one of the same lineage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from lightning_5d.checkpoint import lineage
from lightning_5d.checkpoint.lineage import Branch

log = logging.getLogger(__name__)

LATEST = "latest"
COMPLETE = "COMPLETE"  # written last inside a sharded checkpoint, before the rename
_STEP = re.compile(r"step=(\d+)")
_EDGE = 1 << 16  # bytes hashed at each end of a file: an older step's same-sized copy differs there


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


def update_latest(final: Path, branch: Optional[Branch] = None, step: Optional[int] = None) -> list[str]:
    """Record ``final`` in the folder's lineage (when ``branch`` is given) and point `latest` at it.

    With a branch, `latest` always moves: the checkpoint just published is the newest of the
    current lineage, whatever its step (a rollback or a re-run writes lower steps). Without
    one (a caller that knows no run), `latest` never moves back to a lower step. Returns the
    notes the lineage record has for the log.
    """
    root = final.parent
    notes: list[str] = []
    if branch is not None:
        size = final.stat().st_size if final.is_file() else None
        notes = lineage.add(root, branch, final.name, _step_of(final) if step is None else step, size)
    else:
        current = latest_checkpoint(root, quiet=True)
        if current is not None and current != final and _step_of(current) > _step_of(final) >= 0:
            return notes
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, root / LATEST)
    return notes


def latest_checkpoint(root: str | os.PathLike, quiet: bool = False) -> Path | None:
    """The newest intact checkpoint in `root`, or None when there is none (a first start).

    `latest` names it. When the one it names is damaged (a file missing, truncated or from
    another save), the newest intact checkpoint of the same lineage is returned instead, with
    a warning naming the damaged file; `latest` itself is left for the next save to move.
    """
    root = Path(root)
    pointer = root / LATEST
    record = lineage.read(root) if root.is_dir() else {"branches": {}}
    named = _pointer_target(pointer)
    if named is not None and (is_complete(named) or lineage.branch_of(record, named.name) is not None):
        problem = damage(named, record) if is_complete(named) else f"{named} is missing or incomplete"
        if problem is None:
            return named
        fallback = _intact_before(root, named, record)
        if not quiet:
            log.warning(
                "`latest` in %s names a damaged checkpoint: %s; %s", root, problem,
                f"falling back to {fallback.name}, the newest intact one of its lineage" if fallback
                else "no intact checkpoint of its lineage is left",  # fmt: skip
            )
        return fallback
    # No pointer (a kill before the first one was written), or it names something unrecorded
    # that is gone: the most recently written intact checkpoint the record lists, else the
    # highest intact step.
    for name in lineage.newest_first(record):
        path = root / name
        if is_complete(path) and damage(path, record) is None:
            return path
    candidates = [
        p for p in root.glob("*.ckpt") if not p.name.startswith(".") and is_complete(p) and damage(p, record) is None
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_step_of(p), p.stat().st_mtime))


def _pointer_target(pointer: Path) -> Path | None:
    """The checkpoint `latest` names; only a name inside its own folder is followed."""
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not name:
        return None
    if name != Path(name).name or name in (".", ".."):
        log.warning("%s names %r, which is not a checkpoint in its own folder; ignoring it", pointer, name)
        return None
    return pointer.parent / name


def _intact_before(root: Path, damaged: Path, record: dict) -> Path | None:
    """The newest intact checkpoint of ``damaged``'s lineage written before it (or by step, unrecorded)."""
    branch = lineage.branch_of(record, damaged.name)
    if branch is not None:
        names = [e["name"] for e in lineage.lineage(record, branch)]
        older = names[: names.index(damaged.name)] if damaged.name in names else names
        for name in reversed(older):
            path = root / name
            if is_complete(path) and damage(path, record) is None:
                return path
        return None
    step = _step_of(damaged)
    older = [p for p in root.glob("*.ckpt") if p != damaged and not p.name.startswith(".") and 0 <= _step_of(p) < step]
    older = [p for p in older if is_complete(p) and damage(p, record) is None]
    return max(older, key=_step_of) if older else None


# ---------------------------------------------------------------------------- stamps
def stamp_files(directory: Path, step: int) -> str:
    """The COMPLETE marker of a sharded checkpoint: its step and each file's size and edge hash."""
    stamps = {
        p.name: {"size": p.stat().st_size, "edges": _edges(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != COMPLETE
    }
    return json.dumps({"step": int(step), "files": stamps}, indent=1) + "\n"


def damage(path: Path, record: Optional[dict] = None) -> str | None:
    """Why a complete-looking checkpoint cannot be loaded as written, naming the file; None if intact.

    A sharded directory is checked against the stamps in its COMPLETE marker (markers written
    before stamps existed say only "ok": nothing to check); a full-format file against the size
    the lineage record holds for it.
    """
    if path.is_dir():
        try:
            text = (path / COMPLETE).read_text()
        except OSError as err:
            return f"{path / COMPLETE} could not be read ({err})"
        if not text.lstrip().startswith("{"):
            return None
        try:
            stamps = json.loads(text)["files"]
        except (ValueError, KeyError, TypeError) as err:
            return f"{path / COMPLETE} is not a completion stamp ({type(err).__name__}: {err})"
        for name, stamp in stamps.items():
            file = path / name
            if not file.is_file():
                return f"{file} is missing"
            size = file.stat().st_size
            if size != stamp["size"]:
                return f"{file} has {size} bytes, {stamp['size']} were written (truncated or replaced)"
            if _edges(file) != stamp["edges"]:
                return f"{file} differs from the file written at save (copied in from another checkpoint?)"
        return None
    if path.is_file():
        entry = lineage.entry_of(record if record is not None else lineage.read(path.parent), path.name)
        if entry is not None and "size" in entry and path.stat().st_size != entry["size"]:
            return f"{path} has {path.stat().st_size} bytes, {entry['size']} were written (truncated or replaced)"
        return None
    return f"{path} does not exist"


def _edges(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE))
        size = f.seek(0, os.SEEK_END)
        if size > _EDGE:
            f.seek(max(size - _EDGE, _EDGE))
            digest.update(f.read(_EDGE))
    return digest.hexdigest()


def prune(root: Path, keep_last_k: int, pattern: str = "*.ckpt", branch: Optional[Branch] = None) -> list[Path]:
    """Remove all but the newest `keep_last_k` complete checkpoints; never `latest`'s.

    With ``branch``: only checkpoints of its lineage count and go, in write order, so a
    rollback or another run's checkpoints are never removed in favour of each other. Without
    (a folder with no record of who wrote what): step-numbered checkpoints, by step. Either
    way only ``step=N`` names are pruned: links (save_last="link") and names like last.ckpt
    or epoch=3.ckpt are left alone.
    """
    if keep_last_k < 0:
        return []
    latest = latest_checkpoint(root, quiet=True)
    record = lineage.read(root) if branch is not None else {}
    if branch is not None and record["branches"] and branch.id not in record["branches"]:
        # The folder records lineages but not this run's (another writer's record replaced ours):
        # ranking every checkpoint by step could delete another run's work, so prune nothing.
        log.warning("%s: this run is not in the folder's lineage record; keep_last_k prunes nothing", root)
        return []
    if branch is not None and branch.id in record["branches"]:
        named = [root / e["name"] for e in lineage.lineage(record, branch.id)]
        done = [
            p
            for p in dict.fromkeys(named)
            if p.match(pattern) and _step_of(p) >= 0 and not p.is_symlink() and is_complete(p)
        ]
    else:
        done = sorted(
            (p for p in root.glob(pattern) if _step_of(p) >= 0 and not p.is_symlink() and is_complete(p)),
            key=_step_of,
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
