"""The `config` (and the parts of `environment`) a results file is judged and rebuilt from.

`parity verdict` reads the tolerances; `parity localize` rebuilds the model and its graphs from the
model, seed, dtype, runner, buckets, token budget and thread count. Every such field is checked
here, so an edited value is a usage error naming it, never a traceback or a hang later.
"""

from __future__ import annotations

from parity.design import RUNNER_VARIANTS
from parity.runner.buckets import AUTO
from parity.registry import BACKENDS
from parity.judge.identity import SOURCE_KEY
from parity.judge.metrics import NOISE_FLOOR
from parity.model_identity import CONFIG_KEY as IDENTITY_KEY
from parity.model_identity import KNOWN_BUILDS, PRESET, read_identity
from parity.presets import PRESETS
from parity.trust.fields import Invalid, get, integer, ints, non_negative_int, number, positive

# The smallest --logprob-tol a run may ask for: a smaller one cannot be met by a correct run on every
# CPU. Files written before v3 may hold tolerances down to 1e-6 and are read as written.
MIN_LOGPROB_TOL = NOISE_FLOOR
V2_MIN_LOGPROB_TOL = 1e-6
# torch.manual_seed takes any signed or unsigned 64-bit integer; a preset seed beyond is no seed.
SEED_RANGE = (-(2**63), 2**64 - 1)
# Linux's largest configurable CPU count (NR_CPUS): no machine reports more threads.
MAX_THREADS = 8192
# What `--dtype` resolves to; the tolerances, records and rebuilds of a run all read it.
DTYPES = ("float32", "bfloat16", "float16")
# What `--graph-backend` and `--device` resolve to on the in-process backend.
GRAPH_BACKENDS = ("cuda", "emulated")
DEVICES = ("cpu", "cuda")


def config_from_json(raw: dict, environment: dict, v2: bool) -> dict:
    config = dict(raw)
    tol = number(get(config, "logprob_tol", (int, float), "config"), "config.logprob_tol")
    floor = V2_MIN_LOGPROB_TOL if v2 else 0.0
    if tol < floor:
        raise Invalid(f"config.logprob_tol must be >= {floor:g}, got {tol}")
    mean = get(config, "logprob_mean_tol", (int, float), "config", optional=True)
    if mean is not None and number(mean, "config.logprob_mean_tol") < floor:
        raise Invalid(f"config.logprob_mean_tol must be >= {floor:g}, got {mean}")
    if v2:
        margin = number(get(config, "tie_margin", (int, float), "config"), "config.tie_margin")
        if margin < 0:
            raise Invalid(f"config.tie_margin must be >= 0, got {margin}")
        non_negative_int(get(config, "deepstack_layers", int, "config"), "config.deepstack_layers")
        if config.get("localize_threshold") is not None:
            positive(config["localize_threshold"], "config.localize_threshold")
    else:  # the v1 rules: no ties, DeepStack use inferred from the records
        config.pop("tie_margin", None)
        config.pop("deepstack_layers", None)
    _check_rebuild_fields(config, v2)
    _check_vocabulary(config, v2)
    if v2:
        _check_backend_fields(config)
        _check_backend_values(config, environment)
        _check_identity(config, environment)
    _check_environment(environment, v2)
    return config


def _check_vocabulary(config: dict, v2: bool) -> None:
    """A backend or dtype parity does not know would be read under another's rules."""
    backend = get(config, "backend", str, "config", optional=not v2)
    if backend is not None and backend not in BACKENDS:
        raise Invalid(f"config.backend {backend!r} is not a backend parity has ({', '.join(BACKENDS)})")
    dtype = get(config, "dtype", str, "config", optional=not v2)
    if dtype is not None and dtype not in DTYPES:
        raise Invalid(f"config.dtype {dtype!r} is not one parity runs ({', '.join(DTYPES)})")
    for key, known in (("runner", RUNNER_VARIANTS), ("graph_backend", GRAPH_BACKENDS)):
        value = config.get(key)
        if value is not None and value not in known:
            raise Invalid(f"config.{key} {value!r} is not one parity has ({', '.join(known)})")


