"""The model side of a run, by concern (each sub-package imports only those above it in this list):

- ``canonical/``: canonical numerics, a forward pass whose bits do not depend on the batch (and FP8 linears);
- ``loading/``: reading a checkpoint's bytes, its released layout, and placing it streamed onto devices;
- ``fast/``: the GPU decoding path: tiled attention, per-row slot caches, CUDA-graph steps, Triton layers;
- ``hf/``: the in-process transformers adapter (``HFAdapter``): loading, decoding, sampling, the model's
  fingerprint, teacher-forced replay for ``evalgate explain``, and the tiny test model;
- ``server/``: a model behind an OpenAI-compatible server: the client adapter, the engines' kernel table,
  launching and verifying a server, and ``evalgate serve``.

``stops.py`` and ``sample_seeds.py`` are what both adapters share (torch-free).
"""
