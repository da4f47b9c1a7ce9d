"""The in-process `transformers` backend as the registry knows it: its options and capabilities
(design §5). Light: no torch (the verdict and the reports read it)."""

from __future__ import annotations

from parity.capabilities import BackendInfo

TRANSFORMERS = BackendInfo(
    name="transformers", factory="parity.backends.transformers_backend:from_options",
    options=frozenset({"runner", "poison", "localize_threshold", "buckets", "graph_backend", "threads", "chunk_size"}),
    localizes=True, in_process=True,
    config_fields=frozenset({"runner", "poison", "graph_backend", "buckets", "captured_buckets", "deepstack_slot_bytes",
                             "preset_seed", "chunk_size", "prefix_cache_page", "localize_threshold"}),
)
