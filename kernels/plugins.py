"""Kernels from other packages (docs/kernels.md#your-own-kernel).

An installed package offers kernels through the entry-point group ``evalgate.kernels``: each entry point is
named as the kernel and points at a ``KernelSpec`` (kernels/contract.py). ``--kernel package.module:NAME``
names one directly, installed or not (its module on ``sys.path``).

Three stages, each as light as it can be:

- ``plugin_names`` reads the installed packages' metadata: no plugin is imported (the command line's name
  check stays fast);
- ``declaration`` imports the declaring module of one chosen kernel (a module without torch) and checks what
  it declares; ``require`` checks its library is installed, in a range it supports;
- ``plugin_kernel`` imports the experts function and makes the ``Kernel`` the registry holds, with evalgate's
  emulation of the declared recipe as its reference.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache

from evalgate.errors import UserError

from .contract import Capability, KernelSpec, LoadsLibrary

GROUP = "evalgate.kernels"


def is_direct(name: str) -> bool:
    """``package.module:NAME``: a kernel named by where its declaration lives."""
    return ":" in name


@lru_cache(maxsize=1)
def _entry_points() -> dict:
    found = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        found.setdefault(ep.name, ep)  # the first on sys.path wins, as for imports
    return found


def plugin_names() -> list[str]:
    """Every kernel installed packages offer, from their metadata alone (an entry point named as one of
    evalgate's kernels is not: the name stays evalgate's)."""
    from .names import ALL

    return sorted(n for n in _entry_points() if n not in ALL)


def is_plugin(name: str) -> bool:
    return is_direct(name) or name in plugin_names()


def origin(name: str) -> str:
    """Where a kernel comes from, in words: "evalgate", "DIST VERSION (entry point module:NAME)", or "named
    directly" for the direct form."""
    if is_direct(name):
        return "named directly"
    ep = _entry_points().get(name)
    if ep is None:
        return "evalgate"
    dist = getattr(ep, "dist", None)
    package = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
    return f"{package} (entry point {ep.value})"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _import_object(target: str, what: str):
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a plugin's own bug: any exception, reported in one line
        raise UserError(f"{what}: importing {module_name!r} failed ({_one_line(exc)}); fix or uninstall the "
                        "package that offers it") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{what}: module {module_name!r} has no {attr!r}") from None


def _current_folder_importable() -> None:
    """The direct form finds modules in the current folder, as ``python -m`` and uvicorn's ``module:app`` do
    (the console script's ``sys.path`` starts at its own folder instead)."""
    import os
    import sys

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


@lru_cache(maxsize=None)
def declaration(name: str) -> KernelSpec:
    """The checked declaration of plugin kernel ``name`` (imports its declaring module, nothing else)."""
    if is_direct(name):
        target, where = name, f"--kernel {name}"
        _current_folder_importable()
    else:
        ep = _entry_points().get(name)
        if ep is None:
            raise UserError(f"unknown kernel {name!r} (see `evalgate kernels list`)")
        target, where = ep.value, f"from {origin(name)}"
    if target.count(":") != 1 or not all(target.split(":")):
        raise UserError(f"kernel {name!r} ({where}): expected package.module:NAME")
    what = f"kernel {name!r} ({where})"
    spec = _import_object(target, what)
    if not isinstance(spec, KernelSpec):
        raise UserError(f"{what} is a {type(spec).__name__}, not an evalgate.kernels.contract.KernelSpec")
    try:
        spec = spec.checked(where)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    from .names import ALL

    if spec.name in ALL:
        raise UserError(f"{what} takes the name of evalgate's kernel {spec.name!r}; a package may not replace "
                        "a built-in kernel: choose another name")
    if not is_direct(name) and spec.name != name:
        raise UserError(f"{what} declares the name {spec.name!r}; its entry point must carry the same name")
    return spec


def require(name: str) -> None:
    """Refuse (one line) a plugin kernel whose library is missing or outside the versions it supports."""
    spec = declaration(name)
    reason = spec.capability.missing_library()
    if reason is not None:
        raise UserError(f"kernel {name!r} ({origin(name)}) cannot run here: {reason}")


@dataclass(frozen=True)
class PluginLibrary(LoadsLibrary):
    """A plugin kernel as ``Kernel.library``: what conformance asks of a kernel computed outside evalgate
    (it can run here; its identity for the run's manifest)."""

    name: str  # the kernel's origin, in words
    module: str  # the library it calls (capability.module), else the module its experts function lives in
    capability: Capability
    kernel_version: str
    gemm_symbols: str | None = None  # what the execution witness holds it to on a GPU (kernels/witness.py)

    def missing(self) -> str | None:
        return self.capability.missing_library()

    def identity(self) -> dict:
        found = {}
        if self.capability.distribution:
            try:
                found["library_version"] = importlib.metadata.version(self.capability.distribution)
            except importlib.metadata.PackageNotFoundError:
                found["library_version"] = None
        return {"library": self.name, "module": self.module, "version": self.kernel_version,
                "capability": self.capability.as_dict(), **found}


def _reference(recipe) -> str:
    """The emulated kernel that computes ``recipe``: a built-in one with the same recipe, else evalgate's
    emulation registered for it (``recipe/<digest>``)."""
    import hashlib

    from .registry import KERNELS, Kernel, register_kernel

    for n in sorted(KERNELS):
        k = KERNELS[n]
        if not k.faulty and not k.real and k.reference == n and k.declared == recipe:
            return n
    name = "recipe/" + hashlib.sha256(repr(recipe).encode()).hexdigest()[:12]
    if name not in KERNELS:
        from .checkpoint import prepare_fp4_model
        from .emulator import experts_forward

        register_kernel(Kernel(name=name, version="evalgate's emulation of a declared recipe",
                               description=f"evalgate's emulation of {recipe}", experts_forward=experts_forward(recipe),
                               declared=recipe, prepare_model=prepare_fp4_model))
    return name


def _checked_prepare(name: str, capability: Capability, prepare):
    def prepare_model(model, path) -> None:
        try:
            device = str(next(model.parameters()).device)
        except StopIteration:
            device = "cpu"
        reason = capability.missing_library() or capability.missing_device(device)
        if reason is not None:
            raise UserError(f"kernel {name!r} ({origin(name)}) cannot run here: {reason}")
        prepare(model, path)
    return prepare_model


def plugin_kernel(name: str):
    """The ``Kernel`` of plugin kernel ``name``, its experts function imported (registering is the caller's)."""
    from .registry import Kernel

    spec = declaration(name)
    require(name)
    what = f"kernel {name!r} ({origin(name)})"
    forward = _import_object(spec.forward, what)
    if not callable(forward):
        raise UserError(f"{what}: {spec.forward} is not a function")
    if spec.prepare_model is not None:
        prepare = _import_object(spec.prepare_model, what)
    else:
        from .checkpoint import prepare_fp4_model as prepare
    version = spec.version or origin(name)
    return Kernel(
        name=name, version=version, description=spec.description, experts_forward=forward,
        declared=spec.recipe, implements=_reference(spec.recipe), tolerance=spec.tolerance,
        library=PluginLibrary(origin(name), spec.capability.module or spec.forward.split(":")[0], spec.capability,
                              version, spec.gemm_symbols),
        prepare_model=_checked_prepare(name, spec.capability, prepare))
