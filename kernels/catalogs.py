"""Every kernel, registered: importing this module loads the reference, the emulated FP4 kernels (healthy and
faulty) and the real kernels beside their recipes. What looks a kernel up imports it from here (or asks the
package, ``evalgate.kernels.get_kernel``, which loads it on first use); a kernel another package offers
(kernels/plugins.py) is registered the first time it is looked up."""

from . import bf16, catalog  # noqa: F401  (register on import)
from . import plugins
from .real import catalog as real_catalog  # noqa: F401
from .registry import KERNELS, Kernel, kernel_names, register_kernel  # noqa: F401
from .registry import get_kernel as registered_kernel


def get_kernel(name: str) -> Kernel:
    """A registered kernel, or one another package offers, imported and registered on first use."""
    if name not in KERNELS and plugins.is_plugin(name):
        register_kernel(plugins.plugin_kernel(name))
    if name not in KERNELS:
        from evalgate.errors import UserError

        known = ", ".join(sorted(set(KERNELS) | set(plugins.plugin_names())))
        raise UserError(f"unknown kernel {name!r}; choose one of: {known} (see `evalgate kernels list`)")
    return registered_kernel(name)