def _check_backend_fields(config: dict) -> None:
    """Each backend writes its own fields, and no other's (v6): the backend a file names selects the
    rules it is judged by, strict in-process ones or lenient server ones, so it must be the backend
    that wrote the file, not one label away."""
    backend = BACKENDS[config["backend"]]
    missing = sorted(backend.config_fields - set(config))
    if missing:
        raise Invalid(f"config.{missing[0]} is missing: every {backend.name} run writes it")
    for other in BACKENDS.values():
        foreign = sorted((other.config_fields - backend.config_fields) & set(config))
        if foreign and other is not backend:
            raise Invalid(f"config.{foreign[0]} is a {other.name} run's field, but config.backend is {backend.name!r}: "
                          "a file relabelled from another backend")
    if backend.fix_records_key is not None:
        _check_fix_records(config.get(backend.fix_records_key), f"config.{backend.fix_records_key}")


# What a server backend's fields hold (trust v7), by field without its `<engine>_` prefix: a file
# relabelled to a server backend with its fields present but null, `{}` or of another type would
# otherwise buy that backend's lenient rules. None in a tuple: the field may be null (a run without a
# fix, servers started one after the other).
SERVER_VALUES: dict[str, tuple] = {
    "servers": (dict,), "concurrent": (bool,), "launches": (int,), "args": (list,), "device": (str,),
    "start_order": (list, None), "gpus": (dict, None), "tap_processes": (dict, None), "graph_backend": (str, None),
    "fix": (str, None), "fix_records": (dict, None), "fix_slots": (dict, None), "capture_sizes": (dict, None),
    "prefill_buckets": (dict, None), "server_dtype": (dict, None), "server_env": (dict, None),
    "compile_mode": (str, None),
}
# Null where a run ended before the server said (its version, its graph modes): an ERROR run's file.
SHARED_VALUES: dict[str, tuple] = {"chunk_size": (int,), "top_logprobs_num": (int,), "engine": (str,),
                                   "graph_mode": (str,), "tp_size": (int, None), "engine_version": (str, None),
                                   "graph_cudagraph_modes": (dict, None), "graph_breakable": (bool, None)}


def _check_backend_values(config: dict, environment: dict) -> None:
    """A server backend's fields hold values of their type, never null where a run always writes one;
    its servers name each server's command; its engine version is the environment's, where that has one."""
    name, info = config["backend"], BACKENDS[config["backend"]]
    if info.servers_key is None or info.package is None:
        return
    for key in sorted(info.config_fields):
        kinds = SHARED_VALUES.get(key) or SERVER_VALUES.get(key.removeprefix(f"{name}_"))
        if kinds is None:
            continue
        value = config[key]
        if value is None and None in kinds:
            continue
        types = tuple(k for k in kinds if k is not None)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join("null" if k is None else k.__name__ for k in kinds)
            raise Invalid(f"config.{key} is {value!r:.40}, but every {name} run writes {wanted} there")
    servers = config[info.servers_key]
    if not servers or not all(isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)
                              for cmd in servers.values()):
        raise Invalid(f"config.{info.servers_key} must name each server's command (mode -> its arguments), "
                      f"got {servers!r:.60}")
    # parity's own environment may lack the engine (its servers run from another): then there is
    # nothing to match, and the server's own answer stands.
    version = environment.get(info.package)
    if isinstance(version, str) and "engine_version" in config and config["engine_version"] != version:
        raise Invalid(f"config.engine_version is {config['engine_version']!r}, but environment.{info.package} is "
                      f"{version!r}")


def _check_fix_records(raw: object, where: str) -> None:
    """Each server's records of parity's fix, of the types a run writes them (`fix_records.FixRecord`),
    so a report never meets a record that is not one (an edited `"captures": "many"`)."""
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise Invalid(f"{where} must be an object of mode -> records")
    for mode, records in raw.items():
        if not isinstance(records, list):
            raise Invalid(f"{where}.{mode} must be a list of fix records")
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise Invalid(f"{where}.{mode}[{i}] must be an object")
            for key, kinds in (("pid", int), ("variant", str), ("captures", int), ("reads", int), ("note", str),
                               ("refused", bool), ("stood_aside", bool), ("dtype", str)):
                get(record, key, kinds, f"{where}.{mode}[{i}]", optional=key not in ("pid", "variant"))
            slot = get(record, "slot", list, f"{where}.{mode}[{i}]", optional=True)
            if slot is not None and len(ints(slot, f"{where}.{mode}[{i}].slot")) != 2:
                raise Invalid(f"{where}.{mode}[{i}].slot must be [max tokens, width]")


