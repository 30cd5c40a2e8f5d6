"""Python's cyclic garbage collector during a command's start-up: paused, then resumed once the model is loaded.

Importing torch, transformers' DeepSeek-V4 chain and scipy leaves a few million long-lived objects, none of them
garbage; while the heap grows the collector traverses all of them again at every full collection (seven in a
gate's start-up, ~2 of its ~11 single-threaded seconds, on the gate's critical path). The console script pauses
the collector before any import (``pause``); ``resume`` — called once the model is loaded, before anything is
generated or served — freezes what exists (never traversed again, nor copied on write by the forked decoding
workers for the collector's sake) and turns collection back on. Collection never changes a computed value.
A notebook or a library caller never pauses it.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop automatic collection until ``resume``: only the console script calls this, before its imports."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Freeze everything that exists now and collect automatically again, if ``pause`` stopped it (idempotent;
    a collector that someone else disabled stays as they left it)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def paused() -> bool:
    return _paused
