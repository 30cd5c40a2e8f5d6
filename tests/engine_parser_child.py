"""Feed command lines to SGLang's own argument parser, in a process of its own (run by
tests/test_engine_parsers.py with the engine's pure-Python package, installed without its GPU
dependencies, on PYTHONPATH).

Reads a JSON list of argument lists on stdin; writes one JSON answer per list: ``{"ok": true, "args": {...}}``
with the parsed values the launcher relies on, or ``{"ok": false, "error": "..."}`` when the parser refuses.
Only the modules the parser's import chain needs and cannot load without a GPU stack are stubbed (``STUBS``);
the parser itself (``ServerArgs.add_cli_args`` on an ``argparse.ArgumentParser``, as ``prepare_server_args``
builds it) is the engine's own.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import sys
import types

# imported at module level by sglang.srt.utils.common / configs, never used by the parser
STUBS = {"PIL", "torchvision", "partial_json_parser", "sentencepiece", "xgrammar"}
FIELDS = ("model_path", "host", "port", "tp_size", "dp_size", "enable_deterministic_inference", "moe_a2a_backend",
          "chunked_prefill_size", "enable_w4a4_mxfp4_megamoe", "enable_dp_attention")


class _Anything:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        return _Anything(self._name)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (object,)

    def __get_pydantic_core_schema__(self, source, handler):  # a stubbed type inside a pydantic model (0.5.17-0.5.19)
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _StubModule(types.ModuleType):
    __path__: list = []
    __version__ = "0.0.0"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in STUBS else None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def parser() -> argparse.ArgumentParser:
    sys.meta_path.insert(0, _Stubs())
    import transformers

    # an SGLang built against an older transformers registers config names the pinned one already has
    register = transformers.AutoConfig.register
    transformers.AutoConfig.register = staticmethod(lambda *a, **k: register(*a, **{**k, "exist_ok": True}))
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(p)
    return p


def main() -> None:
    p = parser()
    answers = []
    for argv in json.load(sys.stdin):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = p.parse_args(argv)
            answers.append({"ok": True, "args": {f: getattr(ns, f, None) for f in FIELDS},
                            "fields": sorted(vars(ns))})  # what /server_info's resolved server arguments hold
        except SystemExit:
            answers.append({"ok": False, "error": err.getvalue().strip().splitlines()[-1:]})
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