def _check_identity(config: dict, environment: dict) -> None:
    """The model's identity (design §4b, v5) agrees with the fields that name the model, and a preset
    build parity knows (v6) with its weights."""
    try:
        identity = read_identity(config.get(IDENTITY_KEY))
    except ValueError as err:
        raise Invalid(f"config.{IDENTITY_KEY} {err}") from None
    where = f"config.{IDENTITY_KEY}"
    if identity.name != config["model"]:
        raise Invalid(f"{where}.name is {identity.name!r}, but config.model is {config['model']!r}")
    if (identity.kind == PRESET) != (config["model"] in PRESETS):
        raise Invalid(f"{where}.kind is {identity.kind!r}, but {config['model']!r} is "
                      f"{'an embedded preset' if config['model'] in PRESETS else 'not an embedded preset'}")
    seed = config.get("preset_seed")
    if identity.kind == PRESET and "preset_seed" in config and seed != identity.seed:
        raise Invalid(f"{where}.seed is {identity.seed}, but config.preset_seed is {seed!r}: the weights judged were "
                      "built from another seed than the file says")
    known = KNOWN_BUILDS.get((identity.name, identity.seed, environment.get("machine")))
    if identity.kind == PRESET and known is not None and identity.sha256 != known:
        raise Invalid(f"{where}.sha256 is {identity.sha256[:12]}…, but {identity.name} seed {identity.seed} builds "
                      f"weights {known[:12]}… on {environment.get('machine')}: not the weights the file names")


def _check_rebuild_fields(config: dict, v2: bool) -> None:
    """What `parity localize` rebuilds the run from; parity writes all of them in /2."""
    model = get(config, "model", str, "config", optional=not v2)
    if model is not None and not model.strip():
        raise Invalid("config.model is empty")
    for key in ("backend", "dtype", "runner", "graph_backend"):
        get(config, key, str, "config", optional=True)
    tokens = get(config, "max_new_tokens", int, "config", optional=not v2)
    if tokens is not None:
        non_negative_int(tokens, "config.max_new_tokens", 1)
    repeat = get(config, "repeat", int, "config", optional=True)
    if repeat is not None:
        non_negative_int(repeat, "config.repeat", 1)
    seed = get(config, "preset_seed", int, "config", optional=True)
    if seed is not None:
        integer(seed, "config.preset_seed", *SEED_RANGE)
    for key in ("chunk_size", "prefix_cache_page"):
        value = get(config, key, int, "config", optional=True)
        if value is not None:
            non_negative_int(value, f"config.{key}", 1)
    buckets = config.get("buckets")
    if buckets is not None and buckets != AUTO:
        if not isinstance(buckets, list) or not buckets:
            raise Invalid(f"config.buckets must be {AUTO!r} or a non-empty list of bucket sizes")
        ints(buckets, "config.buckets", minimum=1)
    captured = get(config, "captured_buckets", list, "config", optional=True)
    if captured is not None:
        sizes = ints(captured, "config.captured_buckets", minimum=1)
        if len(set(sizes)) != len(sizes):
            raise Invalid("config.captured_buckets lists a bucket twice")
        _check_context(config, sizes, tokens)


def _check_context(config: dict, captured: tuple[int, ...], tokens: int | None) -> None:
    """An embedded preset's context is known without building it: no bucket may pass it."""
    preset = PRESETS.get(config.get("model"))
    if preset is None:
        return  # a checkpoint's context is its own config's; `parity localize` checks it after loading
    too_big = [b for b in captured if b > preset.max_positions]
    if too_big:
        raise Invalid(f"config.captured_buckets has {too_big[0]}, beyond the {preset.max_positions}-token context "
                      f"of {preset.name}")
    if tokens is not None and tokens >= preset.max_positions:
        raise Invalid(f"config.max_new_tokens is {tokens}, beyond the {preset.max_positions}-token context of "
                      f"{preset.name}")


def _check_environment(environment: dict, v2: bool) -> None:
    threads = get(environment, "threads", int, "environment", optional=True)
    if threads is not None:
        integer(threads, "environment.threads", 1, MAX_THREADS)
    device = get(environment, "device", str, "environment", optional=True)
    if device is not None and device not in DEVICES:
        raise Invalid(f"environment.device {device!r} is not one parity runs on ({', '.join(DEVICES)})")
    # The code that wrote the file (design §4b): a merge of shards of different code is refused unless
    # asked for, so a file may not drop the field to slip past that check.
    # A merge made with --allow-mixed-code lists every source it merged.
    source = get(environment, SOURCE_KEY, (str, list), "environment", optional=not v2)
    sources = [source] if isinstance(source, str) else source or []
    if (source is not None and not sources) or any(not isinstance(s, str) or not s.strip() for s in sources):
        raise Invalid(f"environment.{SOURCE_KEY} must name the parity source that wrote the file")

