"""The execution witness: which code actually ran inside the model's MoE layers, held against the kernel named.

Conformance (conformance.py) checks a kernel's numbers; it cannot tell a library kernel from another path
that computes close enough numbers (a wrapper that silently falls back to a PyTorch GEMM passes a real
kernel's tolerance). The witness watches a few of the run's own decoding steps (the first prompts' prefills
and one eager decoding step, through the same code the run generates with) and records what executed inside
each routed-experts module:

- on a GPU, the CUDA kernels (the PyTorch profiler's CUDA activity, names and counts), each layer call
  bracketed by a device synchronisation so that a kernel belongs to the call that launched it;
- on a CPU, the Python functions of evalgate's kernels and of the kernel's library that ran.

On a GPU it is held against the kernel named (docs/kernels.md#execution-witness): every MoE layer call must run
the library's own symbols (a real kernel) or evalgate's Triton GEMM kernels (an emulated one), and no other
GEMM may run there. A test double is held to its healthy twin's symbols, since that is what it claims to be.
A mismatch makes the kernel's conformance record fail, so the gate FAILs it as a conformance failure.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .checkpoint import experts_modules

PROMPTS = 2  # prompts whose prefill and first decoding step are watched
NEW_TOKENS = 2  # the prefill's token, then one eager decoding step
KEPT = 40  # kernel / function names kept in the record, most frequent first
NAME_CHARS = 200  # a demangled CUDA kernel name is cut here in the record

# A GEMM of any library: cuBLAS (gemm, xmma, nvjet), CUTLASS, Triton matmuls, PyTorch's grouped and scaled mm.
GEMM = re.compile(r"gemm|matmul|xmma|nvjet|cutlass|cublas|wgmma|grouped_mm|scaled_mm|gemv|_mm_|bmm", re.IGNORECASE)
# evalgate's Triton GEMM kernels (kernels/triton/fast.py, gemm.py): what an emulated kernel runs on a GPU
EMULATED_GEMMS = r"^_(l1_kernel|l2_kernel|int_gemm|f64_gemm|l1_split_epilogue|l2_split_epilogue)\b"
# A real kernel's library -> the symbols of its GEMM on the GPU (its CUDA kernel names as CUPTI reports them)
LIBRARY_GEMMS = {
    "deep_gemm": r"sm90_fp8_gemm_1d2d_impl|sm100_fp8_fp4_mega_moe|deep_gemm::",
}


@dataclass(frozen=True)
class Expectation:
    """What the witness must see in every MoE layer call: ``required`` (a regular expression over kernel
    names), and no GEMM outside ``allowed``. ``required`` None: the symbols are not on file (recorded only)."""

    required: str | None
    allowed: str | None
    what: str


def expectation(kernel) -> Expectation:
    """What ``kernel`` (a registry Kernel) must run on a GPU; a test double claims its twin's symbols."""
    from .catalogs import get_kernel

    claimed = get_kernel(kernel.twin) if kernel.faulty and kernel.twin else kernel
    if claimed.real:
        # a kernel of another package declares its GEMM symbols (KernelSpec.gemm_symbols, kernels/contract.py)
        symbols = getattr(claimed.library, "gemm_symbols", None) or LIBRARY_GEMMS.get(claimed.library.module)
        if symbols is None:
            return Expectation(None, None, f"{claimed.library.name}'s GEMM symbols are not on file: recorded only")
        return Expectation(symbols, symbols, f"{claimed.library.name}'s kernels (/{symbols}/) in every MoE layer "
                           "call, no other GEMM")
    return Expectation(EMULATED_GEMMS, EMULATED_GEMMS, "evalgate's Triton GEMM kernels in every MoE layer call, no "
                       "other GEMM")


