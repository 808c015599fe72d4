"""Stop strings: the bounds every API holds a request's stop strings to, and the automaton that finds them.

Bounds: at most MAX_STOPS strings of at most MAX_STOP_CHARS characters each. OpenAI allows 4, which is too
few for the chat templates Ollama and Anthropic clients send; 16 x 256 covers every template's end markers
and keeps the automaton small (at most 4096 states).

`StopAutomaton` is Aho-Corasick over the stop strings. Fed a character, it moves to the longest suffix of
the text so far that is a prefix of some stop string. A step costs O(1) amortised (a failure walk only
undoes depth that earlier characters added, one each), so a token's new text costs O(its length) over a
stream, and never more than O(its length + MAX_STOP_CHARS), however many stop strings there are: cheap
enough for the event loop. The scan it replaces cost O(stops x length^2) per token there. Building it
costs milliseconds at the bounds, so it is built off the loop (see Service.start).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shardline.api.errors import bad_request
from shardline.api.limits import MAX_STOP_CHARS, MAX_STOPS

__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "StopAutomaton", "checked_stops"]


def checked_stops(stops: Sequence[str], param: str) -> list[str]:
    """The stop strings as given, or a 400 naming `param` when there are too many or one is too long."""
    if len(stops) > MAX_STOPS:
        raise bad_request(f"{param}: at most {MAX_STOPS} stop sequences, not {len(stops)}", param)
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(
                f"{param}: a stop sequence is at most {MAX_STOP_CHARS} characters, not {len(s)}", param
            )
    return list(stops)


class StopAutomaton:
    """States are the prefixes of the stop strings (0: the empty one); `depth` is a state's length and
    `longest` the length of the longest stop string that ends it (0: none)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._next: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.longest = [0]
        for s in stops:
            state = 0
            for ch in s:
                nxt = self._next[state].get(ch)
                if nxt is None:
                    nxt = len(self._next)
                    self._next[state][ch] = nxt
                    self._next.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.longest.append(0)
                state = nxt
            if s:
                self.longest[state] = len(s)
        self._fail = [0] * len(self._next)
        self._link_failures()

    def _link_failures(self) -> None:
        """Breadth first: a state's failure is the longest proper suffix of it that is also a state."""
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in self._next[state].items():
                self._fail[nxt] = self.step(self._fail[state], ch) if state else 0
                if not self.longest[nxt]:  # a shorter stop string may end here too
                    self.longest[nxt] = self.longest[self._fail[nxt]]
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        while True:
            nxt = self._next[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self._fail[state]
