"""Tokens to text for a stream: whole characters only, and stop strings cut out wherever tokens split them.

Two small pieces, both pure over what they were fed:
- `Detokenizer` decodes incrementally and holds back a trailing partial UTF-8 character (a byte-level token
  may carry half of one), so a streamed answer joins to exactly the text of the non-streamed one.
- `StopMatcher` holds back the longest tail that could still begin a stop string, so a stop string spread
  over several tokens is found and never sent.
`TextStream` chains them: feed a token, get the text that is safe to send now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


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
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""  # nothing new, or a character still incomplete: wait for its next bytes
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """At the end: whatever is held back (an invalid byte sequence decodes to U+FFFD, as it should)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """What of the text so far can be sent: the part before a stop string, or that cannot start one."""
        if self.matched is not None:
            return ""
        self._pending += text
        hits = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self._pending = self._pending[:at], ""
            return out
        hold = self._held_tail()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out

    def _held_tail(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best


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
