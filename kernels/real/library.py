"""The external library behind a real kernel: whether this machine can run it, and its identity.

Checking never imports the library (importing DeepGEMM builds its C++ module, about a minute): it looks for
the module and the GPU it needs. Loading imports it; `identity` records its version and build for the run
manifest (docs/kernels.md#real-kernels).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..contract import LoadsLibrary


def sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass(frozen=True)
class RealLibrary(LoadsLibrary):
    name: str  # what the user installs, as they would name it
    module: str  # its import name
    arch: tuple[int, ...]  # CUDA compute capabilities (major) it runs on: (9,) SM90, (10,) SM100
    build: Callable[[object], dict] = lambda module: {}  # the loaded module -> its version and build identity

    @property
    def capability(self):
        """Where it runs, in the terms a kernel of another package declares (kernels/contract.py)."""
        from ..contract import Capability

        return Capability(devices=("cuda",), arches=self.arch, module=self.module)

    def missing(self) -> str | None:
        """Why this machine cannot run it (None: it can), without importing the library."""
        import torch

        if importlib.util.find_spec(self.module) is None:
            return f"the Python module {self.module!r} is not installed"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible"
        major = torch.cuda.get_device_capability()[0]
        if major not in self.arch:
            wanted = " or ".join(f"SM{a}0" for a in self.arch)
            return f"it runs on {wanted} GPUs; this one is SM{major}{torch.cuda.get_device_capability()[1]}"
        return None

    def identity(self) -> dict:
        """Library, version and build of the loaded module (recorded with the kernel's conformance)."""
        module = self.load()
        return {"library": self.name, "module": self.module, **self.build(module)}
