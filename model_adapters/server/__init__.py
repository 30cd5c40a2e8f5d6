"""A model behind an OpenAI-compatible server: the client adapter, the kernel table per engine, launching
and verifying a server, and ``evalgate serve`` (``serve.py``)."""
