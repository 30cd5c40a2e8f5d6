"""A kernel's source digest: the SHA-256 of the module files that compute its experts function.

A run records it in its manifest (``kernel.source_sha256``), and a candidate's content identity
(``evalgate.gate.sequence.candidate_identity``) includes it: a kernel whose code changed without a new name or
version is another candidate with its own sequence of looks, not the next look of the old one.

The modules are found from the function itself: the module that defines it (past the Triton backend wrapper
and closures such as a fault around a healthy kernel), then every module of the same top-level package that
those modules' globals name, transitively. Modules imported only inside a function body (the Triton path,
which computes the same bits) are not followed.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
from pathlib import Path


def _functions(fn) -> list:
    """``fn`` and the functions it wraps: the torch function behind the backend choice, closure cells."""
    seen, todo = [], [fn]
    while todo:
        f = todo.pop()
        if not callable(f) or any(f is s for s in seen):
            continue
        seen.append(f)
        todo += [getattr(f, "torch_forward", None), getattr(f, "__wrapped__", None)]
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return seen


def _module_of(obj) -> types.ModuleType | None:
    name = getattr(obj, "__module__", None)
    return sys.modules.get(name) if isinstance(name, str) else None


def source_modules(fn) -> list[types.ModuleType]:
    """The modules whose source computes ``fn`` (see the module docstring), sorted by name."""
    starts = [m for m in (_module_of(f) for f in _functions(fn)) if m is not None]
    if not starts:
        return []
    packages = {m.__name__.split(".")[0] for m in starts}
    found: dict[str, types.ModuleType] = {}
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module.__name__ in found or module.__name__.split(".")[0] not in packages:
            continue
        found[module.__name__] = module
        for value in vars(module).values():
            named = value if isinstance(value, types.ModuleType) else _module_of(value)
            if named is not None and named.__name__ not in found:
                todo.append(named)
    return [found[name] for name in sorted(found)]


def source_sha256(fn) -> str | None:
    """SHA-256 over the source files of ``source_modules(fn)`` (each file's module name and bytes); None
    when none of them has a source file (a built-in, or a function made at run time)."""
    digest, any_file = hashlib.sha256(), False
    for module in source_modules(fn):
        try:
            path = inspect.getsourcefile(module)
        except TypeError:  # a built-in module
            path = None
        if not path or not Path(path).is_file():
            continue
        any_file = True
        digest.update(module.__name__.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return digest.hexdigest() if any_file else None
