"""One plugin registry, backed by Python entry points.

Built-in feature maps and attention backends are registered through this project's own
``[project.entry-points]`` table, exactly like a third-party package would register its own,
so there is a single discovery mechanism for everyone:

    [project.entry-points."linformer_lab.feature_maps"]
    my_map = "my_package.module:MyFeatureMap"

One class may be registered under several names: an alias fixes some of its arguments (the class's
``aliases``, ``{name: {argument: value}}``, read by :meth:`Registry.arguments`), so one class and
one code path serve a setting users ask for by name (``linear_cuda``: ``linear`` with
``gpu_kernels=True``).

Discovery is lazy: entry points are listed (cheap metadata reads) the first time a name is
asked for, and a plugin's module is imported only when that plugin is built. A plugin that
fails to import breaks only itself.

A source checkout used without installing it (``PYTHONPATH=.`` on a GPU node without network,
README) has no metadata for this project, so its built-ins are then read from the checkout's
own ``pyproject.toml``: the same table, the same single source.
"""

from __future__ import annotations

import difflib
import re
from importlib import metadata
from pathlib import Path
from typing import Any

PROJECT = "linformer-lab"
#: Label of the built-ins read from pyproject.toml when the project is not installed.
SOURCE_CHECKOUT = f"{PROJECT} (source checkout, not installed)"


class PluginError(ValueError):
    """Raised for unknown, duplicated or broken plugins. Subclasses ValueError so argument
    parsers (jsonargparse) report it as a bad value."""


class Registry:
    """Name -> class, discovered from one entry-point group.

    Example:
        >>> FEATURE_MAPS = Registry("linformer_lab.feature_maps", kind="feature map")
        >>> FEATURE_MAPS.get("elu")          # imports and returns the class
    """

    def __init__(self, group: str, kind: str):
        self.group = group
        self.kind = kind
        self._entry_points: dict[str, list[metadata.EntryPoint]] | None = None
        self._loaded: dict[str, Any] = {}

    def arguments(self, name: str) -> dict[str, Any]:
        """The arguments the registered name ``name`` fixes (its class's ``aliases``; empty for a
        class's own name), which the builder passes to the class."""
        return dict(getattr(self.get(name), "aliases", {}).get(name, {}))

    def _discover(self) -> dict[str, list[metadata.EntryPoint]]:
        if self._entry_points is None:
            found: dict[str, list[metadata.EntryPoint]] = {}
            for ep in metadata.entry_points(group=self.group):
                # The same distribution can be visible twice on sys.path (e.g. an editable
                # install plus a build dir); count each distribution once.
                same = [e for e in found.get(ep.name, []) if _dist_name(e) == _dist_name(ep)]
                if not same:
                    found.setdefault(ep.name, []).append(ep)
            for ep in _source_checkout_entry_points(self.group):
                found.setdefault(ep.name, []).append(ep)
            self._entry_points = found
        return self._entry_points

    def refresh(self) -> None:
        """Forget what was discovered, e.g. after installing a plugin in a running process."""
        self._entry_points = None
        self._loaded.clear()

    def names(self) -> list[str]:
        return sorted(self._discover())

    def distributions(self) -> dict[str, list[str]]:
        """Name -> the distributions (``name==version``) that register it."""
        return {name: [_dist_label(ep) for ep in eps] for name, eps in sorted(self._discover().items())}

    def get(self, name: str) -> Any:
        """Return the registered class for ``name``, importing its module on first use."""
        if not isinstance(name, str):
            raise PluginError(f"{self.kind} name must be a string, got {type(name).__name__}")
        if name in self._loaded:
            return self._loaded[name]
        eps = self._discover().get(name)
        if not eps:
            valid = self.names()
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PluginError(
                f"Unknown {self.kind} {name!r}.{hint} Valid choices: {', '.join(valid) or '(none installed)'}. "
                f"Plugins are registered under the entry-point group {self.group!r}."
            )
        if len(eps) > 1:
            raise PluginError(
                f"{self.kind} {name!r} is registered by more than one distribution: "
                f"{' and '.join(f'{_dist_label(ep)} ({ep.value})' for ep in eps)}. "
                f"Uninstall one of them or rename its entry point."
            )
        ep = eps[0]
        try:
            obj = ep.load()
        except Exception as exc:  # the plugin's own bug: name it, keep everything else working
            raise PluginError(
                f"{self.kind} {name!r} from distribution {_dist_label(ep)} failed to import "
                f"({ep.value}): {type(exc).__name__}: {exc}"
            ) from exc
        self._loaded[name] = obj
        return obj

    def loadable(self):
        """``(name, class)`` of every registered name in sorted order whose plugin imports; a broken
        one is left out (``cli.py plugins --check`` reports it)."""
        for name in self.names():
            try:
                yield name, self.get(name)
            except PluginError:
                continue

    def build(self, name: str, base: type, **kwargs) -> Any:
        """An instance of the class registered as ``name``, which must subclass ``base``, from the
        arguments its name fixes (:meth:`arguments`) and ``kwargs``; else a PluginError."""
        cls = self.get(name)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            # the group is the package that exports the base class: what a plugin's author imports
            raise PluginError(f"{self.kind} {name!r} is registered as {cls!r}, which is not a "
                              f"{self.group}.{base.__name__} subclass")
        return cls(**self.arguments(name), **kwargs)


def _source_checkout_entry_points(group: str) -> list[metadata.EntryPoint]:
    """This project's own entry points of ``group`` from the ``pyproject.toml`` beside the package,
    when the project is not installed (no metadata); else nothing, the metadata has them."""
    try:
        metadata.distribution(PROJECT)
        return []
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        return []
    return [metadata.EntryPoint(name=name, value=value, group=group)
            for name, value in _entry_point_table(pyproject.read_text(), group).items()]


def _entry_point_table(pyproject: str, group: str) -> dict[str, str]:
    """The ``name = "module:attr"`` lines of ``[project.entry-points."GROUP"]``. A line reader, not a
    TOML parser: Python 3.10 has no tomllib, and this one table is ours to keep simple (a test
    compares it with tomllib's reading)."""
    table, inside = {}, False
    for line in pyproject.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            inside = line == f'[project.entry-points."{group}"]'
        elif inside and (match := re.fullmatch(r'([\w.-]+)\s*=\s*"([^"]+)"', line)):
            table[match.group(1)] = match.group(2)
    return table


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def _dist_label(ep: metadata.EntryPoint) -> str:
    return f"{ep.dist.name}=={ep.dist.version}" if ep.dist is not None else SOURCE_CHECKOUT


FEATURE_MAPS = Registry("linformer_lab.feature_maps", kind="feature map")
ATTENTION = Registry("linformer_lab.attention", kind="attention backend")
