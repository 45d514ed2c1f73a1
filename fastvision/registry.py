"""Name -> builder registries for models, datasets, tasks and losses.

Builders are plain functions (or classes). ``Registry.build`` checks keyword arguments against the
builder's signature, so a typo in a recipe becomes a one-line error listing the valid keys instead
of a ``TypeError`` deep inside a constructor.
"""
from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from fastvision.errors import ConfigError, did_you_mean


class Registry:
    """A named collection of builders.

    Args:
        kind: what the entries are, used in error messages ("model", "dataset", ...).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable[..., Any]] = {}
        self._hidden: set[str] = set()

    def register(self, name: str | None = None, hidden: bool = False) -> Callable[[Callable], Callable]:
        """Decorator storing a builder under ``name`` (default: the function name, ``_`` -> ``-``);
        ``hidden``: built by name but not listed (a test model such as ``probe``)."""

        def deco(fn: Callable) -> Callable:
            key = name or fn.__name__.replace("_", "-")
            if key in self._entries and self._entries[key] is not fn:
                raise ValueError(f"{self.kind} {key!r} registered twice")
            self._entries[key] = fn
            if hidden:
                self._hidden.add(key)
            return fn

        return deco

    def replace(self, name: str, fn: Callable[..., Any]) -> None:
        """Put ``fn`` where the builder ``name`` was: a wrapper that extends a registered builder (e.g.
        the ImageFolder and COCO builders that also read shard sets). ``name`` must be registered."""
        if name not in self._entries:
            raise ValueError(f"{self.kind} {name!r} is not registered: nothing to replace")
        self._entries[name] = fn

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        """The listed names (the hidden ones still build)."""
        return sorted(set(self._entries) - self._hidden)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def defaults(self, name: str) -> dict[str, Any]:
        """Keyword defaults of a builder, for saving a fully resolved config."""
        out = {}
        for p in _params(self.get(name)):
            if p.default is not inspect.Parameter.empty:
                out[p.name] = p.default
        return out

    def build(self, name: str, kwargs: dict[str, Any] | None = None, where: str = "", **extra: Any) -> Any:
        """Call builder ``name`` with ``kwargs`` after checking names and simple types.

        Args:
            name: registered name.
            kwargs: user-supplied arguments (from a recipe); checked strictly.
            where: config path used in errors, e.g. ``"model.args"``.
            **extra: arguments supplied by code (not checked against user typos).
        """
        fn = self.get(name)
        kwargs = dict(kwargs or {})
        where = where or f"{self.kind}.args"
        check_kwargs(fn, kwargs, where, exclude=set(extra))
        missing = [p.name for p in _params(fn)
                   if p.default is inspect.Parameter.empty and p.name not in kwargs and p.name not in extra]
        if self.kind == "dataset" and "path" in missing:  # a recipe without a default folder (the 3-D ones)
            raise ConfigError(f"the {name} dataset folder is not set ({where}.path): pass --data DIR")
        if missing:
            raise ConfigError(f"{where}: {self.kind} {name!r} needs {', '.join(missing)}")
        try:
            return fn(**kwargs, **extra)
        except ValueError as e:  # a builder refusing a value it was given: the user's setting, named
            raise ConfigError(f"{where}: {self.kind} {name!r}: {e}") from e


def _params(fn: Callable) -> list[inspect.Parameter]:
    sig = inspect.signature(fn)
    return [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_kwargs(fn: Callable, kwargs: dict[str, Any], where: str, exclude: set[str] = frozenset()) -> None:
    """Raise ConfigError for unknown keys or values whose type contradicts the annotation."""
    params = {p.name: p for p in _params(fn) if p.name not in exclude}
    try:
        hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    for key, value in kwargs.items():
        if key not in params:
            raise ConfigError(f"unknown key {where}.{key}{did_you_mean(key, params, where)}; "
                              f"valid keys: {', '.join(sorted(params))}")
        if key in hints and not type_ok(value, hints[key]):
            raise ConfigError(f"{where}.{key}: expected {type_name(hints[key])}, got {value!r}")


def type_ok(value: Any, hint: Any) -> bool:
    """Loose runtime check of ``value`` against a type hint (int accepted where float is expected)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        return any(type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(type_ok(v, a) for v, a in zip(value, args, strict=True))
        inner = args[0] if args else Any
        return all(type_ok(v, inner) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


MODELS = Registry("model")
DATASETS = Registry("dataset")
TASKS = Registry("task")
LOSSES = Registry("loss")
