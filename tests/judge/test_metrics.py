import pytest

from parity.judge.metrics import Tolerances, common_prefix_chars, compare as _compare, first_divergence, format_delta, logprob_delta, tf_delta
from tests.helpers_runs import make_arm


def compare(a, b, tol):
    return _compare(a, b, Tolerances(tol))


def test_identical_arms_match_with_full_text_length():
    a = make_arm("eager_normal", [1, 2, 3], text="héllo ✓", logprobs=[-0.1, -0.2, -0.3])
    b = make_arm("bcg_normal", [1, 2, 3], text="héllo ✓", logprobs=[-0.1, -0.2, -0.35])
    c = compare(b, a, 0.25)
    assert (c.divergence_char, c.token_match, c.first_token_divergence) == (7, True, None)
    assert c.logprob_delta == pytest.approx(0.05) and c.match


def test_empty_outputs():
    a, b = make_arm("eager_normal", [], text=""), make_arm("bcg_normal", [], text="")
    c = compare(a, b, 0.25)
    assert (c.divergence_char, c.token_match, c.logprob_delta, c.match) == (0, True, 0.0, True)
    one = make_arm("bcg_normal", [5], text="x", logprobs=[-3.0])
    c = compare(a, one, 0.25)
    assert (c.token_match, c.first_token_divergence, c.logprob_delta, c.match) == (False, 0, 0.0, False)


def test_prefix_divergence_is_shorter_length_and_delta_stops_there():
    a = make_arm("eager_normal", [1, 2], text="ab", logprobs=[-0.1, -0.2])
    b = make_arm("bcg_normal", [1, 2, 3], text="abc", logprobs=[-0.1, -0.9, -5.0])
    c = compare(a, b, 0.25)
    assert c.first_token_divergence == 2 and not c.token_match
    # k = min(2, n - 1) = 1: the delta covers steps 0..1 only.
    assert c.logprob_delta == pytest.approx(0.7) and c.divergence_char == 2


def test_delta_includes_first_divergent_step_but_not_later_ones():
    assert logprob_delta([-0.1, -0.5, -9.0], [-0.1, -0.2, -0.1], divergence=1) == pytest.approx(0.3)
    assert logprob_delta([], [-1.0], divergence=0) == 0.0


def test_unicode_divergence_counts_characters_not_bytes():
    assert common_prefix_chars("日本語のテキスト", "日本語の文章") == 4
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2]) is None


def test_match_needs_tokens_and_tolerance():
    a = make_arm("eager_normal", [1, 2], logprobs=[-0.1, -0.1])
    b = make_arm("bcg_normal", [1, 2], logprobs=[-0.1, -0.6])
    assert compare(a, b, 0.25).token_match and not compare(a, b, 0.25).match
    assert compare(a, b, 0.5).match


@pytest.mark.parametrize("value, tol, shown", [
    (0.0, 0.25, "0.000"), (0.071, 0.25, "0.071"), (0.2504, 0.25, "0.2504"), (3e-7, 1e-6, "3e-07"),
    (2e-6, 1e-6, "2e-06"), (0.0004, 1e-4, "0.0004"), (1.5, 0.25, "1.500"),
])
def test_a_failing_delta_is_never_shown_as_within_the_tolerance(value, tol, shown):
    assert format_delta(value, tol) == shown
    assert (float(format_delta(value, tol)) > tol) == (value > tol)


def test_tf_delta_covers_the_whole_reference_sequence():
    ref = make_arm("eager_normal", [1, 2, 3], logprobs=[-0.1, -0.2, -0.3])
    a = make_arm("bcg_normal", [1, 9, 9], logprobs=[-0.1, -0.2, -0.3],
                 forced={"eager_normal": [-0.1, -0.25, -1.3]})
    assert tf_delta(a, ref) == pytest.approx(1.0)
    assert tf_delta(make_arm("bcg_normal", [1]), ref) is None  # not scored on this reference


def test_tf_delta_compares_scores_with_scores_where_the_reference_scored_itself():
    # SGLang scores by prefill and generates by decode: the reference's own score is the baseline.
    ref = make_arm("eager_normal", [1, 2], logprobs=[-0.1, -0.2], forced={"eager_normal": [-0.15, -0.3]})
    a = make_arm("bcg_normal", [1, 2], forced={"eager_normal": [-0.15, -0.31]})
    assert tf_delta(a, ref) == pytest.approx(0.01)
