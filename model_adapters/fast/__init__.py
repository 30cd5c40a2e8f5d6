"""The GPU decoding path: tiled attention, per-row slot KV caches, whole steps as CUDA graphs, Triton layers."""
