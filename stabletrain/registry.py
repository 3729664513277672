"""Named options of a config group, registered next to their implementation.

Each config group that chooses an implementation by name (``norm=stablenorm``,
``optim=adamw2``, ``regularizer=zloss``) has one :class:`Registry`. An option registers
itself with a decorator where it is written::

    NORMS = Registry("norm", "stabletrain.layers.norm")

    @NORMS.register("rmsnorm", norm_gain=True)
    def rmsnorm(cfg, dim, **kw): ...

and the builders and the config check ask the registry, so no code outside a registry
dispatches on option names. A registry knows the module(s) that hold its options and
imports them on first use: a new option written in one of them, or in a new module of a
package registry (``package=True``), needs no other edit.

This module imports nothing of stabletrain but its error type: every layer may use it.
"""

from __future__ import annotations

import importlib
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
    def __init__(self, group: str, *modules: str, package: bool = False):
        """``group`` is the config key users set (``norm``, ``model.family``); ``modules``
        hold the options (a package's every submodule when ``package``)."""
        self.group, self.modules, self.package = group, modules, package
        self._entries: dict[str, Entry] = {}
        self._loaded = False

    def register(self, name: str, **info) -> Callable:
        def deco(fn: Callable) -> Callable:
            if name in self._entries and self._entries[name].fn is not fn:
                raise ValueError(f"{self.group} option {name!r} is registered twice")
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
            raise UnknownOption(f"{self.group}={key} is not an option; choose one of: {', '.join(self.names())}")
        return self._entries[key]

    def get(self, name: Any) -> Callable:
        return self.entry(name).fn

    def __contains__(self, name: Any) -> bool:
        self._load()
        return option_value(name) in self._entries

    def entries(self) -> list[Entry]:
        self._load()
        return [self._entries[n] for n in sorted(self._entries)]
