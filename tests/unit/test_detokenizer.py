"""Incremental detokenization with the default model's byte-level BPE tokenizer."""

import pytest

from server.detokenizer import IncrementalDetokenizer


def _stream(tok, text, prompt="Say:", stop=()):
    ids = tok(text)["input_ids"]
    d = IncrementalDetokenizer(tok, tok(prompt)["input_ids"], stop)
    pieces = [d.append(t) for t in ids]
    return d, pieces, ids


@pytest.mark.parametrize("text", ["Hello world, how are you?", "  leading spaces\nand lines",
                                  "naïve café — 東京 🌍🚀 ok", "x" * 50])
def test_incremental_equals_full_decode(default_tokenizer, text):
    d, pieces, ids = _stream(default_tokenizer, text)
    assert "".join(pieces) == default_tokenizer.decode(ids) == d.text
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_character_waits_for_all_its_tokens(default_tokenizer):
    ids = default_tokenizer("🌍")["input_ids"]
    assert len(ids) > 1  # an emoji spans several byte-level tokens
    d, pieces, _ = _stream(default_tokenizer, "🌍")
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🌍"


def test_stop_string_spanning_tokens(default_tokenizer):
    text = "The capital of France is Paris, a lovely city."
    ids = default_tokenizer(text)["input_ids"]
    # choose a stop string that starts inside one token and ends inside the next
    toks = [default_tokenizer.decode([t]) for t in ids]
    i = next(k for k in range(len(toks) - 1) if len(toks[k]) > 2 and len(toks[k + 1]) > 2)
    stop = toks[i][-2:] + toks[i + 1][:2]
    d, _, _ = _stream(default_tokenizer, text, stop=[stop, "never"])
    assert d.matched_stop == stop
    assert d.text == text[:text.index(stop)]
    assert d.append(ids[0]) == ""  # nothing more after a stop


def test_stream_safe_text_holds_back_possible_stop_prefix(default_tokenizer):
    d = IncrementalDetokenizer(default_tokenizer, [], stop=["STOP here"])
    for t in default_tokenizer("abc STOP")["input_ids"]:
        d.append(t)
    assert d.text == "abc STOP" and d.stream_safe_text == "abc "
    for t in default_tokenizer(" there")["input_ids"]:
        d.append(t)
    assert d.stream_safe_text == d.text == "abc STOP there"


def test_output_text_cuts_at_a_stop_string_and_hides_stop_tokens(default_tokenizer):
    """The front ends' view of a request: a stop token is counted but not shown; a stop
    string ends the output at the token that completed it, however many came after."""
    from server.detokenizer import OutputText

    tok = default_tokenizer
    ids = tok("The answer is 42. Done here")["input_ids"]
    text = OutputText(tok, tok("Q:")["input_ids"], stop=["Done"])
    half = len(ids) // 2
    assert text.feed(ids[:half], None) == half and text.finish_reason is None
    kept = text.feed(ids[half:] + [7, 8, 9], None)  # the scheduler ran past the stop
    assert text.finish_reason == {"type": "stop", "matched": "Done"}
    assert text.text == "The answer is 42. " and text.num_tokens == half + kept
    assert tok.decode(ids[:text.num_tokens]).endswith("Done")
    assert text.feed([5], None) == 0  # finished: nothing more is taken
    eos = OutputText(tok, [1], stop=[])
    assert eos.feed(ids[:3] + [tok.eos_token_id], {"type": "stop", "matched": tok.eos_token_id}) == 4
    assert eos.text == tok.decode(ids[:3]) and eos.num_tokens == 4


def test_stop_regex_and_no_stop_trim(default_tokenizer):
    """SGLang's stop_regex ends the output at the first match (across tokens); no_stop_trim
    keeps the matched text (for stop strings too)."""
    from server.detokenizer import OutputText

    tok = default_tokenizer
    ids = tok("The answer is 42. Done here")["input_ids"]
    prompt = tok("Q:")["input_ids"]
    cut = OutputText(tok, prompt, stop_regex=[r"\d+\."])
    cut.feed(ids, None)
    assert cut.text == "The answer is " and cut.finish_reason == {"type": "stop",
                                                                   "matched": "42."}
    kept = OutputText(tok, prompt, stop_regex=[r"\d+\."], no_stop_trim=True)
    kept.feed(ids, None)
    assert kept.text == "The answer is 42."
    both = OutputText(tok, prompt, stop=["Done"], no_stop_trim=True)
    both.feed(ids, None)
    assert both.text == "The answer is 42. Done"
    first = OutputText(tok, prompt, stop=["here"], stop_regex=[r"is \d"])
    first.feed(ids, None)
    assert first.text == "The answer "  # the earlier match wins


def test_a_catastrophically_backtracking_stop_regex_is_cut_off_not_run_for_hours(
        default_tokenizer):
    """(a|aa)+c over 40 a's takes ~fib(40) steps in a backtracking engine: the search stops at
    STOP_REGEX_TIMEOUT_S with an error naming the pattern, instead of freezing its caller.
    (a+)+c, which froze Python's re, the regex module searches at once."""
    from server.detokenizer import OutputText, StopRegexTimeout

    tok = default_tokenizer
    ids = tok("a" * 40)["input_ids"]
    slow = OutputText(tok, [], stop_regex=[r"(a|aa)+c"])
    with pytest.raises(StopRegexTimeout, match=r"\(a\|aa\)\+c"):
        slow.feed(ids, None)
    nested = OutputText(tok, [], stop_regex=[r"(a+)+c"])
    nested.feed(ids, None)
    assert nested.text == "a" * 40 and nested.finish_reason is None
    fine = OutputText(tok, [], stop_regex=[r"a{3}"])  # a pattern that matches runs as before
    fine.feed(ids, None)
    assert fine.text == "" and fine.finish_reason == {"type": "stop", "matched": "aaa"}
