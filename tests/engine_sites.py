"""Stand-in Python environments of the engine versions the kernel table covers: a folder to put on
PYTHONPATH that holds only the distributions' metadata (``sglang``, ``vllm``, ``sgl-deep-gemm``) and, for
a packed build, a ``deep_gemm`` package that ships ``sm100_fp4_mega_moe.cuh``. ``engines.probe_stack``
reads them as it reads a real install, and ``tests/fake_server.py`` behaves as the versions it finds."""

from __future__ import annotations

from pathlib import Path


def site(root: Path, sglang: str | None = None, vllm: str | None = None, deep_gemm: str | None = None,
         packed: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, version in (("sglang", sglang), ("vllm", vllm), ("sgl_deep_gemm", deep_gemm)):
        if version:
            info = root / f"{name}-{version}.dist-info"
            info.mkdir(exist_ok=True)
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    if deep_gemm:
        package = root / "deep_gemm"
        (package / "include" / "deep_gemm" / "impls").mkdir(parents=True, exist_ok=True)
        # importing the stand-in fails cleanly; the probe only looks at its files
        (package / "__init__.py").write_text("raise ImportError('a stand-in deep_gemm: files only')\n")
        if packed:
            (package / "include" / "deep_gemm" / "impls" / "sm100_fp4_mega_moe.cuh").write_text("// packed\n")
    return root
