"""parity: a differential checker for LLM serving runtimes (eager vs prefill graph replay)."""

__version__ = "0.1.0"
