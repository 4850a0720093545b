"""Grounded extraction: the grammar of every contiguous word span of some texts, so a
generated answer is always copied from them (``sgl.gen(..., substring_of=passages)``).

A span starts and ends on a word (a run of ``\\w`` characters) and keeps the text's own
separators between its words (spaces, punctuation, newlines), so "Guglielmo Marconi" and
"1895" can come out of "... Guglielmo Marconi sent signals in 1895." but "Marconi sent" with a
changed separator, or a word that is not there, cannot. The grammar is linear in the text:
one rule per word, ``w_i ::= "word_i" ("sep_i" w_{i+1})?``, and ``root`` is the alternation of
the rules, i.e. "start at any word, stop after any later word". Given several texts, a span
never crosses from one into the next.

With ``max_words`` L a span has at most L words: one rule per (word, words left), so the
grammar grows as n x L instead of n (small models otherwise run on through a sentence).

The result is an EBNF grammar in xgrammar's dialect (the server's ``ebnf`` constraint); string
literals are JSON-escaped.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

_WORD = re.compile(r"(\w+)")


def substring_grammar(texts: str | Sequence[str], max_words: int | None = None) -> str:
    """EBNF (``root ::= ...``) accepting exactly the word spans of ``texts``.

    Args:
        texts: one text or several (passages); spans stay within one.
        max_words: longest span in words (None = no limit).
    Raises ValueError when no text has a word, or max_words < 1.
    """
    if max_words is not None and max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    texts = [texts] if isinstance(texts, str) else list(texts)
    starts: list[str] = []
    rules: list[str] = []
    for t, text in enumerate(texts):
        parts = _WORD.split(text)
        words, seps = parts[1::2], parts[2::2]
        for i, word in enumerate(words):
            lefts = [None] if max_words is None else range(1, min(max_words, len(words) - i) + 1)
            for left in lefts:
                name = f"t{t}w{i}" + ("" if left is None else f"r{left}")
                body = _lit(word)
                if i + 1 < len(words) and left != 1:
                    nxt = f"t{t}w{i + 1}" + ("" if left is None else f"r{left - 1}")
                    body += f" ({_lit(seps[i])} {nxt})?"
                rules.append(f"{name} ::= {body}")
            starts.append(f"t{t}w{i}" + ("" if max_words is None
                                         else f"r{min(max_words, len(words) - i)}"))
    if not starts:
        raise ValueError("substring_of: the text has no words to copy from")
    return "\n".join([f"root ::= {' | '.join(starts)}", *rules])


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)
