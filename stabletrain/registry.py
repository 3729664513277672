"""Named options of a config group, registered next to their implementation.

Each config group that chooses an implementation by name (``norm=stablenorm``,
``optim=adamw2``, ``regularizer=zloss``) has one :class:`Registry`. An option registers
itself with a decorator where it is written::

    NORMS = Registry("norm", "stabletrain.layers.norm")

    @NORMS.register("rmsnorm", layer=nn.RMSNorm)
    def rmsnorm(cfg, dim, **kw): ...

and the builders and the config check ask the registry, so no code outside a registry
dispatches on option names. A registry knows the module(s) that hold its options and
imports them on first use: a new option written in one of them, or in a new module of a
package registry (``package=True``), needs no other edit. Options written outside the package
register the same way in the user's own module, which the ``imports`` key names
(:func:`import_modules`).

This module imports nothing of stabletrain but its error type: every layer may use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from stabletrain.errors import ConfigError


class UnknownOption(ConfigError):
    """An option name that no one registered; the message is one line listing the valid ones."""


def option_value(v: Any) -> str:
    """The string value of a config option: an enum member's ``.value``, else ``str(v)``."""
    return str(getattr(v, "value", v))


@dataclass
class Entry:
    name: str
    fn: Callable
    info: dict = field(default_factory=dict)  # whatever the group asks an option to declare


class Registry:
    def __init__(self, group: str, *modules: str, package: bool = False, declares: tuple[str, ...] = (),
                 requires: dict[str, str] | None = None, call: str | None = None,
                 returns: tuple[Callable[[Any], bool], str] | None = None):
        """``group`` is the config key users set (``norm``, ``model.family``); ``modules``
        hold the options (a package's every submodule when ``package``); ``declares`` the
        keywords an option may give :meth:`register` besides ``kwargs`` (its own arguments; a
        component group's ``keys``: those of its group's keys it reads, the others noted as
        changing nothing and refused as a sweep's swept key; undeclared, any);
        ``requires`` those of them it must give, each with what it is; ``call`` how an option is
        called, ``(cfg, dim, *, bias, ln_eps)``: one of one's own that cannot be is refused
        before the run (:meth:`check_callable`), not met as a TypeError while building; ``returns``
        ``(accepts, what)``: :meth:`make` refuses a result that ``accepts`` does not, naming ``what``
        an option returns (a builder of one's own that forgot its ``return`` or returned the class
        met an AttributeError deep in the build)."""
        self.group, self.modules, self.package, self.call = group, modules, package, call
        self.returns = returns
        self.declares = ("kwargs", *declares)
        self.requires = dict(requires or {})
        self._entries: dict[str, Entry] = {}
        self._loaded = False

    def register(self, name: str, **info) -> Callable:
        for key in info:  # a misspelt one (kwarg=) would be silently unread
            if key not in self.declares:
                import difflib

                near = difflib.get_close_matches(key, self.declares, n=1, cutoff=0.6)
                raise ConfigError(f"{self.group} option {name!r}: register() takes no {key}= (it takes "
                                  f"{', '.join(k + '=' for k in self.declares)})"
                                  + (f"; did you mean {near[0]}=?" if near else ""))
        for key, what in self.requires.items():
            if key not in info:
                raise ConfigError(f"{self.group} option {name!r}: register() needs {key}= ({what})")

        def deco(fn: Callable) -> Callable:
            if name in self._entries and self._entries[name].fn is not fn:
                theirs = self._entries[name].fn
                raise ConfigError(f"{self.group} option {name!r} is registered twice (by {theirs.__module__} and "
                                  f"{fn.__module__}): give yours another name (a sweep over imports= checks every "
                                  f"point in one process: two versions of an option need two names)")
            self._entries[name] = Entry(name, fn, info)
            return fn

        return deco

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for mod in self.modules:
            m = importlib.import_module(mod)
            if self.package:
                for sub in pkgutil.iter_modules(m.__path__):
                    importlib.import_module(f"{mod}.{sub.name}")

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def entry(self, name: Any) -> Entry:
        self._load()
        key = option_value(name)
        if key not in self._entries:
            import difflib

            near = difflib.get_close_matches(key, self.names(), n=1, cutoff=0.7)
            # a yaml of one's own (hydra.searchpath) names an option that code must register: a name
            # near a built-in one (scalenorm, stablenorm) may be either a typo or that
            own = "an option of your own registers itself in a Python module named in imports=[path/to/it.py]"
            hint = (f"did you mean {near[0]}? If {key} is yours, name the module that registers it in "
                    f"imports=[path/to/it.py]" if near else own)
            raise UnknownOption(f"{self.group}={key} is not an option; choose one of: {', '.join(self.names())} "
                                f"({hint})")
        return self._entries[key]

    def check_callable(self, name: Any) -> None:
        """Refuse option ``name`` where its function cannot take the arguments :attr:`call` names."""
        if self.call is None:
            return
        fn = self.entry(name).fn
        names = [a.strip() for a in self.call.strip("()").split(",")]
        star = names.index("*") if "*" in names else len(names)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (a builtin): called as it is
            return
        try:
            sig.bind(*names[:star], **{k: k for k in names[star + 1:]})
        except TypeError as e:
            raise ConfigError(f"{self.group}={option_value(name)}: {fn.__module__}.{fn.__qualname__}{sig} must take "
                              f"what a {self.group} option is called with, {self.call} ({e})") from None

    def get(self, name: Any) -> Callable:
        return self.entry(name).fn

    def make(self, name: Any, *args, **kwargs) -> Any:
        """Call option ``name``'s function; what it returns, checked against :attr:`returns`."""
        fn = self.get(name)
        out = fn(*args, **kwargs)
        if self.returns is not None and not self.returns[0](out):
            article = "an" if self.group[0] in "aeiou" else "a"
            raise ConfigError(f"{self.group}={option_value(name)}: {fn.__module__}.{fn.__qualname__} returned "
                              f"{_described(out)}; {article} {self.group} option returns {self.returns[1]}")
        return out

    def __contains__(self, name: Any) -> bool:
        self._load()
        return option_value(name) in self._entries

    def entries(self) -> list[Entry]:
        self._load()
        return [self._entries[n] for n in sorted(self._entries)]


