"""Kernel registry and emulated mega-MoE kernels. Import name: ``evalgate.kernels``.

Importing the package is light: ``names`` (every kernel name) needs neither torch nor transformers. The
catalogs that register each kernel (``catalogs``) load on first use of one of ``__all__`` below; the command
line checks a kernel's name before paying for them.

This folder must never run as the top-level module ``kernels``: Hugging Face publishes a package of that
name and transformers probes for it. Python finds this folder under that name only when the repository
root is on ``sys.path`` (``python -c`` or a notebook started there); the guard below keeps such an import
inert, and without a version transformers then treats the hub package as absent.
"""

if __name__ == "evalgate.kernels":
    __all__ = ["KERNELS", "Kernel", "get_kernel", "kernel_names", "register_kernel", "load_fp4_checkpoint",
               "save_fp4_checkpoint"]

    def __getattr__(name: str):
        if name not in __all__:
            raise AttributeError(f"module 'evalgate.kernels' has no attribute {name!r}")
        from . import catalogs, checkpoint  # catalogs: every kernel registered, get_kernel finds plugins too

        return getattr(checkpoint if name.endswith("_checkpoint") else catalogs, name)
