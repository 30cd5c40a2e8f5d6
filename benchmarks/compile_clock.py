"""Seconds this process spends compiling Triton kernels, for telling a one-time cost's compilation from the rest.

Triton compiles a kernel once per process for each class of arguments (its constexprs, the integers it
specializes on); every layer of a model runs the same classes, so compilation does not grow with the layers
while a layer's own work does. ``CompileClock`` wraps ``JITFunction._do_compile`` (where a kernel not yet in
the process's cache is compiled, or loaded from Triton's disk cache) and sums its wall time, by kernel.
"""

from __future__ import annotations

import time
from collections import Counter


class CompileClock:
    """``with CompileClock() as clock: ...``; ``clock.seconds`` and ``clock.kernels`` so far (Counter: kernel
    name -> variants compiled); ``clock.since(mark)`` the seconds after an earlier ``clock.seconds``;
    ``clock.counted()``: the seconds less those ``exclude``d (compiling what the priced work never runs)."""

    def __init__(self):
        self.seconds = 0.0
        self.excluded = 0.0
        self.kernels: Counter[str] = Counter()
        self._original = None

    def __enter__(self) -> CompileClock:
        from triton.runtime.jit import JITFunction

        original = JITFunction._do_compile
        clock = self

        def timed(fn, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(fn, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock.kernels[getattr(fn, "__name__", "?")] += 1

        self._original = original
        JITFunction._do_compile = timed
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.jit import JITFunction

        JITFunction._do_compile = self._original

    def since(self, mark: float) -> float:
        return self.seconds - mark

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def counted(self) -> float:
        return self.seconds - self.excluded
