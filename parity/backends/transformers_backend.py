"""The in-process backend: a request is its prompt served (`serving.PromptServer`: one prefill,
eager or a graph replay in bcg arms, in parts under chunking or after a prefix hit), then KV-cached
greedy decode steps that run the same way in every arm, as a server does it.

Everything but the prefill's execution is shared by the arms: input preparation (once per request
and run), the tap at the LM entry, the decode loop and the teacher-forced scoring, which reuses the
very prefill the generation used, so a forced score measures what that execution computed.
"""

from __future__ import annotations

import math
import platform
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from parity.arms import DeepStack
from parity.backends.options import BackendOptions, apply_thread_policy
from parity.backends.protocol import Answer, Generates, Generation, Probed, Request
from parity.runner.buckets import BucketPolicy
from parity.errors import ArmFailure, LocalizationError, UsageError
from parity.backends.serving import LMExecutor, Prefill, PromptServer, replay_checker
from parity.design import DEFAULT_CHUNK_TOKENS, PAGE_TOKENS, Serving
from parity.evidence import Evidence
from parity.runner.graph_runner import GraphBackend, PrefillGraphRunner, RunnerVariant
from parity.runner.lm_body import KVCache
from parity.runner.replay_check import ReplayChecker
from parity.model_identity import CONFIG_KEY
from parity.models import LoadedModel
from parity.models.qwen3_vl import PreparedPrompt

TOP_K = 5


