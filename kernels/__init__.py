"""Kernel registry and emulated mega-MoE kernels. Import name: ``evalgate.kernels``.

This folder must never run as the top-level module ``kernels``: Hugging Face publishes a package of that
name and transformers probes for it. Python finds this folder under that name only when the repository
root is on ``sys.path`` (``python -c`` or a notebook started there); the guard below keeps such an import
inert, and without a version transformers then treats the hub package as absent.
"""

if __name__ == "evalgate.kernels":
    from .registry import KERNELS, Kernel, get_kernel, kernel_names, register_kernel  # noqa: F401
    from . import bf16  # noqa: F401  (registers the reference kernel)
    from . import catalog  # noqa: F401  (registers the emulated FP4 kernels, healthy and faulty)
    from .real import catalog as real_catalog  # noqa: F401  (registers the real kernels, beside their recipes)
    from .checkpoint import load_fp4_checkpoint, save_fp4_checkpoint  # noqa: F401

    __all__ = ["KERNELS", "Kernel", "get_kernel", "kernel_names", "register_kernel", "load_fp4_checkpoint",
               "save_fp4_checkpoint"]
