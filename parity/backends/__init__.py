"""What a backend is (`protocol`), what the command line asks of one (`options`), and the in-process
backend (`transformers_backend`). Backends by name, and every engine, are in `parity.engines`
(`registry`): nothing here imports an engine.
"""
