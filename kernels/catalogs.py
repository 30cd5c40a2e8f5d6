"""Every kernel, registered: importing this module loads the reference, the emulated FP4 kernels (healthy and
faulty) and the real kernels beside their recipes. What looks a kernel up imports it from here (or asks the
package, ``evalgate.kernels.get_kernel``, which loads it on first use)."""

from . import bf16, catalog  # noqa: F401  (register on import)
from .real import catalog as real_catalog  # noqa: F401
from .registry import KERNELS, get_kernel, kernel_names  # noqa: F401
