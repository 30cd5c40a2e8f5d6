"""What this package offers evalgate, declared without importing torch or the kernel's library: evalgate
reads this module when a kernel of it is chosen, checks the declaration and the library before the model
loads, and imports ``forward`` only then.

The recipe is the packed W4A4 kernel's (DeepGEMM PR #44, ``sm100_fp4_mega_moe``): E2M1 weights and
activations with UE8M0 scales per 32, the input rounded with ties toward zero, the intermediate re-quantized
to E2M1 after the router weight, the routed scaling fused into the router weights, the shared expert left to
the model. No tolerance: both paths must give evalgate's emulation of that recipe bit for bit.
"""

from evalgate.kernels.contract import Capability, KernelSpec
from evalgate.kernels.recipe import Recipe

PACKED_W4A4 = Recipe(weights="e2m1", activations="e2m1", input_ties="zero", input_scale_rule="pre_dispatch",
                     intermediate="e2m1", routed_scaling="fused", router_weight="before_requant",
                     shared_expert="outside")

CPU = KernelSpec(
    name="example/w4a4_packed-cpu",
    forward="evalgate_example_kernel.cpu:experts_forward",
    recipe=PACKED_W4A4,
    description="the packed W4A4 recipe in plain PyTorch on a CPU (float64 GEMMs rounded once to FP32)",
    version="evalgate-example-kernel 0.1.0, cpu emulation",
    capability=Capability(devices=("cpu",)),
)

B200 = KernelSpec(
    name="example/w4a4_packed-b200",
    forward="evalgate_example_kernel.b200:experts_forward",
    recipe=PACKED_W4A4,
    description="the packed W4A4 mega-MoE kernel of a local sgl-deep-gemm build (DG_MEGA_MOE_FP4=1), SM100",
    version="evalgate-example-kernel 0.1.0, sgl-deep-gemm packed FP4 path",
    capability=Capability(devices=("cuda",), arches=(10,), module="deep_gemm", distribution="sgl-deep-gemm",
                          versions=">=0.1.7"),
    gemm_symbols=r"sm100_fp4_mega_moe",  # the packed kernel must run in every MoE layer call, and no other GEMM
)

# A fault a port of the kernel could carry: the input quantizer of sgl-deep-gemm >= 0.2.0 (ties to even)
# behind the packed kernel's declaration. Not offered through the entry points; name it directly:
#   evalgate gate --kernel evalgate_example_kernel.declarations:FAULTY_TIES
FAULTY_TIES = KernelSpec(
    name="example/w4a4_packed-cpu-ties-even",
    forward="evalgate_example_kernel.cpu:ties_even_forward",
    recipe=PACKED_W4A4,
    description="the CPU emulation with the input rounded ties-to-even while declaring ties toward zero",
    version="evalgate-example-kernel 0.1.0, fault-injected",
    capability=Capability(devices=("cpu",)),
)
