"""Tokens to text for a stream: whole characters only, and stop strings cut out wherever tokens split them.

Two small pieces, both pure over what they were fed:
- `Detokenizer` decodes incrementally and holds back a trailing partial UTF-8 character (a byte-level token
  may carry half of one), so a streamed answer joins to exactly the text of the non-streamed one.
- `StopMatcher` holds back the longest tail that could still begin a stop string, so a stop string spread
  over several tokens is found and never sent. It costs O(new text) per token (see api.stops), so it runs
  on the event loop with the rest of a stream's work.
`TextStream` chains them: feed a token, get the text that is safe to send now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shardline.api.stops import StopAutomaton

REPLACEMENT = "\ufffd"


MAX_HELD = 8  # tokens a detokenizer holds back at most


class Detokenizer:
    """Incremental decode over a sliding window: decode(ids[prefix:]) less decode(ids[prefix:read]) is the
    new text, emitted only once it no longer ends inside a character."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # ids before this are settled; decoding from here gives the right spacing
        self._read = 0  # ids before this have had their text emitted

    def feed(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        # A character is at most 4 bytes: past MAX_HELD tokens held, the text is settled as it decodes
        # (U+FFFD for invalid bytes), so a model emitting garbage bytes cannot grow the window without end.
        settle = len(self.ids) - self._read >= MAX_HELD
        if not settle and (len(now) <= len(before) or now.endswith(REPLACEMENT)):
            return ""  # nothing new, or a character still incomplete: wait for its next bytes
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""

    def flush(self) -> str:
        """At the end: whatever is held back (an invalid byte sequence decodes to U+FFFD, as it should)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._automaton = StopAutomaton(self.stops)
        self._state = 0  # the automaton's state: its depth is the length of the pending text
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """What of the text so far can be sent: the part before a stop string, or that cannot start one.

        The stop string found is the one that starts first (of two starting together, the shorter), among
        those that end in this text: the pending text held back before it contains none."""
        if self.matched is not None:
            return ""
        automaton, state = self._automaton, self._state
        base = len(self._pending)
        self._pending += text
        hit: tuple[int, int] | None = None  # (start, end) in the pending text
        for end, ch in enumerate(text, base + 1):
            state = automaton.step(state, ch)
            n = automaton.longest[state]
            if n and (hit is None or end - n < hit[0]):
                hit = (end - n, end)
        if hit is not None:
            at, stop_end = hit
            self.matched = self._pending[at:stop_end]
            out, self._pending = self._pending[:at], ""
            return out
        self._state = state
        hold = automaton.depth[state]  # the longest tail that could still begin a stop string
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        self._state = 0
        return out


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._detok = Detokenizer(decode)
        self._stops = StopMatcher(stops)
        self.text = ""  # everything sent so far
        self.tokens = 0  # tokens fed, up to and including the one that completed a stop string

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def feed(self, token: int) -> str:
        if self.stopped is not None:
            return ""
        self.tokens += 1
        out = self._stops.feed(self._detok.feed(token))
        self.text += out
        return out

    def flush(self) -> str:
        out = "" if self.stopped is not None else self._stops.feed(self._detok.flush()) + self._stops.flush()
        self.text += out
        return out
