"""Loading extension points named by a dotted path, `package.module:function`.

Every extension point of a job (reward functions, rollout functions, buffer filters, tools) is a
string in the job file loaded by `load_plugin`, slime-style. Failures are `PluginError`s that say
which of the three things went wrong: the module cannot be imported, it has no such attribute, or
the callable does not accept the arguments kuberl will pass. A `Registry` holds the named
built-ins of one extension point and resolves a job's value to a built-in or a plugin.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast


class PluginError(ValueError):
    """A `module:function` spec that cannot be used; the message says why and what is expected."""


def load_plugin(
    spec: str, *, kind: str = "plugin", params: Sequence[str] | None = None
) -> Callable[..., Any]:
    """Import `module:attr` (attr may be dotted, e.g. `mod:Class.method`) and return the callable.

    `params` names the positional arguments kuberl will pass; the callable's signature must
    accept exactly that many positionally (extra parameters need defaults).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{kind} {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise PluginError(
            f"{kind} {spec!r}: module {missing!r} not found (is it installed or on PYTHONPATH?)"
        ) from None
    except Exception as exc:  # the plugin's own import-time error
        raise PluginError(
            f"{kind} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise PluginError(
                f"{kind} {spec!r}: {module_name!r} has no attribute {attr!r}"
                f" (it has: {', '.join(public[:20]) or 'nothing public'})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{kind} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    if params is not None:
        check_signature(obj, params, f"{kind} {spec!r}")
    return obj


def check_signature(fn: Callable[..., Any], params: Sequence[str], what: str) -> None:
    """Raise PluginError unless fn can be called with len(params) positional arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without signatures: trust them
    try:
        sig.bind(*params)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)  # callable objects, partials
        raise PluginError(
            f"{what}: wrong signature {name}{sig}; kuberl calls it as {name}({', '.join(params)})"
        ) from None


F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Named implementations of one extension point, plus `module:function` plugins for it.

    Built-ins register with the `register(name)` decorator; a job names one of them, or a plugin
    path loaded with `load_plugin` and checked against `params` (the positional arguments kuberl
    passes). `kind` names the extension point in messages ("advantage estimator").
    """

    def __init__(self, kind: str, params: Sequence[str]) -> None:
        self.kind = kind
        self.params = tuple(params)
        self._named: dict[str, F] = {}
        self._loaded: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering a function under `name`; a name taken by another is refused."""
        if not name or ":" in name or name != name.strip():
            raise PluginError(
                f"{self.kind} name {name!r}: expected a plain name (':' marks plugin paths)"
            )

        def add(fn: F) -> F:
            check_signature(fn, self.params, f"{self.kind} {name!r}")
            taken = self._named.get(name)
            if taken is not None and taken is not fn:
                raise PluginError(
                    f"{self.kind} {name!r} is already registered ({_qualname(taken)}); "
                    f"register {_qualname(fn)} under another name"
                )
            self._named[name] = fn
            return fn

        return add

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._named)

    def resolve(self, value: str, field: str) -> F:
        """The function `value` names: a registered name or a `module:function` plugin.

        Raises PluginError naming `field` (the job-file path that holds `value`)."""
        if value in self._named:
            return self._named[value]
        if ":" in value:
            if value not in self._loaded:
                fn = load_plugin(value, kind=f"{field}: {self.kind}", params=self.params)
                self._loaded[value] = cast(F, fn)
            return self._loaded[value]
        raise PluginError(
            f"{field}: unknown {self.kind} {value!r}; registered: {', '.join(self.names())}; "
            f"or a plugin 'package.module:function' called as function({', '.join(self.params)})"
        )


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