@dataclass
class Witness:
    kernel: str
    device: str  # "cuda" or "cpu"
    method: str
    steps: int = 0  # model forward passes watched
    layer_calls: int = 0  # routed-experts calls watched
    ran: dict = field(default_factory=dict)  # name -> count over every watched call, most frequent first
    expected: str | None = None
    held: bool = False  # False: recorded only (a CPU, or symbols not on file)
    missing: int = 0  # layer calls in which the expected symbols did not run
    foreign: dict = field(default_factory=dict)  # GEMMs outside the allowed ones -> count
    matched: dict = field(default_factory=dict)  # the named kernel's symbols seen -> count: the evidence itself
    ok: bool = True
    seconds: float = 0.0

    def summary(self) -> str:
        where = f"{self.layer_calls} MoE layer calls over {self.steps} forward passes"
        if not self.layer_calls:
            return f"execution witness: no MoE layer call observed ({self.method})"
        if not self.held:
            return f"execution witness ({self.device}): recorded what ran in {where}; {self.expected or 'nothing held'}"
        if self.ok:
            seen = ", ".join(f"{n[:60]} x{c}" for n, c in list(self.matched.items())[:2])
            return (f"execution witness: {self.expected.split(' (')[0]} ran in all {where}"
                    f"{f' ({seen})' if seen else ''}, no other GEMM path")
        problems = []
        if self.missing:
            problems.append(f"the named kernel's symbols did not run in {self.missing} of {self.layer_calls} MoE "
                            "layer calls")
        if self.foreign:
            top = ", ".join(f"{n[:80]} x{c}" for n, c in list(self.foreign.items())[:3])
            problems.append(f"another GEMM path ran: {top}")
        return f"execution witness FAILED for {self.kernel}: {'; '.join(problems)} ({where})"

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}


def _top(counter: Counter) -> dict:
    return {name[:NAME_CHARS]: n for name, n in counter.most_common(KEPT)}


def hold(witness: Witness, calls: list[Counter], expect: Expectation) -> Witness:
    """Fill ``witness`` from the kernel names of each watched layer call and judge them against ``expect``."""
    total = Counter()
    for c in calls:
        total.update(c)
    witness.layer_calls, witness.ran, witness.expected = len(calls), _top(total), expect.what
    if expect.required is None or not calls:
        witness.held, witness.ok = False, bool(calls) or witness.device != "cuda"
        return witness
    if witness.device == "cuda" and not total:  # the profiler saw no CUDA activity at all (no CUPTI here)
        witness.held, witness.expected = False, f"{expect.what}: not held, the profiler recorded no CUDA kernel"
        return witness
    required, allowed = re.compile(expect.required), re.compile(expect.allowed or expect.required)
    witness.held = True
    witness.missing = sum(1 for c in calls if not any(required.search(n) for n in c))
    witness.matched = _top(Counter({n: k for n, k in total.items() if required.search(n)}))
    witness.foreign = _top(Counter({n: k for n, k in total.items() if GEMM.search(n) and not allowed.search(n)}))
    witness.ok = witness.missing == 0 and not witness.foreign
    return witness


# --- watching -----------------------------------------------------------------------------------------------


