"""Head counts as the model declares them: a config object, or the attention module's attributes.

Models spell these many ways (``num_attention_heads``, ``n_head``, ``num_heads``...);
the tables below are the spellings recognized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_5d.plan import paths

# "heads": the einops / lucidrains spelling (rearrange(t, "b s (h d) -> b h s d", h=self.heads)).
HEADS_NAMES = ("num_attention_heads", "num_heads", "n_heads", "n_head", "heads")
KV_HEADS_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")
HEAD_DIM_NAMES = ("head_dim",)

# Attributes an attention module may reshape with. When their value is a full head
# count or a full head width, tensor parallelism must divide them by tp. Ratios such as
# num_key_value_groups and per-head sizes such as head_dim stay as they are.
HEAD_ATTRIBUTE_NAMES = (
    "num_heads",
    "heads",
    "n_heads",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "kv_heads",
    "split_size",
    "embed_dim",
    "hidden_size",
    "all_head_size",
    "inner_dim",
)


@dataclass(frozen=True)
class HeadCounts:
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    where: str = ""  # what declared them, for messages ("config.num_attention_heads")

    def __bool__(self) -> bool:
        return self.num_heads is not None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _first(obj: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        try:
            value = _positive_int(getattr(obj, name, None))
        except (TypeError, ValueError, KeyError):  # a property that cannot be computed
            continue
        if value is not None:
            return name, value
    return None


def from_object(obj: Any, label: str) -> HeadCounts:
    """Head counts stored on ``obj`` (a config, or an attention module) under known names."""
    heads = _first(obj, HEADS_NAMES)
    if heads is None:
        return HeadCounts()
    kv = _first(obj, KV_HEADS_NAMES)
    dim = _first(obj, HEAD_DIM_NAMES)
    parts = [f"{label}.{heads[0]}={heads[1]}"]
    parts += [f"{label}.{item[0]}={item[1]}" for item in (kv, dim) if item]
    return HeadCounts(heads[1], kv[1] if kv else None, dim[1] if dim else None, ", ".join(parts))


def config_of(module: nn.Module) -> Any:
    """The ``config`` object a module carries (read from its __dict__: no property side effects)."""
    config = vars(module).get("config")
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        # Multimodal Hugging Face configs keep the decoder's numbers in a sub-config.
        try:
            config = get_text_config()
        except (
            AttributeError,
            TypeError,
            ValueError,
        ):  # not a decoder config after all
            return config
    return config


def from_configs(root: nn.Module, path: str) -> HeadCounts:
    """Head counts of the nearest ``config`` on ``path`` or an ancestor of it."""
    chain = [path]
    while chain[-1]:
        chain.append(paths.parent(chain[-1]))
    for ancestor in chain:
        module = root.get_submodule(ancestor)
        config = config_of(module)
        if config is None:
            continue
        counts = from_object(config, paths.join(ancestor, "config"))
        if counts:
            return counts
    return HeadCounts()


def declared(root: nn.Module, attention_path: str) -> HeadCounts:
    """What the model declares for an attention module: its own attributes, else a config."""
    attention = root.get_submodule(attention_path)
    own = from_object(_AttributeView(attention), attention_path or type(attention).__name__)
    return own if own else from_configs(root, attention_path)


class _AttributeView:
    """Plain instance attributes of a module only (no submodules, no properties)."""

    def __init__(self, module: nn.Module) -> None:
        self._values = {k: v for k, v in vars(module).items() if not k.startswith("_")}

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None


def head_attributes(attention: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[str, ...]:
    """Known attributes of ``attention`` whose value is a full head count or head width.

    Each name once: tp divides every attribute named here, so a repeated name was divided twice
    (a merge left "heads" twice in the table; einops-style attention then used tp² fewer heads).
    """
    full = {num_heads, num_kv_heads, num_heads * head_dim, num_kv_heads * head_dim}
    values = vars(attention)
    return tuple(
        name for name in dict.fromkeys(HEAD_ATTRIBUTE_NAMES) if _positive_int(values.get(name)) is not None and values[name] in full
    )
