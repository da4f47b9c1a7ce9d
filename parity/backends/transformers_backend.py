"""The in-process backend: eager arms call the LM body, bcg arms replay it through the graph runner.

A generation step is a full prefill of the whole sequence so far (no KV cache), so every token of
every arm goes through the path under test: the eager body or a graph replay.
"""

from __future__ import annotations

import platform
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import torch

from parity.backends.base import Generation, Request
from parity.errors import ArmFailure
from parity.graph_runner import DEFAULT_BUCKETS, GraphBackend, PrefillGraphRunner, RunnerVariant
from parity.models import LoadedModel
from parity.models.qwen3_vl import PreparedPrompt, Qwen3VLAdapter
from parity.tap import DeepStackRecord, apply_tap

TOP_K = 5


class LMExecutor:
    """The one place that decides eager vs replay for an LM body call."""

    def __init__(self, adapter: Qwen3VLAdapter, runner: PrefillGraphRunner | None) -> None:
        self.adapter = adapter
        self.runner = runner

    def will_replay(self, num_tokens: int) -> bool:
        return self.runner is not None and self.runner.can_replay(num_tokens)

    def hidden_states(self, prompt: PreparedPrompt, deepstack: torch.Tensor | None) -> torch.Tensor:
        if self.will_replay(prompt.input_embeds.shape[0]):
            return self.runner.replay(prompt.input_embeds, prompt.positions, deepstack)
        return self.adapter.body(prompt.input_embeds, prompt.positions, deepstack)


class TransformersSession:
    def __init__(self, executor: LMExecutor, max_new_tokens: int) -> None:
        self._executor = executor
        self._max_new_tokens = max_new_tokens

    def generate(self, request: Request, deepstack: str) -> Generation:
        try:
            return self._generate(request, "record" if deepstack == "normal" else "zero")
        except (RuntimeError, ValueError) as err:  # a forward or a fail-closed slot refresh
            raise ArmFailure(f"{err.__class__.__name__}: {err}") from err

    @torch.inference_mode()
    def _generate(self, request: Request, tap_mode: str) -> Generation:
        adapter = self._executor.adapter
        prompt = adapter.prepare(request.fixture, request.prompt)
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[tuple[tuple[int, float], ...]] = []
        first_record: DeepStackRecord | None = None
        calls = 0
        for _ in range(self._max_new_tokens):
            # The tap at the LM entry, outside anything a graph captured.
            deepstack, record = apply_tap(tap_mode, prompt.deepstack)
            if record is not None:
                calls += 1
                if first_record is None:
                    first_record = replace(record, replay=self._executor.will_replay(prompt.input_ids.shape[0]))
            hidden = self._executor.hidden_states(prompt, deepstack)
            step_logprobs = torch.log_softmax(adapter.lm_head(hidden[-1]).float(), dim=-1)
            token = int(step_logprobs.argmax())
            ids.append(token)
            logprobs.append(float(step_logprobs[token]))
            values, indices = step_logprobs.topk(TOP_K)
            top.append(tuple((int(i), float(v)) for i, v in zip(indices, values)))
            if token in adapter.eos_token_ids:
                break
            prompt = adapter.append_token(prompt, token)
        return Generation(
            token_ids=tuple(ids),
            text=adapter.tokenizer.decode(ids, skip_special_tokens=True),
            token_logprobs=tuple(logprobs),
            top_logprobs=tuple(top),
            deepstack_record=None if first_record is None else replace(first_record, calls=calls),
        )


class TransformersBackend:
    """One loaded model for every mode; the graph runner is built (and captured) once per run."""

    name = "transformers"

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_new_tokens: int,
        runner_variant: RunnerVariant = RunnerVariant.FIXED,
        graph_backend: str = "auto",
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        self.loaded = loaded
        self.max_new_tokens = max_new_tokens
        self.runner_variant = runner_variant
        self.graph_backend = GraphBackend.resolve(graph_backend, loaded.device)
        self.buckets = tuple(sorted(set(buckets)))
        self._runner: PrefillGraphRunner | None = None

    @property
    def runner(self) -> PrefillGraphRunner:
        if self._runner is None:
            adapter = self.loaded.adapter
            self._runner = PrefillGraphRunner(
                adapter.body, hidden_size=adapter.hidden_size, dtype=adapter.dtype, device=adapter.device,
                buckets=self.buckets, variant=self.runner_variant, graph_backend=self.graph_backend,
            )
        return self._runner

    def prepare(self, modes: Sequence[str]) -> None:
        pass  # the model is already loaded; the runner is captured on first use

    @contextmanager
    def session(self, mode: str) -> Iterator[TransformersSession]:
        try:
            runner = self.runner if mode == "bcg" else None
        except (RuntimeError, ValueError) as err:
            raise ArmFailure(f"graph capture failed: {err}") from err
        yield TransformersSession(LMExecutor(self.loaded.adapter, runner), self.max_new_tokens)

    def bucket_of(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def prompt_length(self, request: Request) -> int:
        return int(self.loaded.adapter.processor_inputs(request.fixture, request.prompt)["input_ids"].shape[1])

    def environment(self) -> Mapping[str, Any]:
        device = self.loaded.device
        return {
            "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "machine": platform.machine(),
        }

    def config(self) -> Mapping[str, Any]:
        return {
            "dtype": str(self.loaded.dtype).removeprefix("torch."),  # what "auto" resolved to
            "runner": self.runner_variant.value,
            "graph_backend": self.graph_backend.value,
            "buckets": list(self.buckets),
            "deepstack_slot_bytes": self._runner.deepstack_slot_bytes if self._runner else None,
        }

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
