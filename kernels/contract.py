"""What a kernel declares, checked before anything heavy loads: the recipe it computes, what it runs on, and
how far it may sit from that recipe (docs/kernels.md#your-own-kernel).

A package offers a kernel as a ``KernelSpec`` in a module that imports neither torch nor its library; the
experts function is named by ``forward`` ("package.module:function") and imported only when the model loads.
Importing this module needs neither torch nor transformers.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import Mapping

from .recipe import Recipe
from .tolerance import Tolerance

DEVICES = ("cpu", "cuda")


class LoadsLibrary:
    """``require`` and ``load`` of a kernel's library, for any library record with a ``name``, an import
    ``module`` and ``missing()`` (why this machine cannot run it, None when it can): the built-in real
    kernels' (``real/library.py``) and the plugins' (``plugins.py``)."""

    name: str
    module: str

    def missing(self) -> str | None:
        raise NotImplementedError

    def require(self) -> None:
        reason = self.missing()
        if reason is not None:
            from evalgate.errors import UserError

            raise UserError(f"{self.name} cannot run here: {reason}")

    def load(self):
        self.require()
        return importlib.import_module(self.module)


@dataclass(frozen=True)
class Capability:
    """Where a kernel runs, declared beside its code (as vLLM's backends declare ``supports_*``)."""

    devices: tuple[str, ...] = DEVICES  # device types: "cpu", "cuda"
    arches: tuple[int, ...] = ()  # CUDA compute capability majors (9: SM90, 10: SM100); () any
    module: str | None = None  # the import name of the library it calls, e.g. "deep_gemm"
    distribution: str | None = None  # the library's installed distribution, e.g. "sgl-deep-gemm"
    versions: str | None = None  # a PEP 440 range of that distribution, e.g. ">=0.2.0,<0.3"

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "arches", tuple(self.arches))
        bad = [d for d in self.devices if d not in DEVICES]
        if bad or not self.devices:
            raise ValueError(f"capability devices={self.devices!r}; expected some of {', '.join(DEVICES)}")
        if self.versions is not None:
            if self.distribution is None:
                raise ValueError("capability versions needs the distribution whose versions they are")
            from packaging.specifiers import InvalidSpecifier, SpecifierSet
            try:
                SpecifierSet(self.versions)
            except InvalidSpecifier:
                raise ValueError(f"capability versions={self.versions!r} is not a PEP 440 range") from None

    def missing_library(self) -> str | None:
        """Why the library cannot be used here (None: it can), found without importing it."""
        if self.module is not None and importlib.util.find_spec(self.module.split(".")[0]) is None:
            return f"the Python module {self.module!r} is not installed"
        if self.distribution is not None:
            try:
                version = importlib.metadata.version(self.distribution)
            except importlib.metadata.PackageNotFoundError:
                return f"the distribution {self.distribution!r} is not installed"
            if self.versions is not None:
                from packaging.specifiers import SpecifierSet
                from packaging.version import InvalidVersion, Version
                try:
                    ok = Version(version) in SpecifierSet(self.versions)
                except InvalidVersion:
                    ok = False
                if not ok:
                    return f"{self.distribution} {version} is installed; it needs {self.versions}"
        return None

    def missing_device(self, device: str) -> str | None:
        """Why ``device`` ("cpu", "cuda", "cuda:1") does not run it (None: it does). The GPU's architecture is
        read through torch, so only for a CUDA device once torch is loaded anyway."""
        kind = device.split(":")[0]
        if kind not in self.devices:
            return f"it runs on {' or '.join(self.devices)}, not {kind}"
        if kind == "cuda" and self.arches:
            import torch

            if torch.cuda.is_available():
                index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
                major, minor = torch.cuda.get_device_capability(index)
                if major not in self.arches:
                    wanted = " or ".join(f"SM{a}0" for a in self.arches)
                    return f"it runs on {wanted} GPUs; this one is SM{major}{minor}"
        return None

    def as_dict(self) -> dict:
        return {"devices": list(self.devices), "arches": list(self.arches), "module": self.module,
                "distribution": self.distribution, "versions": self.versions}


@dataclass(frozen=True)
class KernelSpec:
    """A kernel as another package declares it. evalgate holds it, before any item is generated, against
    evalgate's own emulation of ``recipe`` on every MoE layer, expert by expert and token by token: bit for
    bit, or within ``tolerance`` when given (kernels/conformance.py). A declared kernel is never its own
    reference and never exempt."""

    name: str  # as `--kernel` names it; a built-in kernel's name is refused
    forward: str  # "package.module:function": fn(experts_module, hidden_states[T,H], top_k_index[T,K], top_k_weights[T,K]) -> [T,H]
    recipe: Recipe | Mapping  # what it computes (a Recipe, or a mapping of its fields)
    description: str  # one line: what it is
    version: str = ""  # which build or release this is (recorded in the run's manifest)
    capability: Capability = field(default_factory=Capability)
    tolerance: Tolerance | None = None  # None: bit-identical to the recipe
    prepare_model: str | None = None  # "package.module:function"(model, checkpoint_dir); default evalgate's FP4 codes
    # the execution witness on a GPU (docs/gate.md#execution-witness): a regular expression over the CUDA kernel
    # names that must run in every MoE layer call, and no other GEMM; None: what ran is recorded, not held
    gemm_symbols: str | None = None

    def checked(self, origin: str) -> "KernelSpec":
        """This declaration with its recipe typed; ValueError naming what is wrong (``origin`` says where it
        came from)."""
        owner = f"kernel {self.name!r} ({origin})"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a kernel from {origin} has no name")
        for attr in ("forward", "prepare_model"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, str) or value.count(":") != 1):
                raise ValueError(f"{owner} declares {attr}={value!r}; expected 'package.module:function'")
        if not isinstance(self.capability, Capability):
            raise ValueError(f"{owner} declares capability {self.capability!r}; expected evalgate.kernels.contract.Capability")
        if self.tolerance is not None and not isinstance(self.tolerance, Tolerance):
            raise ValueError(f"{owner} declares tolerance {self.tolerance!r}; expected evalgate.kernels.tolerance.Tolerance")
        if self.gemm_symbols is not None:
            import re

            try:
                re.compile(self.gemm_symbols)
            except (re.error, TypeError) as exc:
                raise ValueError(f"{owner} declares gemm_symbols={self.gemm_symbols!r}, not a regular expression "
                                 f"({exc})") from None
        if isinstance(self.recipe, Recipe) and self.recipe.fault is not None:
            raise ValueError(f"{owner} declares recipe fault={self.recipe.fault!r}; a fault is not a recipe")
        from dataclasses import replace

        return replace(self, recipe=Recipe.from_fields(self.recipe, owner))
