"""A kernel's source digest (kernels/source.py) and the look sequence it keys: a code fix without a new name or
version is another candidate, with its own sequence; the same code is the same candidate."""

from __future__ import annotations

import importlib
import json
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


def _with_source(run, digest: str):
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["kernel"]["source_sha256"] = digest
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_a_changed_kernel_source_starts_a_new_sequence(package, tmp_path, monkeypatch):
    from evalgate.api import decide

    from synthetic_runs import write_pair

    monkeypatch.chdir(tmp_path)
    fn = _forward()
    base, first = write_pair(tmp_path / "a", n_gsm8k=60, n_humaneval=20)
    _, again = write_pair(tmp_path / "b", n_gsm8k=60, n_humaneval=20, lost_every=7)  # new data, same baseline
    _, fixed = write_pair(tmp_path / "c", n_gsm8k=60, n_humaneval=20, lost_every=5)
    before = source_sha256(fn)
    _with_source(first, before), _with_source(again, before)

    def look(cand):
        verdict = decide([str(base)], str(cand), allow_uncalibrated=True)  # the API's edge loads them
        return verdict.sequence["identity"], verdict.sequence["looks"][0]["look"]

    one, look_one = look(first)
    assert look(again) == (one, look_one + 1)  # the same code on new data: the next look of its sequence
    (package / "helper.py").write_text("def scale(x):\n    return 2 * x  # fixed\n")  # no version bump
    assert source_sha256(fn) != before
    other, look_other = look(_with_source(fixed, source_sha256(fn)))
    assert other != one and look_other == 0  # another candidate: its own sequence from look 0


def test_every_builtin_kernel_has_a_source_digest():
    import evalgate.kernels.catalog  # noqa: F401  (registers the emulated kernels)
    from evalgate.kernels.registry import KERNELS

    digests = {name: kernel.source_sha256 for name, kernel in KERNELS.items()}
    assert digests and all(isinstance(d, str) and len(d) == 64 for d in digests.values())
    # a fault wrapped around a healthy kernel is computed by more code than the healthy kernel alone
    one_expert = next(n for n in digests if n.endswith("-one-expert"))
    assert digests[one_expert] != digests["w4a4_packed"]
