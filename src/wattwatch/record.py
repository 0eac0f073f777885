"""Frozen records for what every command imports (its settings, its tables), without ``dataclasses``.

``dataclasses`` imports ``inspect`` and with it ``ast``, ``dis`` and ``tokenize``: 7 ms of a ``wattwatch
report`` that has 200 ms to answer (benchmarks/report_startup.py), for classes that need only an
``__init__``, equality, a hash, a repr and immutability. ``@record`` gives those, read from the class's
annotations and defaults as ``@dataclass(frozen=True)`` would (type checkers treat it as one through
``dataclass_transform``); ``replace`` and ``field_names`` stand in for ``dataclasses.replace`` and
``dataclasses.fields``. The agent and the collector, which import far more, keep using ``dataclasses``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform

T = TypeVar("T")

_FIELDS = "__record_fields__"


class FrozenRecordError(AttributeError):
    """An attempt to change a record's field."""


class _Factory:
    """A default computed for each instance (``field(default_factory=...)``)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def field(*, default_factory: Callable[[], T]) -> T:
    """A field whose default is ``default_factory()``, called for each instance that is not given one."""
    return _Factory(default_factory)  # type: ignore[return-value]


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen record of its annotated fields, in order (those with a default after those
    without), calling ``__post_init__`` after ``__init__`` when the class has one.

    Narrower than dataclasses, on purpose: the class's own annotations only (no inherited fields), a
    class variable annotated ``ClassVar[...]`` under ``from __future__ import annotations``, no ordering,
    ``InitVar`` or ``__match_args__``."""
    own = cls.__dict__.get("__annotations__", {})  # noqa: RUF063 - importing inspect is what this module avoids
    names = [n for n, kind in own.items() if not str(kind).startswith("ClassVar")]
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    params, body = [], []
    seen_default = False
    for n in names:
        if n in defaults:
            seen_default = True
            params.append(f"{n}=_D[{n!r}]")
        elif seen_default:
            raise TypeError(f"{cls.__name__}: field {n!r} without a default follows one with a default")
        else:
            params.append(n)
        value = f"_D[{n!r}].make() if {n} is _D[{n!r}] else {n}" if isinstance(defaults.get(n), _Factory) else n
        body.append(f"  _set(self, {n!r}, {value})")
    if hasattr(cls, "__post_init__"):
        body.append("  self.__post_init__()")
    # One generated __init__ with the real signature: positional and keyword calls, and TypeErrors for a
    # missing or unknown argument, behave as a dataclass's.
    source = f"def __init__(self, {', '.join(params)}):\n" + ("\n".join(body) or "  pass")
    scope: dict[str, Any] = {"_D": defaults, "_set": object.__setattr__}
    exec(source, scope)  # the source holds only the class's own field names, as dataclasses' does
    for n, default in defaults.items():
        if isinstance(default, _Factory):
            delattr(cls, n)  # as dataclasses does: the class keeps plain defaults, not factories
    setattr(cls, _FIELDS, tuple(names))
    methods = {
        "__init__": scope["__init__"],
        "__setattr__": _frozen,
        "__delattr__": _frozen,
        "__eq__": _eq,
        "__hash__": _hash,
        "__repr__": _repr,
    }
    for name, method in methods.items():
        setattr(cls, name, method)
    return cls


def _values(obj: object) -> tuple[Any, ...]:
    return tuple(getattr(obj, n) for n in getattr(obj, _FIELDS))


def _frozen(self: object, name: str, *value: object) -> None:
    raise FrozenRecordError(f"cannot assign to field {name!r} of a {type(self).__name__}: it is frozen")


def _eq(self: object, other: object) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return bool(_values(self) == _values(other))


def _hash(self: object) -> int:
    return hash(_values(self))


def _repr(self: object) -> str:
    inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in getattr(self, _FIELDS))
    return f"{type(self).__qualname__}({inner})"


def field_names(cls_or_obj: object) -> tuple[str, ...]:
    """The field names of a record class (or of a record), in order."""
    names: tuple[str, ...] = getattr(cls_or_obj, _FIELDS)
    return names


def replace(obj: T, **changes: Any) -> T:
    """A copy of the record ``obj`` with ``changes``; TypeError for a name that is not a field."""
    unknown = set(changes) - set(field_names(obj))
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    values = {n: getattr(obj, n) for n in field_names(obj)}
    return type(obj)(**{**values, **changes})
