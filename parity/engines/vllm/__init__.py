"""The vLLM backend: real `vllm serve` servers per execution mode, with parity's tap as a vLLM plugin.

- `servers`: each mode's command line and environment (graph modes, capture sizes), the facts read
  from `--vllm-arg`s, GPU placement.
- `client`: the OpenAI chat bodies (generation, teacher-forced scoring via prompt logprobs) and
  their answers.
- `plugin`: the `vllm.general_plugins` entry point, which wraps vLLM's methods as they are imported.
- `tap`: what the wrappers do in the model process: one record per engine step, the DeepStack
  fingerprint, the zero arm, the engine's own graph decision, and the stale-DeepStack leak witness.
- `backend`: the Backend protocol over these, and `create_vllm_backend`.

What any engine backend needs lives in `parity.engines`. Nothing is imported here: vLLM imports
`parity.engines.vllm.plugin` in every process, and that must stay cheap and free of vLLM and torch.
"""
