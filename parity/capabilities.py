"""What a backend declares about itself (design §6): how to build it, the `parity run` options it
uses, and its capabilities. Each engine's `entry` module fills one in; `registry` holds them all.
Stdlib and parity's light modules only: verdicts and reports read these.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from parity.evidence import Evidence

if TYPE_CHECKING:
    from parity.backends.options import BackendOptions
    from parity.backends.protocol import Backend

# Options every engine server backend uses (launch and placement of servers).
SERVER_OPTIONS = frozenset({"concurrent", "gpus", "ready_timeout", "mem_fraction"})


def server_config_fields(name: str) -> frozenset[str]:
    """The config keys every engine server backend writes (`engines.engine.EngineBackend.config`)."""
    return frozenset({f"{name}_{key}" for key in ("servers", "concurrent", "start_order", "gpus", "launches",
                                                  "tap_processes")} | {"chunk_size", "top_logprobs_num"})


def _tokens(evidence: Evidence | None) -> str:
    return "?" if evidence is None or evidence.prompt_tokens is None else str(evidence.prompt_tokens)


def _buckets_hint(evidence: Evidence | None) -> str:
    return f"use --buckets auto, or give --buckets a bucket of at least {_tokens(evidence)} tokens"


@dataclass(frozen=True)
class EngineOption:
    """A `parity run` option only one backend has: its click name (the key in
    `BackendOptions.engine`), its flag, and click's keyword arguments for it."""

    name: str
    flag: str
    settings: Mapping[str, Any]

    def decorator(self) -> Callable:
        import click

        return click.option(self.flag, self.name, **self.settings)


@dataclass(frozen=True)
class BackendInfo:
    """One backend: how to build it, which options it uses, and its capabilities."""

    name: str
    factory: str  # "module:function"(options, max_new_tokens, run_dir) -> Backend, imported when used
    options: frozenset[str]  # the shared `parity run` options (click names) it uses beyond the common ones
    localizes: bool = False  # parity captures its graph itself, so a failing case's layers can be probed
    # parity runs the model in its own process: it counts every LM entry itself, every replay it
    # counts is one of the generation's prefills (scoring reuses them, decode steps run eagerly), and
    # it cuts a prompt's chunks itself. A server's tap also counts its scoring requests' prefills,
    # sees only the decode steps its engine runs eagerly, and the engine's scheduler cuts the chunks.
    in_process: bool = False
    # Its servers' graph replays are watched by the freshness witness (design §6): its arms may carry
    # the witness's records (an in-process run always does).
    witnesses_inputs: bool = False
    runbook: str | None = None  # what to read when its servers misbehave
    servers_key: str | None = None  # config key: each mode's server flags
    fix_records_key: str | None = None  # config key: each server's records of parity's fix (fix_records.py)
    volatile_keys: tuple[str, ...] = ()  # config keys that differ between machines of one experiment
    records_ranks: bool = False  # records config.tp_size and one evidence record per rank
    version_in_every_run: bool = False  # its package version goes in every run's environment
    package: str | None = None  # the Python package it drives
    # (option, value) it cannot honour: exit 2 naming the option instead of a run that misleads
    refused: Mapping[tuple[str, Any], str] = field(default_factory=dict)
    own_options: tuple[EngineOption, ...] = ()  # options only it has (the command line adds them)
    not_replayed_hint: Callable[[Evidence | None], str] = _buckets_hint
    graph_label: Callable[[Mapping[str, Any]], str | None] = lambda config: None  # the graph path, from config
    # A family scenario's path (design.PROVES_*) the engine has no way to reach, and why: the verdict
    # adds it to the INCONCLUSIVE reason of a request that did not reach the path.
    unreachable: Mapping[str, str] = field(default_factory=dict)
    # The config keys every run of it writes (trust v6): a file that lacks one, or carries another
    # backend's, was relabelled, which would select another backend's (more lenient) rules.
    config_fields: frozenset[str] = frozenset()
    # Its runs record the engine's version as environment[package] (its servers', or the installed
    # one's): a server run whose servers answered names the release it judged.
    names_its_version: bool = False

    @property
    def uses(self) -> frozenset[str]:
        return self.options | {o.name for o in self.own_options}

    def create(self, options: "BackendOptions", max_new_tokens: int, run_dir: Path) -> "Backend":
        module, function = self.factory.split(":")
        return getattr(importlib.import_module(module), function)(options, max_new_tokens, run_dir)
