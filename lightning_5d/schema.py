"""Declarative settings: each field's type and range written once, checked by pydantic.

The settings classes (``lightning_5d.config``) are dataclasses whose field annotations carry
the type, the range and the text of the allowed values (``Allowed``). :func:`settings` turns
such a class into a pydantic dataclass that refuses unknown keys and reports every problem as
one error of the caller's class, naming the field (dotted for nested sections), the value and
what is allowed. Helpers here build the annotations that pydantic's lax mode would get wrong
for configuration: enums given by member, value or name (jsonargparse writes names), numbers
that refuse ``True``/``False``, floats that refuse nan and inf, booleans that refuse ``"yes"``.
"""

from __future__ import annotations

import functools
import math
import operator
from enum import Enum, IntEnum
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Callable, TypeVar, get_args, get_origin

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

T = TypeVar("T")

# Unknown keys are errors; a value is never silently converted to a string.
_CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=False)


class Allowed:
    """The allowed values of a field, in words; shown in every error about that field."""

    def __init__(self, text: str) -> None:
        self.text = text


def choices_text(enum_cls: type[Enum]) -> str:
    values = ", ".join(repr(m.value) for m in enum_cls)
    return f"one of {values} (or a {enum_cls.__name__} member, or its name)"


def enum_member(enum_cls: type[Enum], value: Any) -> Enum:
    """``value`` as a member of ``enum_cls``: the member, its value, or its name in any case.

    Names matter because jsonargparse (LightningCLI) writes Enum defaults by name.
    """
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, bool):  # True == 1 would otherwise pick ZeroStage.OPTIMIZER
        raise ValueError("a boolean is not a choice")
    if isinstance(value, Enum):  # a member of a look-alike enum: compare by value
        value = value.value
    if issubclass(enum_cls, IntEnum) and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if issubclass(enum_cls, IntEnum) and not isinstance(value, (int, str)) and hasattr(value, "__index__"):
        value = operator.index(value)  # numpy integers, e.g. a sweep over np.arange
    for member in enum_cls:
        if type(value) is type(member.value) and value == member.value:
            return member
        if isinstance(value, int) and issubclass(enum_cls, IntEnum) and value == member.value:
            return member
        if isinstance(value, str) and value.casefold() in (member.name.casefold(), str(member.value).casefold()):
            return member
    raise ValueError(f"not a value or name of {enum_cls.__name__}")


def EnumField(enum_cls: type[Enum]) -> Any:
    """Annotation of an enum field that takes a member, a value or a name."""
    return Annotated[enum_cls, BeforeValidator(functools.partial(enum_member, enum_cls)), Allowed(choices_text(enum_cls))]


def _refuse_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


def Int(*, ge: int | None = None, allowed: str) -> Any:
    return Annotated[int, BeforeValidator(_refuse_bool), Field(ge=ge), Allowed(allowed)]


def Float(*, gt: float | None = None, ge: float | None = None, allowed: str) -> Any:
    """A finite float (nan and inf refused), optionally bounded below."""
    return Annotated[float, BeforeValidator(_refuse_bool), Field(gt=gt, ge=ge, allow_inf_nan=False), Allowed(allowed)]


def Bool(allowed: str = "true or false") -> Any:
    return Annotated[StrictBool, Allowed(allowed)]


def Optional_(annotation: Any, allowed: str) -> Any:
    """``annotation | None``; the allowed text covers both."""
    return Annotated[annotation | None, Allowed(allowed)]


def _plain(value: Any) -> Any:
    """Other mappings and sequences as dicts and lists, which pydantic validates.

    Hydra hands the strategy OmegaConf's DictConfig / ListConfig (a ``parallel:`` section of a
    recipe, ``dict(cfg.parallel)`` with its nested sections); users may pass a MappingProxyType.
    Plain values return before the ABC checks: ``isinstance(3, Mapping)`` walks every registered
    subclass of ``Mapping`` once per new type and caches the answer in each (~80 KiB per process
    for a strategy's arguments, measured in benchmarks/startup_memory.py).
    """
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(item) for item in value]
    return value