class TransformersSession(Generates):
    """One mode's session: its prompts served by a `PromptServer` (which keeps what a server keeps
    between requests), then decoded and scored the same way in every mode."""

    def __init__(self, executor: LMExecutor, backend: "TransformersBackend") -> None:
        self._executor = executor
        self._backend = backend
        self._server = PromptServer(executor, backend.prepared, backend.chunk_size,
                                    encoder_by_grid=backend.runner_variant is not RunnerVariant.LAYOUT_KEYED)

    def answer(self, request: Request, deepstack: str) -> Answer:
        return self._failing_as_arm(self._answer, request, DeepStack(deepstack).tap_mode)

    def answer_together(self, requests: Sequence[tuple[Request, str]]) -> tuple[Answer, ...]:
        return self._failing_as_arm(self._answer_together, requests)

    def score(self, answer: Answer, force: Sequence[Sequence[int]] = ()) -> Generation:
        return self._failing_as_arm(self._score, answer, force)

    @staticmethod
    def _failing_as_arm(step, *args):
        try:
            return step(*args)
        except (RuntimeError, ValueError) as err:  # a forward, a fail-closed slot refresh, a NaN
            raise ArmFailure(f"{err.__class__.__name__}: {err}") from err

    def close(self) -> None:
        self._server.close()

    def prefill(self, request: Request, tap_mode: str, probe: bool = False):
        return self._server.prefill(request, tap_mode, probe)

    def prefill_together(self, requests: Sequence[tuple[Request, str]], probe: bool = False):
        return self._server.prefill_together(list(requests), probe)

    @torch.inference_mode()
    def _answer(self, request: Request, tap_mode: str) -> Answer:
        return self._answered(*self.prefill(request, tap_mode))

    @torch.inference_mode()
    def _answer_together(self, requests: Sequence[tuple[Request, str]]) -> tuple[Answer, ...]:
        served = self.prefill_together([(r, DeepStack(d).tap_mode) for r, d in requests])
        return tuple(self._answered(*one) for one in served)

    def _answered(self, prompt: PreparedPrompt, record, served) -> Answer:
        """A request's answer after its prefill: greedy decode steps, each eager, as in every arm."""
        adapter = self._executor.adapter
        prefill = served.prefill
        first = self._logprobs(prefill.hidden[-1])
        ids, logprobs, top, decode_steps = self._greedy(prompt, prefill, first)
        replayed = [b for b in served.buckets if b is not None]
        evidence = Evidence(
            lm_calls=served.parts + decode_steps,
            replayed_calls=len(replayed),
            prefill_replayed=len(replayed) == served.parts,
            buckets=tuple(sorted(set(replayed))),
            tap_calls=int(record is not None),
            prompt_tokens=int(prompt.input_ids.shape[0]),
            max_bucket=self._backend.max_bucket,
            serving=served.serving,
            replay_check=served.replay_check,
            freshness=served.freshness,
        )
        generation = Generation(
            token_ids=tuple(ids),
            text=adapter.tokenizer.decode(ids, skip_special_tokens=True),
            token_logprobs=tuple(logprobs),
            top_logprobs=tuple(top),
            deepstack_record=None if record is None else replace(record, replay=evidence.prefill_replayed),
            evidence=evidence,
        )
        # Scoring reuses this very prefill, so a forced score measures what this execution computed.
        return Answer(generation, (prompt, prefill, first))

    @torch.inference_mode()
    def _score(self, answer: Answer, force: Sequence[Sequence[int]]) -> Generation:
        prompt, prefill, first = answer.state
        generation = answer.generation
        start = time.perf_counter()
        forced = tuple(self._forced(prompt, prefill, first, tuple(tokens)) for tokens in force)
        # Its own answer scored the same way: a teacher-forced delta then compares like with like.
        self_forced = self._forced(prompt, prefill, first, generation.token_ids)
        scoring_calls = sum(len(t) > 1 for t in (*force, generation.token_ids))
        evidence = replace(generation.evidence, lm_calls=generation.evidence.lm_calls + scoring_calls)
        return replace(generation, evidence=evidence, forced=forced, self_forced=self_forced,
                       forced_seconds=time.perf_counter() - start)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self._executor.adapter.lm_head(hidden).float(), dim=-1)

    def _after(self, prompt: PreparedPrompt, cache: KVCache, step: int, tokens: Sequence[int]) -> torch.Tensor:
        """Logprobs `[n, vocab]` after feeding `tokens` as generated tokens number `step`, `step + 1`, ..."""
        adapter = self._executor.adapter
        embeds = adapter.embed_tokens(torch.tensor(tokens, device=adapter.device))
        # Text after the prompt: t = h = w, one position per token.
        positions = prompt.positions[:, -1:] + 1 + step + torch.arange(len(tokens), device=adapter.device)
        return self._logprobs(adapter.body.forward_cached(embeds, positions, cache))

    def _greedy(self, prompt: PreparedPrompt, prefill: Prefill, logprobs: torch.Tensor):
        adapter = self._executor.adapter
        cache = KVCache.from_prefill(prefill.keys, prefill.values)
        ids: list[int] = []
        chosen: list[float] = []
        top: list[tuple[tuple[int, float], ...]] = []
        steps = 0
        for step in range(self._backend.max_new_tokens):
            token = int(logprobs.argmax())
            ids.append(token)
            chosen.append(_finite(float(logprobs[token]), step))
            values, indices = logprobs.topk(TOP_K)
            top.append(tuple((int(i), float(v)) for i, v in zip(indices, values)))
            if token in adapter.eos_token_ids or step == self._backend.max_new_tokens - 1:
                break
            logprobs = self._after(prompt, cache, step, [token])[-1]
            steps += 1
        return ids, chosen, top, steps

    def _forced(self, prompt: PreparedPrompt, prefill: Prefill, first: torch.Tensor, tokens: tuple[int, ...]):
        """This execution's logprob of each reference token, fed the reference's own prefix: the
        first from the prefill, the others from one cached pass over the reference's tokens."""
        if not tokens:
            return ()
        scores = [first[tokens[0]]]
        if len(tokens) > 1:
            cache = KVCache.from_prefill(prefill.keys, prefill.values)
            after = self._after(prompt, cache, 0, tokens[:-1])  # [n - 1, vocab]
            rows = torch.arange(len(tokens) - 1, device=after.device)
            scores += list(after[rows, torch.tensor(tokens[1:], device=after.device)])
        return tuple(_finite(float(score), step) for step, score in enumerate(scores))


