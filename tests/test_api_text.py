"""Tokens to text: whole characters in every chunk; stop strings found across tokens and never sent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.api.text import Detokenizer, StopMatcher, TextStream


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
