"""Stored responses of the Responses API, so that `previous_response_id` continues a conversation.

Kept in this node's memory only (a follow-up must come back to the node that answered), bounded three ways,
the oldest going first: STORE_TTL_S after it was made, at most MAX_STORED of them, and at most
MAX_STORED_CHARS characters of conversation together (one request's body may be 32 MiB; this keeps a few
long agent sessions, not an unbounded heap). Reading one makes it the most recently used.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STORE_TTL_S = 3600.0
MAX_STORED = 256
MAX_STORED_CHARS = 64 << 20


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the Response object as it was returned
    conversation: list[dict[str, Any]]  # its input and output as chat messages, without its instructions
    chars: int
    expires: float


class ResponseStore:
    def __init__(
        self,
        max_count: int = MAX_STORED,
        ttl_s: float = STORE_TTL_S,
        max_chars: int = MAX_STORED_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_count = max_count
        self.ttl_s = ttl_s
        self.max_chars = max_chars
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def put(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(conversation, default=str)) + len(json.dumps(response, default=str))
        if chars > self.max_chars:
            return  # larger than the whole store: kept by nobody, and a follow-up gets the 404 that says so
        with self._lock:
            self._drop(rid)
            self._items[rid] = Stored(response, conversation, chars, self._clock() + self.ttl_s)
            self._chars += chars
            self._expire()
            while len(self._items) > self.max_count or self._chars > self.max_chars:
                self._drop(next(iter(self._items)))

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            self._expire()
            stored = self._items.get(rid)
            if stored is not None:
                self._items.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        stored = self._items.pop(rid, None)
        if stored is None:
            return False
        self._chars -= stored.chars
        return True

    def _expire(self) -> None:
        now = self._clock()
        for rid in [rid for rid, s in self._items.items() if s.expires <= now]:
            self._drop(rid)
