"""The in-process transformers adapter (``adapter.HFAdapter``) and what runs on its model in-process."""
