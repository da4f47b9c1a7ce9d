"""The SGLang backend: real servers per execution mode, with parity's tap as an SGLang plugin.

- `servers`: each mode's command line, the facts read from `--sglang-arg`s, GPU placement and start order.
- `client`: the native /generate bodies (generation, teacher-forced scoring) and their answers.
- `plugin`: the `sglang.srt.plugins` entry point and the hook.
- `backend`: the Backend protocol over these, and `create_sglang_backend`.
- `server_checks`: what parity checks before a launch and about a running server beyond the tap.
- `deepstack_slot`: parity's fix, the DeepStack replay slot for SGLang 0.5.23's prefill runner
  (loaded by `plugin` when asked for).
- On a CPU: `kernel_standin` (the `sgl_kernel` stand-in), `emulated_graph` (torch.cuda.CUDAGraph
  on any device), `cpu_patches` (the in-server changes), and `standin/`, the folder put on the
  servers' PYTHONPATH (its `sitecustomize` installs them).

What any engine backend needs (server processes, the tap's channel and records, evidence, GPU
placement, prompts) lives in `parity.engines`.

Nothing is imported here: SGLang imports `parity.engines.sglang.plugin` in every server process, and
that must stay cheap and free of the backend's dependencies.
"""
