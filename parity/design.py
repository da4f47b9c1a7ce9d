"""The experiment's design in one place (design §1, §3, §6): its arms and the order they run in, the
comparisons it judges, its scenarios and the requests of each sequence. Everything else reads
these; nothing here imports the rest of parity.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

# The canonical order of the experiment (design §1); reports and verdicts rely on these names.
EAGER_NORMAL = "eager_normal"
EAGER_ZERO = "eager_zero_deepstack"
BCG_NORMAL = "bcg_normal"
BCG_ZERO = "bcg_zero_deepstack"
ARM_ORDER = (EAGER_NORMAL, EAGER_ZERO, BCG_NORMAL, BCG_ZERO)
# The order arms run in within a case: each comparison's reference runs before the arm compared with it.
RUN_ORDER = (EAGER_NORMAL, EAGER_ZERO, BCG_ZERO, BCG_NORMAL)


# --- scenarios ---------------------------------------------------------------------------------------------

FOUR_ARM = "four-arm"
REUSE = "reuse"
STREAM = "stream"
SHRINK = "shrink"
# The DeepStack bug family (design §10, docs/scenarios.md): each a request-specific side input the
# engine must carry through one more serving feature.
CHUNKED = "chunked"
PREFIX = "prefix"
GROWTH = "growth"
WARMUP = "warmup"
LAYOUT = "layout"
BATCH = "batch"
FAMILY_SCENARIOS = (CHUNKED, PREFIX, GROWTH, WARMUP, LAYOUT, BATCH)
CORE_SCENARIOS = (FOUR_ARM, REUSE, STREAM, SHRINK)  # the slot itself (design §5)
SCENARIOS = (*CORE_SCENARIOS, *FAMILY_SCENARIOS)
SEQUENCE_SCENARIOS = (REUSE, STREAM, SHRINK, *FAMILY_SCENARIOS)
# One line each, for `--help` and the reports.
SCENARIO_SUMMARIES: Mapping[str, str] = MappingProxyType({
    FOUR_ARM: "eager vs graph, each with DeepStack as computed and zeroed (the original bug)",
    REUSE: "an image request, then a text request in its bucket (a slot never cleared)",
    STREAM: "five requests back to back in one bucket (a slot refreshed only on a new shape)",
    SHRINK: "a large image, a smaller one, then text as long as the first (a clear of only the rows just written)",
    CHUNKED: "the image prompt prefilled in chunks (each chunk must get its own DeepStack rows)",
    PREFIX: "prefix-cache hits on the image prompt (DeepStack rows offset by the cached tokens)",
    GROWTH: "a request past the DeepStack buffer's size, then short ones (graphs must follow a regrown buffer)",
    WARMUP: "text requests before the first image (graphs must not specialise to no DeepStack)",
    LAYOUT: "two images of equal tokens and other grids (encoder graphs keyed by more than token count)",
    BATCH: "requests sharing one prefill forward: image and text, two image sizes, an image and a chunked one's rest",
})

# The chunked scenario's chunk, in tokens, on every backend (--chunk-size): it splits every built-in
# fixture's image rows over two chunks or more.
DEFAULT_CHUNK_TOKENS = 8

# The prefix cache matches whole pages of this many tokens, on every backend (a server's page or block
# size): small enough that, on every built-in fixture, a hit on the whole first prompt ends past the
# image and one up to the image ends inside it.
PAGE_TOKENS = 8

# What a request sends besides the DeepStack action.
CASE_IMAGE = "case"  # a request with the case's own image
TWIN_IMAGE = "twin"  # a request with the twin of the case's image: same size and tokens, other pixels
WIDE_IMAGE = "wide"  # the case's image resized to a 2:1 grid
TALL_IMAGE = "tall"  # the same, 1:2: as many visual tokens as the wide one, the grid transposed
LARGE_IMAGE = "large"  # the case's image resized to the most visual tokens a preset takes
SMALL_IMAGE = "small"  # the same, to the fewest
SAME_TEXT = "same"  # the case's prompt (a text-only request: lengthened into the image's bucket)
EXTENDED_TEXT = "extended"  # the case's prompt with a sentence added: a prefix-cache hit on all of it
OTHER_TEXT = "other"  # another question about the same image: a hit on what precedes the question
LONG_TEXT = "long"  # the case's prompt lengthened past the largest captured bucket

# The serving path a request must be shown to have reached (design §10), checked on its graph arm.
PROVES_CHUNKS = "chunks"  # its prefill ran in replayed chunks, DeepStack rows in at least two
PROVES_CACHE_HIT = "cache hit"  # part of its prompt came from the prefix cache
PROVES_GROWTH = "buffer growth"  # the DeepStack buffer grew past its size for it
PROVES_WARM_GRAPH = "graph captured before"  # its bucket's graph existed before it arrived
PROVES_ENCODER_GRAPH = "encoder graph"  # its image went through a captured vision-encoder graph
PROVES_SHARED_FORWARD = "shared forward"  # its prefill's last part replayed in one forward with other requests


@dataclass(frozen=True)
class Serving:
    """The serving features a request goes through, in both modes (the embedded engine's settings
    for it; a server has them on for the whole run)."""

    chunked: bool = False  # prefill in chunks of --chunk-size tokens
    prefix_cache: bool = False  # reuse, and fill, the prefix cache
    # Start on an emptied prefix cache (the sequence's first request: what it caches is then all the
    # sequence reuses, and its DeepStack covers its whole prompt in every arm).
    empty_cache: bool = False
    encoder_graph: bool = False  # the vision encoder by captured graphs (graph mode only)
    # Submitted together with the sequence's neighbouring requests of the same `RequestSpec.forward`
    # (graph mode; the eager reference serves each alone): they must share one prefill forward.
    batched: bool = False
    recorded: bool = False  # record the serving path's evidence (every family scenario's request)

    @property
    def server_profile(self) -> str | None:
        """What a server engine must be started with for it, its flags holding for the server's life
        (design §10): "chunked" (a small prefill chunk), "prefix" (the prefix cache on), or None
        (the run's default servers: whole prefills, no prefix cache). A batch is served whole by the
        chunked servers: one of its pairs needs chunked prefill, and a sequence's requests are scored
        after it on the servers that answered them, so its case cannot switch servers midway."""
        return CHUNKED if self.chunked or self.batched else PREFIX if self.prefix_cache else None


SERVER_PROFILES = (None, CHUNKED, PREFIX)  # every `Serving.server_profile`, in the order sessions serve them


@dataclass(frozen=True)
class RequestSpec:
    """One request of a sequence scenario: what the experiment sends and what a complete file holds."""

    label: str
    image: str | None  # CASE_IMAGE, TWIN_IMAGE, WIDE_IMAGE, TALL_IMAGE, or None for a text-only request
    deepstack: str  # the DeepStack action at the LM entry, the same in both modes
    # Also answered eagerly with DeepStack zeroed (the `eager_zero_deepstack` power arm, in the eager
    # session only): the sequence's power (design §3 v3). The first image request of every sequence.
    power: bool = False
    text: str = SAME_TEXT
    serving: Serving = Serving()
    replays: bool = True  # False: its prefill is past every captured bucket and runs eager in both modes
    proves: str | None = None  # the serving path its graph arm must show it reached
    # A text-only request is lengthened into the bucket of this image request of the sequence (the
    # case's image, or its large form), as long as it where the tokenizer allows (shorter in reuse).
    length_of: str = CASE_IMAGE
    # batch: the requests of a sequence with the same number are submitted at once, to share a forward.
    forward: int | None = None


_CHUNKS = Serving(chunked=True, recorded=True)
_CACHE = Serving(prefix_cache=True, recorded=True)
_CACHE_FIRST = Serving(prefix_cache=True, empty_cache=True, recorded=True)
_ENCODER = Serving(encoder_graph=True, recorded=True)
_RECORDED = Serving(recorded=True)
_BATCHED = Serving(batched=True, recorded=True)
_BATCHED_CHUNKS = Serving(chunked=True, batched=True, recorded=True)

# The requests of each sequence scenario, in the order a session serves them (design §6).
SEQUENCE_REQUESTS: Mapping[str, tuple[RequestSpec, ...]] = MappingProxyType({
    REUSE: (RequestSpec("primer (image)", CASE_IMAGE, "normal", power=True),
            RequestSpec("follow-up (text only)", None, "normal")),
    STREAM: (RequestSpec("image", CASE_IMAGE, "normal", power=True),
             RequestSpec("image, DeepStack zeroed", CASE_IMAGE, "zero"),
             RequestSpec("twin image (same size, other pixels)", TWIN_IMAGE, "normal"),
             RequestSpec("text only", None, "normal"),
             RequestSpec("image again", CASE_IMAGE, "normal")),
    # Each request shorter than the one before it but the last: a clear that covers only the rows the
    # request in hand wrote leaves the large image's tail past the small one's rows, and the text
    # request, as long as the first, reads it (docs/scenarios.md).
    SHRINK: (RequestSpec("large image (many visual rows)", LARGE_IMAGE, "normal", power=True),
             RequestSpec("small image (fewer rows, a shorter prompt)", SMALL_IMAGE, "normal"),
             RequestSpec("text only (as long as the large image's prompt)", None, "normal", length_of=LARGE_IMAGE)),
    CHUNKED: (RequestSpec("image, in chunks", CASE_IMAGE, "normal", power=True, serving=_CHUNKS,
                          proves=PROVES_CHUNKS),
              RequestSpec("twin image, in chunks", TWIN_IMAGE, "normal", serving=_CHUNKS, proves=PROVES_CHUNKS),
              RequestSpec("text only, in chunks", None, "normal", serving=_CHUNKS)),
    PREFIX: (RequestSpec("image (fills the prefix cache)", CASE_IMAGE, "normal", power=True, serving=_CACHE_FIRST),
             RequestSpec("image, question extended (prefix-cache hit)", CASE_IMAGE, "normal",
                         text=EXTENDED_TEXT, serving=_CACHE, proves=PROVES_CACHE_HIT),
             RequestSpec("image, other question (a shorter hit, up to the image)", CASE_IMAGE, "normal",
                         text=OTHER_TEXT, serving=_CACHE, proves=PROVES_CACHE_HIT)),
    GROWTH: (RequestSpec("image", CASE_IMAGE, "normal", power=True, serving=_RECORDED),
             RequestSpec("image, long question (past every bucket: the buffer grows)", CASE_IMAGE, "normal",
                         text=LONG_TEXT, serving=_RECORDED, replays=False, proves=PROVES_GROWTH),
             RequestSpec("twin image", TWIN_IMAGE, "normal", serving=_RECORDED),
             RequestSpec("text only", None, "normal", serving=_RECORDED)),
    WARMUP: (RequestSpec("text only, before any image", None, "normal", serving=_RECORDED),
             RequestSpec("image (the first the graphs see)", CASE_IMAGE, "normal", power=True, serving=_RECORDED,
                         proves=PROVES_WARM_GRAPH),
             RequestSpec("twin image", TWIN_IMAGE, "normal", serving=_RECORDED)),
    LAYOUT: (RequestSpec("wide image", WIDE_IMAGE, "normal", power=True, serving=_ENCODER,
                         proves=PROVES_ENCODER_GRAPH),
             RequestSpec("tall image (same tokens, grid transposed)", TALL_IMAGE, "normal", serving=_ENCODER,
                         proves=PROVES_ENCODER_GRAPH),
             RequestSpec("wide image again", WIDE_IMAGE, "normal", serving=_ENCODER,
                         proves=PROVES_ENCODER_GRAPH)),
    # Three forwards, each shared (docs/scenarios.md): DeepStack rows beside a text request's zeros, two
    # images' rows at their offsets, and an image beside the last chunk of one served in chunks (its rows
    # then follow that request's earlier chunks in the cache, the image's follow nothing).
    BATCH: (RequestSpec("image, beside a text request", CASE_IMAGE, "normal", power=True, serving=_BATCHED,
                        forward=1, proves=PROVES_SHARED_FORWARD),
            RequestSpec("text only, beside the image", None, "normal", serving=_BATCHED, forward=1,
                        proves=PROVES_SHARED_FORWARD),
            RequestSpec("large image, beside a small one", LARGE_IMAGE, "normal", serving=_BATCHED, forward=2,
                        proves=PROVES_SHARED_FORWARD),
            RequestSpec("small image, beside the large one", SMALL_IMAGE, "normal", serving=_BATCHED, forward=2,
                        proves=PROVES_SHARED_FORWARD),
            RequestSpec("image in chunks, its last beside another image", CASE_IMAGE, "normal",
                        serving=_BATCHED_CHUNKS, forward=3, proves=PROVES_SHARED_FORWARD),
            RequestSpec("twin image, beside the chunked one's last chunk", TWIN_IMAGE, "normal", serving=_BATCHED,
                        forward=3, proves=PROVES_SHARED_FORWARD)),
})


# The graph runner's planted variants of the bug family (graph_runner.RunnerVariant), each with the
# scenario that must catch it and the upstream bug it stands for (docs/scenarios.md).
PLANTED_BUGS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "chunk-misaligned": (CHUNKED, "mlx-vlm PR #1332: every chunk handed the prompt's first DeepStack rows"),
    "prefix-offset": (PREFIX, "vLLM issue #41485: DeepStack rows not offset by the cached prefix"),
    "growth-rebind": (GROWTH, "FastDeploy PR #5962: the buffer re-allocated, graphs left on the old storage"),
    "warmup-specialized": (WARMUP, "vLLM PR #43617: a graph shaped by a warm-up without DeepStack never adds it"),
    "layout-keyed": (LAYOUT, "SGLang PR #37043: vision-encoder graphs keyed by token count only"),
    "batch-offset-zero": (BATCH, "every request of a packed forward handed its DeepStack rows at offset 0 (rows "
                                 "placed at the wrong request's offset)"),
    "batch-first-only": (BATCH, "a packed forward's DeepStack refresh covering only its first request's rows"),
    "batch-slot-one": (BATCH, "a DeepStack slot sized for one request's tokens, not the batch's (it must refuse, "
                              "never truncate)"),
    "clears-own-rows": (SHRINK, "a partial fix of the stale-DeepStack leak (vLLM's persistent buffer, SGLang's "
                                "slot): it clears the rows the request in hand wrote, never an earlier, longer "
                                "request's tail"),
})
# Planted variants of inputs beyond DeepStack: the freshness witness (design §6) catches each in every
# scenario that replays, whatever the answer does.
WITNESSED_BUGS: Mapping[str, str] = MappingProxyType({
    "mrope-one-row": "vllm-omni #803: mRoPE positions wrong under CUDA graphs (one row copied into all three)",
    "mrope-stale": "TensorRT-LLM #18207: stale mRoPE slots (positions not refreshed when the bucket repeats)",
    "embeds-tail-kept": "SGLang #29018: the static input_embeds slot's padding left as an earlier request wrote it",
    "embeds-stale": "DeepSpeed #8488: a captured input never copied again (input_embeds when the shape repeats)",
})
RUNNER_VARIANTS = ("fixed", "legacy", "no-clear", *PLANTED_BUGS, *WITNESSED_BUGS)


def forwards(requests: Sequence[RequestSpec] | Sequence) -> list[list[int]]:
    """A sequence's requests as they are submitted, by index: neighbours of one `forward` together
    (the batch scenario's pairs), every other request alone. Anything with a `forward` will do: the
    design's `RequestSpec`s, a plan's requests."""
    groups: list[list[int]] = []
    for i, req in enumerate(requests):
        if groups and req.forward is not None and requests[groups[-1][0]].forward == req.forward:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def power_request(scenario: str) -> int:
    """The index of a sequence's power request: its first image request."""
    return next(i for i, spec in enumerate(SEQUENCE_REQUESTS[scenario]) if spec.power)


# --- comparisons ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One comparison of the experiment, what a correct runtime gives, and what it tests."""

    a: str
    b: str  # the reference
    expect_match: bool
    meaning: str


POWER_CHECK = Check(EAGER_ZERO, EAGER_NORMAL, False, "power: DeepStack changes the eager answer")
FOUR_ARM_CHECKS = (
    Check(BCG_NORMAL, EAGER_NORMAL, True, "graph replay preserves semantics"),
    Check(BCG_NORMAL, BCG_ZERO, False, "graph replay sees DeepStack"),
    Check(BCG_ZERO, EAGER_ZERO, True, "control: graph and eager agree with DeepStack ablated"),
    POWER_CHECK,
)
FOUR_ARMS = (EAGER_NORMAL, EAGER_ZERO, BCG_NORMAL, BCG_ZERO)
# A sequence's first request (its image, DeepStack normal) is also run eagerly with DeepStack zeroed,
# in the eager session: the sequence's power (design §3 v3). No graph arm runs it, so the graph
# sequence is exactly the requests a server would see.
SEQUENCE_POWER_ARM = EAGER_ZERO
