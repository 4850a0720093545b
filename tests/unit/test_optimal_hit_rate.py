"""The optimal hit rate reported by the benchmarks (SGLang paper Theorem 3.1)."""

from benchmarks.common import optimal_hit_rate


def test_shared_prefix_is_computed_once():
    shared = list(range(100))
    prompts = [shared + [1000 + i] for i in range(4)]
    # 100 shared + 4 distinct tokens computed, of 404 prompt tokens
    assert abs(optimal_hit_rate(prompts) - (1 - 104 / 404)) < 1e-12
    assert optimal_hit_rate([[1, 2, 3]]) == 0.0
    assert optimal_hit_rate([]) == 0.0


def test_decoded_tokens_are_credited_to_later_prompts():
    """A multi-call program: call 2's prompt repeats call 1's prompt and output; the output was
    computed by decoding, so only call 2's new suffix needs prefill."""
    p1 = list(range(50))
    out1 = [500, 501, 502, 503, 504]
    p2 = p1 + out1 + [600, 601]
    without = optimal_hit_rate([p1, p2])
    with_outputs = optimal_hit_rate([p1, p2], [(p1, p1 + out1)])
    assert abs(without - (1 - 57 / 107)) < 1e-12
    assert abs(with_outputs - (1 - 52 / 107)) < 1e-12
