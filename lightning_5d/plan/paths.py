"""Dotted module paths: joining, nesting, and the patterns that name several at once.

The root module itself has the empty path, as in ``nn.Module.named_modules``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def parent(path: str) -> str:
    return path.rpartition(".")[0]


def leaf(path: str) -> str:
    """The last component that is not a list index (``to_out.0`` -> ``to_out``)."""
    for part in reversed(path.split(".")):
        if not part.isdigit():
            return part
    return path


def is_within(path: str, ancestor: str) -> bool:
    """``path`` is ``ancestor`` or inside it (everything is inside the root, "")."""
    return not ancestor or path == ancestor or path.startswith(ancestor + ".")


def relative_to(path: str, ancestor: str) -> str:
    if not ancestor:
        return path
    return path[len(ancestor) + 1 :] if path != ancestor else ""


def common_parent(paths: Iterable[str]) -> str:
    """The deepest module holding all of ``paths`` (of one path: its parent)."""
    split = [parent(p).split(".") if parent(p) else [] for p in paths]
    if not split:
        return ""
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def block_index(path: str, blocks: str) -> tuple[int, str] | None:
    """(index, path inside the block) if ``path`` is inside block ``blocks.<index>``."""
    rest = relative_to(path, blocks) if is_within(path, blocks) and path != blocks else None
    if not rest:
        return None
    head, _, inside = rest.partition(".")
    if not head.isdigit():
        return None
    return int(head), inside


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``*`` matches one path component (a block index), ``**`` any number of them."""
    out = []
    for token in re.split(r"(\*\*|\*)", pattern):
        if token == "**":
            out.append(r".*")
        elif token == "*":
            out.append(r"[^.]*")
        else:
            out.append(re.escape(token))
    return re.compile("".join(out))