def settings(error: type[Exception], name: str | None = None) -> Callable[[type[T]], type[T]]:
    """Class decorator: a validating dataclass whose errors are ``error`` with readable messages.

    Nested settings classes are validated by the outer class (a mapping becomes the nested
    dataclass), so one error lists every bad field with its dotted path.
    """

    def wrap(cls: type[T]) -> type[T]:
        cls = pydantic_dataclass(cls, config=_CONFIG)
        validate = cls.__init__

        @functools.wraps(validate)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            args, kwargs = tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}
            try:
                validate(self, *args, **kwargs)
            except ValidationError as err:
                raise error(explain(cls, err, name or cls.__name__)) from None

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    return wrap


# --------------------------------------------------------------------------- messages


def _allowed(annotation: Any) -> str | None:
    if get_origin(annotation) is Annotated:
        for meta in reversed(get_args(annotation)[1:]):
            if isinstance(meta, Allowed):
                return meta.text
        return _allowed(get_args(annotation)[0])
    return None


def _nested(annotation: Any) -> type | None:
    """The settings dataclass a field holds, if any (``X`` or ``X | None``)."""
    if isinstance(annotation, type) and hasattr(annotation, "__pydantic_fields__"):
        return annotation
    for arg in get_args(annotation):
        found = _nested(arg)
        if found is not None:
            return found
    return None


def _is_mapping(annotation: Any) -> bool:
    """Whether the field holds a dict (then the location's next element is a key)."""
    if get_origin(annotation) is dict:
        return True
    return any(_is_mapping(arg) for arg in get_args(annotation) if not isinstance(arg, Allowed))


def _field_annotation(cls: type, name: str) -> Any:
    info = cls.__pydantic_fields__[name]  # type: ignore[attr-defined]
    if info.metadata:
        return Annotated[(info.annotation, *info.metadata)]
    return info.annotation


def _show(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def explain(cls: type, err: ValidationError, top: str) -> str:
    """One line per bad field: ``field=value is not valid: why; allowed: what``."""
    lines: list[str] = []
    unknown: dict[tuple[str, ...], list[str]] = {}
    unknown_where: dict[tuple[str, ...], type] = {}
    seen: set[tuple[str, ...]] = set()
    for item in err.errors(include_url=False):
        path: list[str] = []
        owner: type | None = cls
        annotation: Any = None
        rest = list(item["loc"])
        while rest and owner is not None and isinstance(rest[0], str) and rest[0] in owner.__pydantic_fields__:
            path.append(rest.pop(0))
            annotation = _field_annotation(owner, path[-1])
            owner = _nested(annotation)
        if item["type"] in ("unexpected_keyword_argument", "unexpected_positional_argument"):
            # The key is the first location element that is not a field of `owner`.
            key = rest[0] if rest else "?"
            where = _nested(annotation) if path else cls
            unknown.setdefault(tuple(path), []).append(str(key))
            unknown_where[tuple(path)] = where or cls
            continue
        index = "".join(f"[{r!r}]" for r in rest if isinstance(r, int) or (_is_mapping(annotation) and r != "[key]"))
        field_name = ".".join(path) + index or top
        if (field_name,) in seen:  # a union reports each member; one line per field is enough
            continue
        seen.add((field_name,))
        reason = item["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if item["type"] == "dataclass_type" and owner is not None:
            allowed = f"a mapping with keys {sorted(owner.__pydantic_fields__)}, or a {owner.__name__}"
        else:
            allowed = _allowed(annotation) if annotation is not None else None
        text = f"{field_name}={_show(item.get('input'))} is not valid: {reason}"
        lines.append(text + (f"; allowed: {allowed}." if allowed else "."))
    for path, keys in unknown.items():
        owner = unknown_where[path]
        where = ".".join(path) or top
        lines.append(
            f"Unknown key(s) {sorted(keys)} in `{where}`; valid keys are {sorted(owner.__pydantic_fields__)}."
        )
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} invalid settings:\n  " + "\n  ".join(lines)
