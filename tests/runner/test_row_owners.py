"""One leak witness: the in-process runner and vLLM's tap name the request behind stale rows by the
same rule (`parity.row_owners`): the one that left most of them, on a tie the one that left the first."""

from __future__ import annotations

from pathlib import Path

import torch

from parity.row_owners import RowOwners
from parity.runner.graph_runner import RunnerVariant
from tests.engines.test_vllm_units import shrinking_stream_text
from tests.runner.test_graph_runner import HIDDEN, WIDTH, make_runner


def _owners(*writes: tuple[str, int]) -> RowOwners:
    owners = RowOwners(16)
    for tag, rows in writes:
        owners.begin(tag)
        owners.wrote(rows)
    return owners


def test_the_request_that_left_most_rows_is_named_and_a_tie_goes_to_the_first_row() -> None:
    owners = _owners(("long", 14), ("short", 4))  # short owns rows 0..3, long 4..13
    assert owners.named(range(1, 14)) == "long"
    assert owners.named([2, 3, 4, 5]) == "short"  # 2 rows each: short left the first
    assert owners.named([14, 15]) is None  # never written


def test_only_rows_an_earlier_write_left_are_stale() -> None:
    owners = _owners(("image", 8))
    owners.begin("image")  # the same request's next write: its rows are not this write's
    owners.wrote(2)
    assert owners.left_by_others(range(8)) == [2, 3, 4, 5, 6, 7]
    owners.cleared(8, 4)
    assert owners.left_by_others(range(8)) == [2, 3] and owners.named(range(8)) == "image"


def _shrinking_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """`shrinking_stream_text`'s DeepStack rows, as the runner holds them ([tokens, levels * hidden]):
    a long image with rows 2..13, then a short one with rows 1..2 over its first four rows."""
    long_image, short_image = torch.zeros(14, WIDTH), torch.zeros(4, WIDTH)
    long_image[2:14], short_image[1:3] = 1.0, 2.0
    return long_image, short_image


def test_the_in_process_runner_and_the_vllm_tap_name_the_same_request(tmp_path: Path) -> None:
    """Text after the shrinking stream reads rows 0..3 (the short image's write) and 4..13 (the long
    one's tail): both witnesses name the long image. The freshness witness counts every row the text
    request did not write (14); the tap, which sees values and not writes, the rows holding features (12)."""
    long_image, short_image = _shrinking_rows()
    runner = make_runner(RunnerVariant.NO_CLEAR, buckets=(16,))
    for tag, rows in (("long", long_image), ("short", short_image)):
        runner.replay(torch.zeros(rows.shape[0], HIDDEN), torch.zeros(3, rows.shape[0], dtype=torch.long), rows,
                      owner=tag)
    embeds, positions = torch.zeros(14, HIDDEN), torch.zeros(3, 14, dtype=torch.long)
    runner.replay(embeds, positions, None, owner="text")
    record = next(r for r in runner.freshness(embeds, positions, None) if r.input == "deepstack")
    assert (record.stale, record.left_by) == (14, "long")

    text = shrinking_stream_text(tmp_path)  # the same stream through vLLM's tap
    assert (text.stale_rows, text.stale_source) == (12, "long")
