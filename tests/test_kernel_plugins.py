"""Kernels from other packages: an installed distribution's entry points (a dist-info folder on PYTHONPATH, as
pip leaves one) and the direct form package.module:NAME. The command line answers for them before torch loads
and imports a plugin only when it is chosen; a chosen plugin is held to its declared recipe like any kernel;
the example package installed into a fresh virtual environment is gated on the canary from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "evalgate-example-kernel"

# The console script with a probe: at exit, which of torch and the plugin's modules were imported.
PROBE = ("import atexit, json, os, sys; atexit.register(lambda: open(os.environ['EG_PROBE'], 'w').write(json.dumps("
         "{m: m in sys.modules for m in ('torch', 'goodplug.decl', 'goodplug.impl')}))); "
         "from evalgate.cli.main import entry; entry()")

DECLARATIONS = '''
from evalgate.kernels.contract import Capability, KernelSpec
from evalgate.kernels.recipe import Recipe

W4A4 = Recipe(activations="e2m1", input_ties="zero", intermediate="e2m1")
GOOD = KernelSpec(name="good/w4a4", forward="goodplug.impl:exact", recipe=W4A4, description="declares and computes w4a4")
TIES = KernelSpec(name="good/w4a4-ties", forward="goodplug.impl:ties_even", recipe=W4A4,
                  description="declares w4a4, rounds the input ties to even")
BAD_RECIPE = KernelSpec(name="broken/recipe", forward="goodplug.impl:exact", description="a field no recipe has",
                        recipe={"activations": "e2m1", "tie_mode": "zero"})
NEEDS_LIB = KernelSpec(name="broken/library", forward="goodplug.impl:exact", recipe=W4A4, description="needs a library",
                       capability=Capability(devices=("cuda",), arches=(10,), module="no_such_gemm_library"))
OLD_CLICK = KernelSpec(name="broken/version", forward="goodplug.impl:exact", recipe=W4A4, description="needs click 1",
                       capability=Capability(distribution="click", versions="<1"))
BUILTIN = KernelSpec(name="w4a4_packed", forward="goodplug.impl:exact", recipe=W4A4, description="takes a built-in name")
SYMBOLS = KernelSpec(name="good/gpu", forward="goodplug.impl:exact", recipe=W4A4, description="names its GEMM",
                     gemm_symbols=r"my_fp4_moe_kernel")
BAD_SYMBOLS = KernelSpec(name="broken/symbols", forward="goodplug.impl:exact", recipe=W4A4, description="d",
                         gemm_symbols="my_kernel(")
'''
IMPLEMENTATION = '''
from evalgate.kernels.emulator import experts_forward
from evalgate.kernels.recipe import Recipe

exact = experts_forward(Recipe(activations="e2m1", input_ties="zero", intermediate="e2m1"))
ties_even = experts_forward(Recipe(activations="e2m1", input_ties="even", intermediate="e2m1"))
'''
ENTRY_POINTS = {"good/w4a4": "goodplug.decl:GOOD", "broken/import": "brokenplug:K",
                "broken/recipe": "goodplug.decl:BAD_RECIPE", "broken/library": "goodplug.decl:NEEDS_LIB",
                "broken/version": "goodplug.decl:OLD_CLICK", "w4a4_packed": "goodplug.decl:BUILTIN",
                "broken/name": "goodplug.decl:TIES"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder laid out as an installed distribution (goodplug 0.1) offering kernels through entry points."""
    root = tmp_path_factory.mktemp("site")
    (root / "goodplug").mkdir()
    (root / "goodplug" / "__init__.py").write_text("")
    (root / "goodplug" / "decl.py").write_text(DECLARATIONS)
    (root / "goodplug" / "impl.py").write_text(IMPLEMENTATION)
    (root / "brokenplug.py").write_text("import no_such_gemm_library\n")
    info = root / "goodplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: goodplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[evalgate.kernels]\n" + "".join(f"{name} = {value}\n" for name, value in ENTRY_POINTS.items()))
    return root


