"""Which run wrote each checkpoint of a folder, and in what order: ``lineage.json``.

A *run* is one training history; it keeps its id across requeues and restarts because a
resumed run takes the id stored in the checkpoint it resumes from (a fresh start draws a new
one). Each start of a run is a *branch*: ``resume`` counts the starts, ``parent`` names the
branch and step it resumed from. The *lineage* of a branch is its own checkpoints after the
ones of its ancestors up to each fork step, oldest first; a rollback's abandoned checkpoints
(an ancestor's, past the fork) and other runs' checkpoints are outside it. ``latest`` names
the newest checkpoint of the current lineage and ``keep_last_k`` prunes only inside it.

Only rank 0 writes the record, through a temporary file and a rename, after the checkpoint
it lists is published and before ``latest`` moves: a kill between the steps leaves a
published checkpoint that the record or ``latest`` does not name yet, never the reverse.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

LINEAGE = "lineage.json"
STAMP_KEY = "l5d_lineage"  # the key of a checkpoint's own stamp (Lightning's checkpoint dict / meta.pt)
FORMAT = 1


@dataclass(frozen=True)
class Branch:
    """One start of a run. ``parent``: {"branch": id, "step": n} of the checkpoint it resumed from."""

    id: str
    run: str
    resume: int = 0
    parent: Optional[dict] = None
    job: Optional[str] = None  # $SLURM_JOB_ID, for the reader of the record

    @classmethod
    def fresh(cls, job: Optional[str] = None) -> "Branch":
        return cls(id=_new_id(), run=_new_id(), job=job)

    @classmethod
    def resumed_from(cls, stamp: Optional[dict], job: Optional[str] = None) -> "Branch":
        """The branch that continues the checkpoint stamped ``stamp``; a checkpoint without a
        stamp (written before lineages existed) starts a run of its own."""
        if not isinstance(stamp, dict) or not {"run", "branch", "step"} <= set(stamp):
            return cls.fresh(job)
        parent = {"branch": str(stamp["branch"]), "step": int(stamp["step"])}
        return cls(id=_new_id(), run=str(stamp["run"]), resume=int(stamp.get("resume", 0)) + 1, parent=parent, job=job)

    def stamp(self, step: int) -> dict[str, Any]:
        """What a checkpoint written at ``step`` by this branch carries, so a resume can continue it."""
        return {"run": self.run, "branch": self.id, "resume": self.resume, "step": int(step)}


def _new_id() -> str:
    return uuid.uuid4().hex[:12]


def read(root: Path) -> dict[str, Any]:
    """The folder's record ({"branches": {id: {...}}}); empty when there is none or it is unreadable."""
    path = Path(root) / LINEAGE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {"format": FORMAT, "branches": {}}
    except (OSError, ValueError) as err:
        log.warning("%s could not be read (%s); treating the folder as having no lineage record", path, err)
        return {"format": FORMAT, "branches": {}}
    if not isinstance(record, dict) or not isinstance(record.get("branches"), dict):
        log.warning("%s is not a lineage record; treating the folder as having none", path)
        return {"format": FORMAT, "branches": {}}
    return record


def write(root: Path, record: dict[str, Any]) -> None:
    # One temporary name per process: two runs writing into one folder never rename each
    # other's half-written file into place.
    tmp = Path(root) / f".{LINEAGE}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(root) / LINEAGE)


def add(root: Path, branch: Branch, name: str, step: int, size: Optional[int] = None) -> list[str]:
    """Record that ``branch`` published ``name`` at ``step``; returns notes for the log (the
    first checkpoint of a branch in a folder that holds checkpoints outside its lineage)."""
    root = Path(root)
    record = read(root)
    branches = record["branches"]
    notes: list[str] = []
    for other in branches.values():  # a name published again now holds this branch's checkpoint
        other["checkpoints"] = [e for e in other.get("checkpoints", []) if e.get("name") != name]
    if branch.id not in branches:
        branches[branch.id] = {
            "run": branch.run,
            "resume": branch.resume,
            "parent": branch.parent,
            "job": branch.job,
            "checkpoints": [],
        }
        notes = _outside_notes(root, record, branch)
    # seq: the folder's write order across branches (the newest written is the last `latest` named).
    seq = 1 + max((e.get("seq", 0) for b in branches.values() for e in b.get("checkpoints", [])), default=0)
    entry: dict[str, Any] = {"name": name, "step": int(step), "seq": seq}
    if size is not None:
        entry["size"] = int(size)
    branches[branch.id]["checkpoints"].append(entry)
    write(root, record)
    return notes


def lineage(record: dict[str, Any], branch_id: str, upto: Optional[int] = None) -> list[dict[str, Any]]:
    """The entries of ``branch_id``'s lineage, oldest first (``upto``: only steps <= it)."""
    branches, seen = record.get("branches", {}), set()
    chain: list[tuple[str, Optional[int]]] = []
    current: Optional[str] = branch_id
    while current is not None and current in branches and current not in seen:
        seen.add(current)
        chain.append((current, upto))
        parent = branches[current].get("parent") or {}
        current, upto = parent.get("branch"), parent.get("step")
    entries: list[dict[str, Any]] = []
    for bid, limit in reversed(chain):
        entries += [e for e in branches[bid].get("checkpoints", []) if limit is None or e.get("step", 0) <= limit]
    return entries


def newest_first(record: dict[str, Any]) -> list[str]:
    """Every recorded name, the most recently written first."""
    entries = [e for b in record.get("branches", {}).values() for e in b.get("checkpoints", [])]
    return [e["name"] for e in sorted(entries, key=lambda e: e.get("seq", 0), reverse=True)]


def branch_of(record: dict[str, Any], name: str) -> Optional[str]:
    for bid, branch in record.get("branches", {}).items():
        if any(e.get("name") == name for e in branch.get("checkpoints", [])):
            return bid
    return None


def entry_of(record: dict[str, Any], name: str) -> Optional[dict[str, Any]]:
    bid = branch_of(record, name)
    if bid is None:
        return None
    return next(e for e in record["branches"][bid]["checkpoints"] if e.get("name") == name)


def _outside_notes(root: Path, record: dict[str, Any], branch: Branch) -> list[str]:
    mine = {e["name"] for e in lineage(record, branch.id)}
    outside: dict[str, list[str]] = {}
    for bid, other in record["branches"].items():
        for e in other.get("checkpoints", []):
            if e["name"] not in mine and (root / e["name"]).exists():
                outside.setdefault(other.get("run", "?"), []).append(e["name"])
    notes = []
    for run, names in outside.items():
        what = "an abandoned branch of this run (a rollback)" if run == branch.run else f"another run ({run})"
        notes.append(
            f"{root} holds {len(names)} checkpoint(s) of {what}: {', '.join(names[:6])}"
            f"{' ...' if len(names) > 6 else ''}. They are kept and keep_last_k never removes them; `latest` now "
            f"follows this run (id {branch.run}, start {branch.resume}). Delete them by hand when no longer needed."
        )
    return notes
