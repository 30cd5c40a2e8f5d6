"""Import-time chatter of optional third-party parts is not the user's business, in the CLI or a notebook.

Filtered narrowly: only these messages of these loggers (torchao is installed by the test extra and imported by
transformers); any other warning of theirs, every error, and all of evalgate's own warnings still show.
Installed by ``import evalgate`` (so ``import evalgate.kernels`` in a notebook is quiet too).
"""

from __future__ import annotations

import logging
import re

THIRD_PARTY_NOISE = {
    # torchao's optional CUDA/C++ extensions, which cannot load on a CPU-only machine or another CPython
    "torchao": re.compile(r"^Failed to load \S+\.so\b"),
    # torch deprecates register_constant() on Enum subclasses, which torchao calls at import
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
}


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not self.pattern.search(message)


def quiet_third_party() -> None:
    """Attach the filters (idempotent): on the exact loggers that emit the messages, so that propagation to
    handlers anywhere (root, torch's own) never sees them."""
    for name, pattern in THIRD_PARTY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))
