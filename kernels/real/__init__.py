"""Real kernels: a kernel computed by an external library, held against the emulated recipe it implements.

One backend per file behind the `fp8_moe.Fp8Gemm` interface (SM90) or the mega-MoE adapter (SM100);
`catalog.py` registers them beside the emulated kernels (docs/kernels.md#real-kernels).
"""
