"""Tokens to text: whole characters in every chunk; stop strings found across tokens and never sent."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.api.stops import MAX_STOP_CHARS, MAX_STOPS
from shardline.api.text_stream import MAX_HELD, Detokenizer, StopMatcher, TextStream


def decode_with(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


MIXED = "Grüße aus Köln! 東京は日本の首都です。 🙂👍🏽 naïve café — fin."


def test_multibyte_characters_never_split_across_chunks(tokenizer):
    ids = tokenizer.encode(MIXED)
    # Byte-level BPE splits some of these characters over two or more tokens: the test means something.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    d = Detokenizer(decode_with(tokenizer))
    chunks = [d.feed(t) for t in ids] + [d.flush()]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tokenizer.decode(ids)


def test_stop_string_spanning_tokens_is_cut_and_never_sent(tokenizer):
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    k = next(i for i in range(len(pieces) - 1) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # half of one token, half of the next
    s = TextStream(decode_with(tokenizer), [stop])
    chunks = [s.feed(t) for t in ids] + [s.flush()]
    out = "".join(chunks)
    assert s.stopped == stop
    assert out == text[: text.find(stop)]
    assert stop not in out
    assert s.tokens == k + 2  # the token that completed the stop string counts; later ones do not


def test_earliest_of_several_stop_strings_wins():
    s = StopMatcher(["world", "o w"])
    assert s.feed("hel") == "hel"  # could start neither: sent at once
    assert s.feed("lo") == "l"  # "o" could start "o w": held
    assert s.feed(" world") == ""  # "o w" begins before "world"
    assert s.matched == "o w"


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_the_end():
    s = StopMatcher(["</end>"])
    assert s.feed("a </en") == "a "
    assert s.flush() == "</en"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab é東🙂\n")), min_size=1, max_size=40),
    stop=st.text(alphabet=st.sampled_from(list("ab é東🙂\n")), min_size=1, max_size=4),
)
def test_streamed_text_is_the_whole_text_cut_at_the_first_stop(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    s = TextStream(decode_with(tokenizer), [stop])
    chunks = [s.feed(t) for t in ids] + [s.flush()]
    whole = tokenizer.decode(ids)
    expected = whole[: whole.find(stop)] if stop in whole else whole
    assert "".join(chunks) == expected
    assert all("\ufffd" not in c for c in chunks)


class NaiveStops:
    """The stop rule written plainly (the matcher before its automaton): the stop string starting first wins
    (of two starting together, the shorter); the longest tail that is a proper prefix of one is held."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.pending = self.pending[:at], ""
            return out
        hold = max((k for s in self.stops for k in range(len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


@pytest.mark.timeout(120)
@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab", min_size=0, max_size=6), min_size=0, max_size=5),
    pieces=st.lists(st.text(alphabet="abc", max_size=7), max_size=12),
)
def test_stop_matcher_sends_and_holds_exactly_what_the_plain_rule_does(stops, pieces):
    fast, plain = StopMatcher(stops), NaiveStops(stops)
    for piece in pieces:
        assert fast.feed(piece) == plain.feed(piece), (stops, pieces)
        assert fast.matched == plain.matched
    assert fast.flush() == plain.flush()


@pytest.mark.timeout(60)
def test_stop_matching_costs_the_same_per_token_for_the_longest_allowed_stop_strings():
    # The worst case of the plain rule: a long held tail that every other stop string must be tried against
    # at each of its lengths. The automaton's cost per character does not depend on the stop strings.
    n, long = MAX_STOPS, MAX_STOP_CHARS
    stops = ["c" + "a" * (long - 2) + chr(ord("d") + i) for i in range(n - 1)] + ["a" * (long - 1) + "b"]

    def cost(matcher: StopMatcher | NaiveStops) -> float:
        for _ in range(long):  # hold the longest tail
            matcher.feed("aaaa")
        start = time.perf_counter()
        for _ in range(200):
            matcher.feed("aaaa")
        return time.perf_counter() - start

    one = cost(StopMatcher(["x"]))
    worst = cost(StopMatcher(stops))
    assert worst < 20 * one + 0.005, (worst, one)  # the plain rule here is hundreds of times the cost


@pytest.mark.timeout(10)
def test_a_stream_of_invalid_bytes_is_settled_and_the_window_stays_bounded():
    """Every token an invalid byte (decodes to U+FFFD): the text still comes out, a few tokens late, and each
    token decodes a bounded window instead of everything since the last text sent."""
    decoded: list[int] = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return "\ufffd" * len(ids)

    d = Detokenizer(decode)
    out = "".join(d.feed(7) for _ in range(1000)) + d.flush()
    assert out == "\ufffd" * 1000
    assert max(decoded) <= 2 * MAX_HELD
