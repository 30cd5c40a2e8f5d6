"""A kernel's source digest (kernels/source.py) and the look sequence it keys: a code fix without a new name or
version is another candidate, with its own sequence; the same code is the same candidate."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from evalgate.kernels.source import source_modules, source_sha256


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throwaway package ``srcpkg``: ``forward`` in ``kern`` calls ``helper.scale`` (another module), and an
    unrelated module it never names."""
    root = tmp_path / "srcpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "helper.py").write_text("def scale(x):\n    return 2 * x\n")
    (root / "unrelated.py").write_text("X = 1\n")
    (root / "kern.py").write_text(textwrap.dedent("""
        from . import helper

        def make():
            def forward(x):
                return helper.scale(x)
            return forward
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [n for n in sys.modules if n == "srcpkg" or n.startswith("srcpkg.")]:
        del sys.modules[name]


def _forward():
    return importlib.import_module("srcpkg.kern").make()


def test_the_digest_covers_the_modules_that_compute_the_function(package):
    fn = _forward()
    assert [m.__name__ for m in source_modules(fn)] == ["srcpkg.helper", "srcpkg.kern"]
    before = source_sha256(fn)
    (package / "unrelated.py").write_text("X = 2\n")  # not part of the kernel
    assert source_sha256(fn) == before
    (package / "helper.py").write_text("def scale(x):\n    return 2 * x  # fixed\n")  # a fix, no version bump
    assert source_sha256(fn) != before


def test_a_changed_kernel_source_starts_a_new_sequence(package):
    from evalgate.gate.sequence import candidate_identity

    fn = _forward()
    manifest = {"model": {"fingerprint": "f" * 16, "numerics": "canonical-v1"},
                "kernel": {"name": "w4a4_packed", "version": "1", "id": "w4a4_packed@1",
                           "recipe": {"fmt": "nvfp4"}, "source_sha256": source_sha256(fn)}}
    same = {**manifest, "kernel": {**manifest["kernel"], "source_sha256": source_sha256(_forward())}}
    assert candidate_identity(same) == candidate_identity(manifest)  # the same code: the same sequence
    (package / "kern.py").write_text((package / "kern.py").read_text().replace("helper.scale(x)", "helper.scale(x) + 0"))
    fixed = {**manifest, "kernel": {**manifest["kernel"], "source_sha256": source_sha256(fn)}}
    assert fixed["kernel"]["source_sha256"] != manifest["kernel"]["source_sha256"]
    assert candidate_identity(fixed) != candidate_identity(manifest)


def test_every_builtin_kernel_has_a_source_digest():
    import evalgate.kernels.catalog  # noqa: F401  (registers the emulated kernels)
    from evalgate.kernels.registry import KERNELS

    digests = {name: kernel.source_sha256 for name, kernel in KERNELS.items()}
    assert digests and all(isinstance(d, str) and len(d) == 64 for d in digests.values())
    # a fault wrapped around a healthy kernel is computed by more code than the healthy kernel alone
    one_expert = next(n for n in digests if n.endswith("-one-expert"))
    assert digests[one_expert] != digests["w4a4_packed"]
