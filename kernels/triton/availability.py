"""Whether the Triton kernels can run here: Triton importable, and a CUDA device or Triton's interpreter.

Apart from `dispatch` so that the kernel modules (`gemm`, `quantize`) can ask without importing the
dispatcher that loads them.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def _import_error() -> str | None:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install: either way, no Triton)
        return f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"
    return None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


INTERPRETED_SMS = 1  # the SMs `sm_count` gives under the interpreter or off CUDA (a test raises it to split)


@functools.cache
def _cuda_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The device's SMs, which size the split launches (split K, split attention); INTERPRETED_SMS under the
    interpreter or off CUDA."""
    import torch

    device = torch.device(device)
    if interpreted() or device.type != "cuda":
        return INTERPRETED_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def unavailable_reason(device_type: str) -> str | None:
    """Why the Triton path cannot run on tensors of `device_type`, or None when it can."""
    err = _import_error()
    if err:
        return err
    if device_type == "cuda" or interpreted():
        return None
    return f"the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 to run them on the {device_type} (slow)"


def available(device_type: str = "cuda") -> bool:
    return unavailable_reason(device_type) is None