def _described(value: Any) -> str:
    if value is None:
        return "None (a missing return?)"
    if inspect.isclass(value):
        return f"the class {value.__name__}, not an instance of it"
    if isinstance(value, tuple):
        return f"a tuple ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def _near_file(path) -> str | None:
    """The .py file beside a missing ``path`` whose name is nearest it (a typo), if any."""
    import difflib

    try:
        names = [p.name for p in path.parent.glob("*.py")]
    except OSError:
        return None
    near = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    return str(path.parent / near[0]) if near else None


def import_modules(names: list[str] | tuple[str, ...]) -> None:
    """Import the user's own modules (the ``imports`` key) so that what they register, a model
    family, a norm, a loss term, an optimizer, becomes an option beside stabletrain's own.

    Each name is a ``.py`` path (relative to the working directory) or a module name found on
    ``sys.path`` or in the working directory. Importing again is a no-op, so every process of a
    job (ranks, sweep points, requeued tasks) can call this with the config it was given."""
    import os
    import sys
    from pathlib import Path

    for name in names or ():
        name = str(name)
        if name.endswith(".py") or os.sep in name or "/" in name:
            path = Path(name).expanduser().resolve()
            if not path.is_file():
                where = "" if Path(name).expanduser().is_absolute() else f" (relative paths start at {os.getcwd()})"
                near = _near_file(path)
                raise ConfigError(f"imports: {name} is not a file{where}; "
                                  + (f"did you mean {near}? " if near else "")
                                  + "give the path of a .py file or a module name")
            known = sys.modules.get(path.stem)
            if known is not None:
                if Path(getattr(known, "__file__", "") or "").resolve() != path:
                    raise ConfigError(f"imports: {name} has the name of the module {path.stem} imported from "
                                      f"{getattr(known, '__file__', 'elsewhere')}: rename the file")
                continue
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module  # before running it: dataclasses and pickling look it up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[path.stem]
                raise
            continue
        if os.getcwd() not in sys.path:  # `python path/to/train.py` puts the script's folder there, not ours
            sys.path.append(os.getcwd())
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise  # the module itself imports something missing: its own traceback says what
            raise ConfigError(f"imports: no module named {name} on sys.path or in {os.getcwd()}; give a module "
                              f"name or the path of a .py file") from None