class _Calls:
    """Forward hooks on every routed-experts module: each call's span, as the profiler sees it on a GPU, or the
    Python functions it ran on a CPU."""

    def __init__(self, model, device: str, library: str | None):
        self.modules = experts_modules(model)
        self.device, self.library = device, library
        self.calls: list[Counter] = []
        self.markers: list = []
        self.hooks = []

    def __enter__(self):
        for layer, module in self.modules.items():
            self.hooks.append(module.register_forward_pre_hook(self._pre(layer)))
            self.hooks.append(module.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        sys.setprofile(None)

    def _capturing(self) -> bool:
        return self.device == "cuda" and torch.cuda.is_current_stream_capturing()

    def _pre(self, layer):
        def hook(module, args):
            if self._capturing():  # a CUDA graph being captured runs nothing now; its replay has no hooks
                return
            if self.device == "cuda":
                torch.cuda.synchronize()  # what ran before belongs to no layer call
                marker = torch.profiler.record_function(f"evalgate.witness.layer{layer}")
                marker.__enter__()
                self.markers.append(marker)
            else:
                counter = Counter()
                self.calls.append(counter)
                sys.setprofile(self._profiler(counter))
        return hook

    def _post(self, module, args, output):
        if self._capturing():
            return
        if self.device == "cuda":
            torch.cuda.synchronize()  # everything this call launched has run inside its span
            if self.markers:
                self.markers.pop().__exit__(None, None, None)
        else:
            sys.setprofile(None)

    def _profiler(self, counter: Counter):
        prefixes = ("evalgate.kernels",) + ((self.library,) if self.library else ())

        def profile(frame, event, arg):
            if event == "call":
                module = frame.f_globals.get("__name__", "")
                if module.startswith(prefixes):
                    counter[f"{module}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"] += 1
        return profile


def _kernels_per_call(events) -> list[Counter]:
    """The CUDA kernels inside each layer call's span (its marker, bracketed by synchronisations)."""
    from torch.autograd import DeviceType

    markers = sorted((e for e in events if e.name.startswith("evalgate.witness.layer")),
                     key=lambda e: e.time_range.start)
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    calls = []
    for m in markers:
        inside = Counter(k.name for k in kernels if m.time_range.start <= k.time_range.start <= m.time_range.end)
        if not inside:  # the launch links instead: kernels attributed to the marker's own operators
            inside = Counter(k.name for e in _subtree(m) for k in getattr(e, "kernels", []))
        calls.append(inside)
    return calls


def _subtree(event):
    yield event
    for child in event.cpu_children:
        yield from _subtree(child)


def watch(model, kernel, prompts: list[str], device: str,
          decode: Callable[[list[str], int], object]) -> Witness:
    """Run the first ``PROMPTS`` of ``prompts`` through the run's own decoding for ``NEW_TOKENS`` tokens and
    return the witness of what ran in the MoE layers, judged on a GPU. ``decode(prompts, new_tokens)`` is the
    adapter's decoding, handed in: kernels sit below the model adapters and do not import them."""
    on_gpu = str(device).startswith("cuda")
    library = kernel.library.module if kernel.real else None
    method = ("torch.profiler CUDA activity inside each routed-experts call" if on_gpu else
              "Python functions of evalgate.kernels" + (f" and {library}" if library else "") +
              " called inside each routed-experts call")
    witness = Witness(kernel.name, "cuda" if on_gpu else "cpu", method)
    chosen = prompts[:PROMPTS]
    steps = [0]

    def count(module, args, kwargs):
        steps[0] += 1

    t0 = time.perf_counter()
    counter = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with _Calls(model, witness.device, library) as calls:
            run = lambda: decode(chosen, NEW_TOKENS)  # noqa: E731
            if on_gpu:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                try:
                    with torch.profiler.profile(activities=activities) as prof:
                        run()
                    per_call = _kernels_per_call(prof.events())
                except RuntimeError as exc:  # the profiler cannot run here: say so, hold nothing
                    witness.method += f" (the profiler could not run: {exc})"
                    run()
                    per_call = None
            else:
                run()
                per_call = calls.calls
    finally:
        counter.remove()
    witness.steps = steps[0]
    expect = expectation(kernel) if on_gpu else Expectation(None, None, _cpu_expectation(kernel))
    if per_call is None:
        expect = Expectation(None, None, "not held: the profiler could not run")
    hold(witness, per_call or [], expect)
    if per_call is None:
        witness.ok = True
    witness.seconds = round(time.perf_counter() - t0, 3)
    return witness


def _cpu_expectation(kernel) -> str:
    what = "the library's functions" if kernel.real else "the emulator's functions"
    return f"{what} (a CPU has no GPU kernels to hold against the named kernel: recorded only)"


def joined(conformance: dict, witness: Witness) -> dict:
    """The conformance record with the witness inside it: a witness that fails fails the record, so the gate
    FAILs the kernel as it FAILs a conformance failure (the kernel is not what it says)."""
    record = {**conformance, "witness": witness.to_dict()}
    if not witness.ok:
        record["ok"] = False
        record["summary"] = f"{witness.summary()}; {conformance.get('summary', '')}".rstrip("; ")
    return record