def _request_key(request: Request) -> tuple:
    """A request by content: its image's pixels (not the PIL object) and its prompt."""
    fixture = request.fixture
    return (None if fixture is None else (fixture.name, fixture.sha256), request.prompt)


def _finite(value: float, step: int) -> float:
    if not math.isfinite(value):
        raise ValueError(f"non-finite logprob {value} at step {step}")
    return value


class TransformersBackend:
    """One loaded model for every mode; the graph runner captures the needed buckets once per run."""

    name = "transformers"

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_new_tokens: int,
        runner_variant: RunnerVariant = RunnerVariant.FIXED,
        graph_backend: str = "auto",
        buckets: BucketPolicy | None = None,
        runner_class: type[PrefillGraphRunner] = PrefillGraphRunner,
        chunk_size: int = DEFAULT_CHUNK_TOKENS,
        poison: bool = False,
    ) -> None:
        self.loaded = loaded
        self.poison = poison  # --poison: the runner's slots get a sentinel before every refresh (design §6)
        self.max_new_tokens = max_new_tokens
        self.chunk_size = chunk_size  # a chunked request's prefill, in chunks of at most this many tokens
        self._context_rows = 0  # the most rows a chunk or a prefix hit may follow (0: none planned)
        self.runner_variant = runner_variant
        self.graph_backend = GraphBackend.resolve(graph_backend, loaded.device)
        self.buckets = buckets or BucketPolicy(None, loaded.adapter.max_positions)
        self.runner_class = runner_class  # tests substitute runners with bugs parity must catch
        self._capture: tuple[int, ...] = ()
        self._runner: PrefillGraphRunner | None = None
        self._checker: ReplayChecker | None = None  # the run's: one bound per graph (design §6)
        self._prepared: dict[tuple, PreparedPrompt] = {}
        self._lengths: dict[tuple, int] = {}

    @property
    def max_positions(self) -> int:
        return self.loaded.adapter.max_positions

    @property
    def max_bucket(self) -> int | None:
        """The largest captured bucket: what a prompt can replay in at most."""
        return max(self._capture, default=None)

    def prepared(self, request: Request) -> PreparedPrompt:
        """The request's LM inputs, prepared once per run: every arm and repeat gets the same tensors
        (the tap copies before zeroing), and the vision tower runs once per image."""
        key = _request_key(request)
        if key not in self._prepared:
            self._prepared[key] = self.loaded.adapter.prepare(request.fixture, request.prompt)
        return self._prepared[key]

    @property
    def runner(self) -> PrefillGraphRunner:
        if self._runner is None:
            self._runner = self._new_runner()
        return self._runner

    def _new_runner(self) -> PrefillGraphRunner:
        adapter = self.loaded.adapter
        return self.runner_class(
            adapter.body, hidden_size=adapter.hidden_size, dtype=adapter.dtype, device=adapter.device,
            buckets=self._capture, variant=self.runner_variant, graph_backend=self.graph_backend,
            context_rows=self._context_rows, poison=self.poison,
        )

    def prepare(self, modes: Sequence[str], prompt_lengths: Sequence[int], serving: Sequence[Serving] = ()) -> None:
        self._capture = self.buckets.captured(prompt_lengths)
        # Chunks, prefix hits and shared forwards replay in context graphs (their masks), captured with the
        # others before any request.
        parts = any(s.chunked or s.prefix_cache or s.batched for s in serving)
        self._context_rows = max(prompt_lengths, default=0) if parts else 0

    @contextmanager
    def session(self, mode: str) -> Iterator[TransformersSession]:
        try:
            runner = self.runner if mode == "bcg" else None
        except (RuntimeError, ValueError) as err:
            raise ArmFailure(f"graph capture failed: {err}") from err
        if runner is not None and self._checker is None:
            self._checker = replay_checker(self.loaded.adapter)
        session = TransformersSession(LMExecutor(self.loaded.adapter, runner, self._checker), self)
        try:
            yield session
        finally:
            session.close()

    def bucket_of(self, num_tokens: int) -> int | None:
        # Planning asks before capture: the policy's ladder, which the capture then covers.
        return self.buckets.bucket_of(num_tokens)

    @torch.inference_mode()
    def probe(self, mode: str, target: Request, deepstack: str,
              prefix: Sequence[tuple[Request, str]] = (), together: Sequence[tuple[Request, str]] = ()) -> Probed:
        """`target`'s prefill with the hidden state at every probe point (design §7), DeepStack
        `deepstack` at the LM entry, served as in the run (its chunks, its prefix-cache hit: the
        points are then of the rows it computed). In a fresh session of `mode` whose runner is built
        like the run's (class, variant, graph backend, captured buckets), after serving `prefix`: it
        holds only the state this case leaves, so `parity localize` reproduces it exactly. `together`:
        the requests submitted with it, itself among them (a batch: in graph mode one forward)."""
        adapter = self.loaded.adapter
        runner = self._new_runner() if mode == "bcg" else None
        session = TransformersSession(LMExecutor(adapter, runner), self)
        try:
            for request, action in prefix:
                session.prefill(request, DeepStack(action).tap_mode)
            if together:
                batch = [(r, DeepStack(a).tap_mode) for r, a in together]
                served = next(s for (r, a), (_, _, s) in zip(together, session.prefill_together(batch, probe=True))
                              if r == target and a == deepstack)
            else:
                _, _, served = session.prefill(target, DeepStack(deepstack).tap_mode, probe=True)
        finally:
            session.close()
            if runner is not None:
                runner.close()
        if mode == "bcg" and None in served.buckets:
            raise LocalizationError(f"the {served.points.shape[0]}-token prefill did not replay in any captured "
                                    f"bucket {self._capture}")
        return Probed(adapter.body.probe_points(), served.points)

    def prompt_length(self, request: Request) -> int:
        # Planning asks for the same image request's length several times (each scenario, each check).
        key = _request_key(request)
        if key not in self._lengths:
            inputs = self.loaded.adapter.processor_inputs(request.fixture, request.prompt)
            self._lengths[key] = int(inputs["input_ids"].shape[1])
        return self._lengths[key]

    def environment(self) -> Mapping[str, Any]:
        device = self.loaded.device
        return {
            "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            # Read as the arms end: the most the run's tensors held on the GPU at once (None on a CPU).
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        }

    def config(self) -> Mapping[str, Any]:
        return {
            "dtype": str(self.loaded.dtype).removeprefix("torch."),  # what "auto" resolved to
            "deepstack_layers": self.loaded.adapter.deepstack_count,
            "runner": self.runner_variant.value,
            "poison": self.poison,
            "graph_backend": self.graph_backend.value,
            "buckets": self.buckets.describe(),
            "captured_buckets": list(self._capture),
            "deepstack_slot_bytes": self._runner.deepstack_slot_bytes if self._runner else None,
            "preset_seed": self.loaded.seed,
            CONFIG_KEY: self.loaded.identity.to_json(),
            "chunk_size": self.chunk_size,  # what the family scenarios' serving used (design §10)
            "prefix_cache_page": PAGE_TOKENS,
        }

    def timings(self) -> Mapping[str, float | None]:
        return {"capture_s": None if self._runner is None else self._runner.capture_seconds}

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


def from_options(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> TransformersBackend:
    """The backend the command line builds: the model loaded in parity's own process."""
    from parity.models import load_model
    from parity.presets import PRESETS

    apply_thread_policy(options.threads, options.model in PRESETS)
    loaded = load_model(options.model, device=options.device, dtype=options.dtype, seed=options.seed)
    buckets = BucketPolicy.parse(options.buckets, loaded.adapter.max_positions)
    try:
        return TransformersBackend(loaded, max_new_tokens=max_new_tokens, runner_variant=RunnerVariant(options.runner),
                                   graph_backend=options.graph_backend, buckets=buckets,
                                   chunk_size=options.chunk_size or DEFAULT_CHUNK_TOKENS, poison=options.poison)
    except ValueError as err:  # e.g. --graph-backend cuda with the model on the CPU
        raise UsageError(str(err)) from None
