"""In-process transformers adapter: load a local checkpoint with the chosen kernel, generate (greedy, or the
keyed sampler of ``sampling.py`` for requests at temperature > 0).

The kernel reaches the model through transformers' experts interface (``experts_implementation=<name>``),
never by monkeypatching: ``evalgate.kernels`` registers every kernel name on it at import.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

from evalgate.errors import UserError
from evalgate.kernels import get_kernel
from evalgate.model_adapters.hf.fingerprint import check_model_dir, model_fingerprint
from evalgate.model_adapters.hf.generation import decode, decode_stream
from evalgate.model_adapters.hf.sampling import SampleKey
from evalgate.types import AdapterBase, Generation, Request

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


NUMERICS = ("auto", "canonical", "native")


def load_model(path: str | Path, kernel_name: str, device: str = "cpu", dtype: str | None = None,
               numerics: str = "auto", device_map: str | None = None, threads: int | None = None):
    """(model, tokenizer) with ``kernel_name`` serving every MoE experts module; ``threads``: the CPU threads
    asked for (``--threads``; None: ``evalgate.cores`` decides).

    An FP4 checkpoint with ``device_map`` (``auto``, ``cpu``, ``cuda:0,cuda:1``; the run's ``--device-map``),
    or on a GPU with an emulated kernel, is planned and streamed onto its devices with the experts kept packed
    (``streamed.py``; a model that does not fit is refused before loading). Otherwise transformers loads it
    on the CPU, dequantized, and the stored codes are attached.

    ``numerics="canonical"`` gives the model a batch-, thread- and instruction-set-invariant forward pass
    (``invariant.install``; docs/kernels.md#canonical-numerics); a model it does not cover (another
    architecture) keeps PyTorch's numerics, with a warning on stderr, and ``invariant.numerics(model)`` says
    which one it got. ``"native"``: PyTorch's own numerics. ``"auto"`` (default): ``resolved_numerics``."""
    if numerics not in NUMERICS:
        raise UserError(f"numerics {numerics!r}; choose one of: {', '.join(NUMERICS)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress style: evalgate's own (run/progress.py), in CI logs too
    d = check_model_dir(path)
    kernel = get_kernel(kernel_name)
    device_map = streamed_device_map(d, kernel, device, device_map)
    if device_map is not None:
        return _load_streamed(d, kernel, device_map, dtype, numerics, threads)
    kwargs = {"experts_implementation": kernel.name}
    if dtype is not None:
        kwargs["dtype"] = DTYPES[dtype]
    from evalgate.kernels.checkpoint import dequantizing_config, is_fp4_checkpoint

    if is_fp4_checkpoint(d):  # load on the CPU, dequantized, whatever GPU is present; codes re-attached below
        from evalgate.model_adapters.loading.released_layout import check_layout

        check_layout(d)  # a mis-laid FP8 dense weight is refused here, in one line, not deep in transformers
        kwargs["quantization_config"] = dequantizing_config(d)
    from evalgate.model_adapters.loading.fp4_unpack import fast_fp4_unpack

    try:
        tokenizer = AutoTokenizer.from_pretrained(d)
        with fast_fp4_unpack():  # the same floats as transformers' own unpacking, ~40x sooner
            model = AutoModelForCausalLM.from_pretrained(d, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load model from {str(d)!r}: {first}") from None
    prepare = getattr(kernel, "prepare_model", None)
    if prepare is not None:  # e.g. attach the stored FP4 codes of an FP4 checkpoint
        prepare(model, d)
    model = model.to(device).eval()
    _finish(model, numerics, threads)
    return model, tokenizer


def resolved_numerics(model, numerics: str) -> str:
    """What ``numerics="auto"`` means for ``model`` where it now lies: canonical, except for a DeepSeek-V4
    model with compressed attention on a GPU, which keeps PyTorch's numerics. Its decoding steps run there
    as CUDA graphs of the whole step (the speed the README measures at full width); the canonical forward
    synchronises with the host in every step and keeps float64 grids of the dense weights (4 times their
    BF16 bytes). ``canonical`` and ``native`` are what they say."""
    if numerics != "auto":
        return numerics
    from evalgate.model_adapters.canonical.invariant_compressed import compressed_attention

    if any(p.device.type == "cuda" for p in model.parameters()) and compressed_attention(model):
        print("evalgate: PyTorch's own numerics for compressed attention on a GPU (CUDA-graphed steps); outputs "
              "may depend on the batch (numerics='canonical' makes them invariant, at a cost)", file=sys.stderr)
        return "native"
    return "canonical"


def _finish(model, numerics: str, threads: int | None = None) -> None:
    from evalgate.cores import configure_torch  # the cores we may use, not the machine's

    configure_torch(getattr(model.config, "hidden_size", None), threads)
    resolved = resolved_numerics(model, numerics)
    placement = getattr(model, "_evalgate_placement", None)
    if resolved == "native" and placement is not None:  # FP8 dense weights on GPUs: read, not dequantized each step
        from evalgate.model_adapters.canonical.fp8_linear import hold_dequantized
        from evalgate.model_adapters.loading.streamed import device_capacities

        hold_dequantized(model, placement.reserve_per_device, lambda device: device_capacities([device])[0][1])
    if resolved == "canonical":
        from evalgate.model_adapters.canonical import invariant

        try:
            invariant.install(model)
        except NotImplementedError as exc:
            print(f"evalgate: PyTorch's own numerics for this model, outputs may depend on the batch: {exc}",
                  file=sys.stderr)
    if any(p.device.type == "cuda" for p in model.parameters()):  # eager's score tensor does not fit a GPU
        from evalgate.model_adapters.fast import attention, triton_layers

        attention.install(model)
        triton_layers.install(model)  # PyTorch's numerics: hundreds of tiny kernels a layer become a dozen


def streamed_device_map(d: Path, kernel, device: str, device_map: str | None) -> str | None:
    """The device map to stream with, or None for transformers' loader: ``device_map`` (the run's
    ``--device-map``) when given; an FP4 checkpoint on a GPU with an emulated kernel streams onto ``device``."""
    from evalgate.kernels.checkpoint import is_fp4_checkpoint

    if device_map is not None:
        return device_map
    emulated = getattr(kernel.experts_forward, "recipe", None) is not None
    if device != "cpu" and emulated and is_fp4_checkpoint(d):
        return device
    return None


def _load_streamed(d: Path, kernel, device_map: str, dtype: str | None, numerics: str, threads: int | None = None):
    from transformers import AutoTokenizer

    from evalgate.model_adapters.loading.streamed import dispatch, load_streamed

    try:
        tokenizer = AutoTokenizer.from_pretrained(d)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load the tokenizer from {str(d)!r}: {first}") from None
    model = load_streamed(d, kernel.name, device_map, dtype)
    _finish(model, numerics, threads)
    return dispatch(model), tokenizer



def greedy_decoder(model, tokenizer, device):
    """``decode(prompts, new_tokens)``: greedy decoding of ``prompts`` through this model, no stops, as the
    execution witness (kernels/witness.py) drives it."""
    def decode_prompts(prompts: list[str], new_tokens: int):
        return decode(model, tokenizer, prompts, [()] * len(prompts), [new_tokens] * len(prompts), device=str(device))
    return decode_prompts


class HFAdapter(AdapterBase):
    """Generates for evalgate's requests with a local checkpoint and one kernel."""

    kind = "hf"
    serving = "stream"

    def __init__(self, path: str | Path, kernel_name: str, device: str = "cpu", dtype: str | None = None,
                 batch_size: int = 8, numerics: str = "auto", device_map: str | None = None,
                 threads: int | None = None):
        t0 = time.perf_counter()
        self.path = check_model_dir(path)
        self.kernel = get_kernel(kernel_name)
        self.device = device
        self.batch_size = batch_size
        self.model, self.tokenizer = load_model(self.path, kernel_name, device, dtype, numerics, device_map, threads)
        placement = getattr(self.model, "_evalgate_placement", None)
        if placement is not None:  # streamed: inputs go to the device of the first part
            self.device = placement.devices[0]
        self.load_s = time.perf_counter() - t0

    def info(self) -> dict:
        """The model's identity and serving settings, as the run manifest records them. ``numerics`` is
        ``canonical-v1`` (invariant forward, exact kernel accumulation) or ``native``: runs of different
        numerics are not comparable (docs/kernels.md#canonical-numerics)."""
        import transformers

        from evalgate.model_adapters.canonical.invariant import numerics

        return {
            "adapter": self.kind,
            "path": str(self.path),
            **model_fingerprint(self.path),
            "dtype": str(self.model.dtype).replace("torch.", ""),
            "numerics": numerics(self.model),
            "device": self.device,
            "batch_size": self.batch_size,
            **self._placement(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        }

    def conformance(self, prompts: list[str]) -> dict:
        """The kernel against the kernel it declares it computes, on the hidden states this model's forward
        pass over ``prompts`` hands its experts (the run manifest records it; the gate FAILs a kernel that
        does not conform, kernels/conformance.py)."""
        from evalgate.kernels.checkpoint import experts_modules
        from evalgate.kernels.conformance import model_conformance
        from evalgate.kernels.witness import joined, watch

        ids = [self.tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
        record = model_conformance(self.model, self.kernel.name, ids).to_dict()
        if not experts_modules(self.model):  # no routed experts: no kernel of evalgate's ran
            return record
        # what actually ran in the MoE layers, held against the kernel named (kernels/witness.py)
        return joined(record, watch(self.model, self.kernel, prompts, self.device,
                                    greedy_decoder(self.model, self.tokenizer, self.device)))

    def _placement(self) -> dict:
        placement = getattr(self.model, "_evalgate_placement", None)
        return {} if placement is None else {"placement": placement.summary()}

    def generate(self, requests: list[Request]) -> list[Generation]:
        keys = _sample_keys(requests)
        t0 = time.perf_counter()
        raw = decode(self.model, self.tokenizer, [r.prompt for r in requests], [r.stop for r in requests],
                     [r.max_new_tokens for r in requests], device=self.device, keys=keys)
        per_item = (time.perf_counter() - t0) / max(len(requests), 1)
        return [_generation(g, per_item) for g in raw]

    def generate_stream(self, requests: list[Request], batch_size: int | None = None):
        """Continuous batching over all ``requests``: yields lists of (request index, Generation) as items
        finish, at most ``batch_size`` (default: the adapter's) decoding at once in each of the decoding
        processes (``cores.generation_workers``: on a CPU, one per available core, forked). What an item produces does
        not depend on when it ran beside which others (canonical numerics, ``generation.decode_stream``); the
        requests' ``expected_tokens`` only balance the decoding processes."""
        keys = _sample_keys(requests)
        from evalgate.cores import generation_workers

        workers = generation_workers()[0] if self.device == "cpu" else 1
        stream = decode_stream(self.model, self.tokenizer, [r.prompt for r in requests], [r.stop for r in requests],
                               [r.max_new_tokens for r in requests], device=self.device, keys=keys,
                               batch_size=batch_size or self.batch_size, workers=workers,
                               expected_tokens=[r.expected_tokens for r in requests])
        for finished in stream:
            yield [(i, _generation(g, g.latency_s or 0.0)) for i, g in finished]


def _sample_keys(requests: list[Request]) -> list[SampleKey | None]:
    """Refuses chat requests; a sampled request carries its own stream seed, so its samples do not depend on
    the batch it lands in (None: greedy)."""
    if any(r.messages for r in requests):
        raise UserError("chat profiles need a chat template; use a completion profile with a local checkpoint")
    return [SampleKey(r.seed, r.temperature) if r.temperature > 0 else None for r in requests]


def _generation(g, latency_s: float) -> Generation:
    return Generation(text=g.text, finish_reason=g.finish_reason, stop_hit=g.stop_hit,
                      n_prompt_tokens=g.n_prompt_tokens, n_tokens=len(g.token_ids), latency_s=latency_s)
