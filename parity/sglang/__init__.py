"""The SGLang backend: real servers per execution mode, with parity's tap as an SGLang plugin.

- `launcher`: server processes (free loopback port, own process group, /ready, group stop).
- `client`: the native /generate request body and its answer.
- `plugin`: the `sglang.srt.plugins` entry point and the control channel it reads.
- `backend`: the Backend protocol over the three, and `create_sglang_backend`.

Nothing is imported here: SGLang imports `parity.sglang.plugin` in every server process, and
that must stay cheap and free of the backend's dependencies.
"""