def _cli(args: list[str], site: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    probe = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": str(site), "EG_PROBE": str(probe), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    return proc, json.loads(probe.read_text())


def test_a_typo_lists_installed_kernels_without_importing_them(site, tmp_path):
    proc, loaded = _cli(["gate", "--kernel", "good/w4a3"], site, tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "unknown kernel 'good/w4a3'" in proc.stderr and "good/w4a4" in proc.stderr and "w4a4_packed" in proc.stderr
    assert loaded == {"torch": False, "goodplug.decl": False, "goodplug.impl": False}


def test_a_chosen_plugin_is_checked_before_torch_and_imported_only_as_declared(site, tmp_path):
    proc, loaded = _cli(["gate", "--kernel", "good/w4a4", "--model", str(tmp_path / "nope")], site, tmp_path)
    assert proc.returncode == 2 and "--model" in proc.stderr and "kernel" not in proc.stderr, proc.stderr
    assert loaded == {"torch": False, "goodplug.decl": True, "goodplug.impl": False}


@pytest.mark.parametrize("kernel, says", [
    ("broken/import", "importing 'brokenplug' failed (ModuleNotFoundError: No module named 'no_such_gemm_library')"),
    ("broken/recipe", "declares unknown recipe field 'tie_mode'; known fields: weights, activations"),
    ("broken/library", "cannot run here: the Python module 'no_such_gemm_library' is not installed"),
    ("broken/version", "needs <1"),
    ("broken/name", "declares the name 'good/w4a4-ties'; its entry point must carry the same name"),
    ("goodplug.decl:BAD_RECIPE", "declares unknown recipe field 'tie_mode'"),
    ("goodplug.decl:MISSING", "module 'goodplug.decl' has no 'MISSING'"),
    ("goodplug.decl:BUILTIN", "a package may not replace a built-in kernel"),
    ("goodplug.decl:BAD_SYMBOLS", "declares gemm_symbols='my_kernel(', not a regular expression"),
])
def test_a_broken_plugin_is_refused_in_one_line_before_torch(site, tmp_path, kernel, says):
    proc, loaded = _cli(["gate", "--kernel", kernel], site, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert not loaded["torch"] and not loaded["goodplug.impl"]


def test_kernels_list_shows_where_each_kernel_comes_from(site, tmp_path):
    proc, _ = _cli(["kernels", "list", "--json"], site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["w4a4_packed"]["origin"] == "evalgate"  # a package cannot take a built-in's place
    assert rows["deepgemm/fp8_block128"]["capability"] == {"devices": ["cuda"], "arches": [9], "module": "deep_gemm",
                                                           "distribution": None, "versions": None}
    assert rows["w4a4_packed"]["capability"]["devices"] == ["cpu", "cuda"]
    good = rows["good/w4a4"]
    assert good["origin"] == "goodplug 0.1 (entry point goodplug.decl:GOOD)" and good["runs_here"]
    assert good["recipe"]["input_ties"] == "zero" and good["recipe"]["shared_expert"] == "outside"
    assert rows["broken/library"]["runs_here"] is False and "no_such_gemm_library" in rows["broken/library"]["why_not"]
    assert rows["broken/import"]["broken"] and "brokenplug" in rows["broken/import"]["description"]
    text, _ = _cli(["kernels", "list"], site, tmp_path)
    assert "from: goodplug 0.1 (entry point goodplug.decl:GOOD)" in text.stdout


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model):
    from evalgate.model_adapters.hf.adapter import load_model

    model, tokenizer = load_model(tiny_model, "w4a4_packed")
    text = "Question: Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much?\nAnswer:"
    return model, [tokenizer(text, return_tensors="pt").input_ids[0]]


@pytest.fixture
def direct_plugins(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    yield
    from evalgate.kernels.registry import KERNELS

    for name in [n for n in KERNELS if n.startswith("goodplug.")]:
        KERNELS.pop(name)


def test_a_plugin_is_held_to_its_recipe_and_cannot_be_its_own_reference(tiny_loaded, direct_plugins):
    from evalgate.kernels import get_kernel
    from evalgate.kernels.conformance import model_conformance

    model, prompts = tiny_loaded
    good = get_kernel("goodplug.decl:GOOD")
    assert good.reference == "w4a4" != good.name and good.tolerance is None and not good.faulty
    c = model_conformance(model, "goodplug.decl:GOOD", prompts)
    assert c.checked and c.ok and c.identical and c.reference == "w4a4"
    assert c.implementation["library"] == "named directly" and c.implementation["module"] == "goodplug.impl"
    wrong = model_conformance(model, "goodplug.decl:TIES", prompts)
    assert wrong.checked and not wrong.ok and wrong.failed_experts > 0


def test_kernels_check_measures_a_plugin_beside_its_recipe(direct_plugins):
    from evalgate.kernels.check import layer_check

    rows = {r["kernel"]: r for r in layer_check("tiny", 16, kernels=["w4a4", "goodplug.decl:GOOD"])}
    assert rows["goodplug.decl:GOOD"]["calc_diff"] == rows["w4a4"]["calc_diff"] > 0


def test_the_execution_witness_holds_a_plugin_to_the_symbols_it_declares(direct_plugins):
    from evalgate.kernels import get_kernel
    from evalgate.kernels.witness import expectation

    declared = expectation(get_kernel("goodplug.decl:SYMBOLS"))
    assert declared.required == declared.allowed == "my_fp4_moe_kernel"
    assert expectation(get_kernel("goodplug.decl:GOOD")).required is None  # none declared: recorded only


def test_a_recipe_no_builtin_computes_gets_evalgates_emulation_as_reference(site, monkeypatch, tmp_path):
    from evalgate.kernels import get_kernel, plugins
    from evalgate.kernels.registry import KERNELS

    (tmp_path / "te_unfused.py").write_text(textwrap.dedent('''
        from evalgate.kernels.contract import KernelSpec
        K = KernelSpec(name="x/te-unfused", forward="goodplug.impl:exact", description="d",
                       recipe={"activations": "e2m1", "input_ties": "even", "intermediate": "e2m1",
                               "routed_scaling": "unfused"})
    '''))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        kernel = get_kernel("te_unfused:K")
        reference = get_kernel(kernel.reference)
        assert kernel.reference.startswith("recipe/") and reference.experts_forward.recipe.routed_scaling == "unfused"
        assert plugins.declaration("te_unfused:K").recipe == reference.experts_forward.recipe
    finally:
        for name in [n for n in KERNELS if n.startswith(("te_unfused", "recipe/"))]:
            KERNELS.pop(name)


def test_the_recipes_torch_free_tables_match_the_quantizers():
    from evalgate.kernels import formats, recipe

    assert recipe.TIES == formats.TIES
    assert recipe.INPUT_AMAX_FLOORS == {name: rule.amax_floor for name, rule in formats.SCALE_RULES.items()}


# --- the example package, installed into a fresh virtual environment -------------------------------------


def _venv_evalgate(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_") and k != "PYTHONPATH"}
    return subprocess.run([str(venv / "bin" / "python"), "-m", "evalgate", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**env, "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_the_example_package_installed_in_a_fresh_venv_is_gated_on_the_canary(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                              "--no-build-isolation", "-e", str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    listed = _venv_evalgate(venv, ["kernels", "list"], tmp_path)
    assert "from: evalgate-example-kernel 0.1.0 (entry point evalgate_example_kernel.declarations:CPU)" in listed.stdout

    out = tmp_path / "pass"
    proc = _venv_evalgate(venv, ["gate", "--kernel", "example/w4a4_packed-cpu", "--tasks", "gsm8k", "--out", str(out)],
                          tmp_path)
    assert proc.returncode == 0 and "verdict: PASS" in proc.stdout, proc.stdout + proc.stderr
    gate = json.loads((out / "gate" / "gate.json").read_text())
    conformance = json.loads((out / "manifest.json").read_text())["kernel"]["conformance"]
    assert gate["candidate"]["kernel"]["name"] == "example/w4a4_packed-cpu"
    assert conformance["checked"] and conformance["identical"] and conformance["reference"] == "w4a4"

    out = tmp_path / "fault"
    proc = _venv_evalgate(venv, ["gate", "--kernel", "evalgate_example_kernel.declarations:FAULTY_TIES",
                                 "--tasks", "gsm8k", "--out", str(out)], tmp_path)
    assert proc.returncode == 1 and "verdict: FAIL" in proc.stdout, proc.stdout + proc.stderr
    conformance = json.loads((out / "manifest.json").read_text())["kernel"]["conformance"]
    assert conformance["checked"] and not conformance["ok"] and conformance["failed_experts"] > 0

    proc = _venv_evalgate(venv, ["gate", "--kernel", "example/w4a4_packed-b200"], tmp_path)
    assert proc.returncode == 2 and "cannot run here" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
