"""The front: one node API's request table for one instance: validation, submit, cancel, resubmit.

Request state lives here, never only inside a runner. The front hears the controller's announcements
(Serving / Recovering / InstanceFailed) and the leader's events; it sends Submit / Cancel to the serving
generation's leader. It checks what the leader tells it: a gap in token indices, a finish with fewer tokens
than the client has, or a request the leader no longer holds is a lost message, reported to the controller
as a fault of that generation (which rebuilds it); never a silently short answer. A report is a publication,
lost when no master listens at that moment (a master change, a link just back): a fault still seen is
reported again every REPORT_AGAIN_S until a new generation serves. What controllers announce is ordered by
(master term, generation): a deposed master's last words never outrank the next master's.

Over 500 lines: one class whose request table, generation and control link one lock guards together; its
handlers of updates, events and beats read and change them under that lock, and split apart they would
have to share it across modules.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zenoh

from shardline.compute.kv import KV_STEP, round_up
from shardline.compute.sampling import SamplingParams
from shardline.dataplane import frame
from shardline.dataplane import messages as m
from shardline.dataplane.transport import DeadlineExceeded, Envelope, Inbox, Keys, Outbox
from shardline.errors import ContextLengthError, EngineError, OverloadError, RequestTooLargeError
from shardline.front.figures import LeaderFigures
from shardline.front.request import RequestHandle, RequestState

log = logging.getLogger("shardline.front")
MAX_REQUEST_ID = 128
# A Submit the leader's process has not received this long after it went out was lost on the way (a link
# that dropped what it held): transport time, whatever the leader is computing, plus a flap within the lease.
SUBMIT_LOST_S = 8.0
REPORT_AGAIN_S = 1.0  # a generation's fault still seen this long after its last report is reported again
FRONT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a key chunk: the front's reply key ends with it
# Events a front queues while it is busy: only its own requests' events and the leader's beats reach it
# (keys.reply), so this holds 64 streams at 100 tokens a second for 10 s before a token is dropped.
INBOX_CAPACITY = 65536
# Deadlines of a request's waits, at rates well under what the slowest setup sustains (a large model on
# CPU), so that one passes only when the request is stuck, never when it is slow: a generous floor that a
# rebuild after a failure (load, warm-up, replay) fits in, a share per request queued ahead of it, its prompt
# at PREFILL_TOKENS_PER_S and its tokens at DECODE_TOKENS_PER_S.
WAIT_FLOOR_S = 180.0
QUEUED_AHEAD_S = 10.0
PREFILL_TOKENS_PER_S = 20.0
DECODE_TOKENS_PER_S = 1.0
DEADLINE_CHECK_S = 0.5


@dataclass(frozen=True)
class Deadlines:
    first_token_s: float  # from submit to the first token
    stall_s: float  # from one token to the next (a resume replays the prompt and the tokens so far)
    total_s: float  # from submit to the end


def request_deadlines(ahead: int, prompt: int, max_tokens: int, floor_s: float = WAIT_FLOOR_S) -> Deadlines:
    """How long a request may wait for what, scaled to its work: requests ahead of it, its prompt, its
    max_tokens."""
    first = floor_s + ahead * QUEUED_AHEAD_S + prompt / PREFILL_TOKENS_PER_S
    stall = floor_s + (prompt + max_tokens) / PREFILL_TOKENS_PER_S
    return Deadlines(first, stall, first + max_tokens / DECODE_TOKENS_PER_S)


def expired_wait(state: RequestState, now: float, stall_s: float) -> str | None:
    """Which of the request's waits passed its deadline at `now`, said for its client; None while none."""
    if not state.generated and now > state.first_token_by:
        where = "the instance serving it" if state.sent_generation is None else "its first token"
        late = now - state.submitted_at
        return f"the request waited {late:.0f}s for {where}, past its deadline; retry later"
    if state.generated and now - state.progress_at > stall_s:
        gap = now - state.progress_at
        return f"no token came for {gap:.0f}s after token {len(state.generated)}, past its deadline"
    if now > state.done_by:
        late = now - state.submitted_at
        return f"the request did not finish within its deadline ({late:.0f}s, {len(state.generated)} tokens)"
    return None


class _Superseded(Exception):
    """A newer update arrived while the front waited for a generation's leader."""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_length: int


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        raise ValueError(f"request id must be 1..{MAX_REQUEST_ID} printable characters")


def submit_bytes(prompt: int, max_tokens: int, stop_tokens: int, sampling: SamplingParams, vocab: int) -> int:
    """At most how large a request's Submit header grows: its token lists at their longest (a resume resends
    every token streamed so far) at the widest id's digits, its settings, and room for the rest."""
    per_token = len(str(max(vocab - 1, 0))) + 1
    return (prompt + max_tokens + stop_tokens) * per_token + len(sampling.model_dump_json()) + 1024


def check_submit_size(size: int) -> None:
    """A Submit the leader could not parse would read as one lost on the way, and fail the generation: a
    request that cannot fit is refused here, before it is sent. Half the frame limit leaves room for its
    first step, which carries its settings and at most the same tokens again (runner/leader.py)."""
    limit = frame.MAX_HEADER_BYTES // 2
    if size > limit:
        raise RequestTooLargeError(f"the request needs {size} bytes as one message; at most {limit} travel")


class Front:
    def __init__(
        self,
        session: zenoh.Session,
        keys: Keys,
        limits: ModelLimits,
        *,
        max_queue: int = 256,
        resume: str = "exact",
        match_timeout: float = 10.0,
        name: str | None = None,
        wait_floor_s: float = WAIT_FLOOR_S,
    ) -> None:
        self.name = name or f"front-{uuid.uuid4().hex[:8]}"
        if not FRONT_NAME.fullmatch(self.name):
            raise ValueError(f"a front's name is 1..128 letters, digits, '.', '_' or '-', not {self.name!r}")
        self.wait_floor_s = wait_floor_s
        self.limits = limits
        self.max_queue = max_queue
        self.resume = resume
        self.match_timeout = match_timeout
        self.keys = keys
        self._session = session
        self._lock = threading.Lock()  # the request table and generation; never held while sending
        self._send_lock = threading.Lock()  # control seq and put order agree
        self._seq = 0
        self.requests: dict[str, RequestHandle] = {}  # unfinished, in arrival order
        self.generation: int | None = None  # the generation serving now, if any
        self._control: Outbox | None = None
        self.kv_bytes_per_token = 0
        self.kv_budget_bytes = 0
        self.kv_block = KV_STEP
        self.failure: str | None = None
        self.closed = False
        self.serving = threading.Event()
        self._reported: tuple[int, float] | None = None  # (generation, when) of the last fault report
        self._newest = (-1, -1)  # (master term, generation) of the newest Serving / Recovering heard
        self._unreachable = (-1, -1)  # the newest Serving whose leader never answered (reported already)
        self._failed_term = -1  # the term whose controller gave the instance up
        self.leader_held = 0  # requests the serving leader holds (admitted or waiting), from its last beat
        self.figures = LeaderFigures()  # the instance's traffic from every front, from the leader's beats
        # Cancels asked for where the lock may be held already (a handle's finaliser): sent from the thread.
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._checked = 0.0  # when deadlines were last checked
        self._inbox = Inbox(session, name=self.name, capacity=INBOX_CAPACITY)
        # The leader's beats to every front ("beats"), and this front's own requests' events with a beat of
        # its own ("events"): never another front's. Only the own beat says which requests the leader lost:
        # it travels behind their ends on one key, where a beat to every front may overtake them.
        self._inbox.subscribe(self.keys.events_any, m.EVENTS, "beats")
        self._inbox.subscribe(self.keys.replies_any(self.name), m.EVENTS, "events")
        self._inbox.subscribe(self.keys.updates, m.INSTANCE, "updates")
        self._reports = Outbox(session, self.keys.reports)
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)

    def start(self) -> Front:
        self._thread.start()
        return self

    # ---- requests ----------------------------------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_tokens: list[int] | None = None,
        want_logits: bool = False,
        request_id: str | None = None,
    ) -> RequestHandle:
        if not prompt:
            raise ValueError("prompt is empty")
        vocab, context = self.limits.vocab_size, self.limits.context_length
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(prompt) >= context:
            raise ContextLengthError(
                f"prompt has {len(prompt)} tokens; the model's context is {context} tokens"
            )
        if request_id is not None:
            check_request_id(request_id)
        max_tokens = min(max_tokens, context - len(prompt))
        sampling = sampling or SamplingParams()
        if sampling.temperature > 0 and "seed" not in sampling.model_fields_set:
            # A fixed seed per request makes a resumed request continue exactly where it was.
            sampling = sampling.model_copy(update={"seed": int.from_bytes(os.urandom(7), "little")})
        check_submit_size(submit_bytes(len(prompt), max_tokens, len(stop_tokens or []), sampling, vocab))
        state = RequestState(
            request_id=request_id or uuid.uuid4().hex,
            prompt=list(prompt),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_tokens=list(stop_tokens or []),
            want_logits=want_logits,
        )
        handle = RequestHandle(state, self.cancel, self.cancel_soon)
        with self._lock:
            if self.closed:
                raise EngineError("engine is shut down")
            if self.failure is not None:
                raise EngineError(f"instance failed: {self.failure}")
            if state.request_id in self.requests:
                raise ValueError(f"request id {state.request_id!r} is already running")
            per_token, budget = self.kv_bytes_per_token, self.kv_budget_bytes
            # KV is reserved as it is used (runner/leader.py): a request fits when its prompt does; one that
            # outgrows what the instance holds waits its turn, or ends there if it is alone.
            need = round_up(len(prompt) + 1, self.kv_block) * per_token
            if budget and per_token and need > budget:
                raise ContextLengthError(
                    f"the prompt's {len(prompt)} tokens need {need} bytes of KV cache; the instance holds "
                    f"{budget}"
                )
            waiting = sum(1 for h in self.requests.values() if not h.state.admitted)
            if waiting >= self.max_queue:
                raise OverloadError(f"{waiting} requests are waiting already (limit {self.max_queue})")
            limits = request_deadlines(self.leader_held + waiting, len(prompt), max_tokens, self.wait_floor_s)
            state.first_token_by = state.submitted_at + limits.first_token_s
            state.done_by = state.submitted_at + limits.total_s
            self.requests[state.request_id] = handle
            # While no generation serves, the request waits here; the next Serving sends it.
            target = self._claim([handle]) if self.generation is not None else None
        if target is not None:
            self._send_submits(*target)
        return handle

    def cancel(self, request_id: str) -> None:
        """Ends the request now, as cancelled; it is never resumed, and the stages release its KV."""
        with self._lock:
            handle = self.requests.pop(request_id, None)
            if handle is None or not handle._finish("cancelled"):
                return
            sent_here = handle.state.sent_generation == self.generation and self.generation is not None
            control = self._control if sent_here else None
        if control is not None:
            self._send(control, lambda seq: m.Cancel(front=self.name, seq=seq, request_id=request_id))

    def cancel_soon(self, request_id: str) -> None:
        """cancel(), from the front's thread: safe where this thread may hold the front's lock (a finaliser)
        and where a send must not block (an event loop)."""
        self._cancels.put(request_id)

    def announce(self, update: Any) -> None:
        """An instance update learnt elsewhere (the cluster view): handled in order with the others."""
        self._inbox.inject("updates", update)

    def close(self, why: str = "engine shut down") -> None:
        with self._lock:
            self.closed = True
            self._fail_all(why)
            control, self._control = self._control, None
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if control is not None:
            control.close()
        self._inbox.close()

    @property
    def dropped(self) -> int:
        return self._inbox.dropped

    def running(self) -> int:
        with self._lock:
            return sum(1 for h in self.requests.values() if h.state.admitted)

    def waiting(self) -> int:
        with self._lock:
            return sum(1 for h in self.requests.values() if not h.state.admitted)

    # ---- under the lock ------------------------------------------------------------------------------------

    def _claim(
        self, handles: list[RequestHandle], held: bool = False
    ) -> tuple[Outbox, int, list[RequestHandle]] | None:
        """Mark requests as sent to the serving generation (once each); the caller sends them unlocked.
        held: requests this front accepted before the generation served (waiting for it, or resubmitted
        after a failure): the leader takes them whatever its queue holds (Submit.resubmit)."""
        assert self.generation is not None and self._control is not None
        mine = [h for h in handles if not h.done and h.state.sent_generation != self.generation]
        for h in mine:
            h.state.resent = held
            h.state.sent_generation = self.generation
            h.state.sent_seq = None
            h.state.admitted = False
        return (self._control, self.generation, mine) if mine else None

    def _fail_all(self, why: str) -> None:
        for h in list(self.requests.values()):
            h._finish(error=why)
        self.requests.clear()

    # ---- sending (never under the state lock) ------------------------------------------------------------

    def _send(self, control: Outbox, make: Callable[[int], Any]) -> int | None:
        with self._send_lock:
            self._seq += 1
            try:
                control.send(make(self._seq))
            except Exception as exc:  # a generation that just went away: its successor gets a resend
                log.debug("send on %s failed: %s", control.key, exc)
                return None
            return self._seq

    def _send_submits(self, control: Outbox, generation: int, handles: list[RequestHandle]) -> None:
        for h in handles:
            spec = h.state.spec(self.resume)
            with self._send_lock:
                # cancel() finishes the handle before it takes the send lock to send its Cancel: checked
                # here, under that lock, a Submit either goes before the Cancel or not at all (no orphan).
                if h.done:
                    continue
                self._seq += 1
                seq = self._seq
                with self._lock:  # a beat checks both under it: it sees both set or neither
                    h.state.sent_at = time.monotonic()
                    h.state.sent_seq = seq  # before the put: a beat covering seq must find it set
                try:
                    control.send(m.Submit(front=self.name, seq=seq, request=spec, resubmit=h.state.resent))
                except Exception as exc:
                    log.debug("submit on %s failed: %s", control.key, exc)

    def _report_fault(self, generation: int, why: str) -> None:
        log.error("generation %d lost a message: %s", generation, why)
        try:
            self._reports.send(m.GenerationFault(generation=generation, why=why))
        except Exception:
            log.exception("could not report a fault of generation %d", generation)

    # ---- what the instance says ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.closed:
            self._tick()
            try:
                env = self._inbox.get(timeout=0.2)
            except DeadlineExceeded:
                continue  # idle: the tick notices close(), cancels asked for and deadlines
            try:
                if env.source == "updates":
                    self._on_update(env.message)
                else:
                    self._on_event(env)
            except Exception:  # one bad event must not end the front: its requests would wait forever
                log.exception("front failed on %s", type(env.message).__name__)

    def _on_update(self, msg: Any) -> None:
        # Generations only move forward within a term, and a newer master's word outranks a deposed one's:
        # cut off, an old master may have failed the generation the next one adopted and launched a newer id
        # that never served. Its Recovering must not hide the adopted generation's Serving.
        if isinstance(msg, m.Serving | m.Recovering) and (msg.term, msg.generation) < self._newest:
            return
        if isinstance(msg, m.Serving) and (msg.term, msg.generation) <= self._unreachable:
            # A view that still lists a generation whose leader is gone (a new master deciding what to
            # adopt) repeats its Serving each period: waited for once, reported once.
            return
        if isinstance(msg, m.InstanceFailed) and msg.term < self._newest[0]:
            return  # given up by a master that was deposed since
        if isinstance(msg, m.Serving) and msg.generation == self.generation:
            self._newest = max(self._newest, (msg.term, msg.generation))
            return  # told twice (by the controller and by the view): already serving it
        if isinstance(msg, m.Serving | m.Recovering):
            self._newest = (msg.term, msg.generation)
        if isinstance(msg, m.Serving) and self.failure is not None and msg.term > self._failed_term:
            with self._lock:
                self.failure = None  # a newer master serves what a deposed one gave up
        if isinstance(msg, m.Serving):
            control = Outbox(self._session, self.keys.at(msg.generation).control, msg.generation)
            try:
                control.wait_matched(self.match_timeout, abort=lambda: self._superseded(msg))
            except _Superseded:
                control.close()  # a newer word waits behind this one: no fault, no wait to the end
                return
            except DeadlineExceeded as exc:
                control.close()
                self._unreachable = max(self._unreachable, (msg.term, msg.generation))
                self._report_fault(msg.generation, str(exc))
                return
            with self._lock:
                if self.closed or self.failure is not None:
                    control.close()
                    return
                old, self._control = self._control, control
                self.generation = msg.generation
                self.kv_bytes_per_token = msg.kv_bytes_per_token
                self.kv_budget_bytes = msg.kv_budget_bytes
                self.kv_block = msg.kv_block
                for h in list(self.requests.values()):
                    if len(h.state.generated) >= h.state.max_tokens:
                        # Every token arrived; only the finish was lost with the old generation.
                        h._finish("length")
                        self.requests.pop(h.request_id, None)
                target = self._claim(list(self.requests.values()), held=True)
                resent = len(target[2]) if target else 0
            if old is not None:
                old.close()
            if target is not None:
                self._send_submits(*target)
            try:
                self._reports.send(m.Resubmitted(generation=msg.generation, requests=resent))
            except Exception:
                pass
            self.serving.set()
        elif isinstance(msg, m.Recovering):
            with self._lock:
                self.generation = None
                self.leader_held = 0
                self.figures.idle()
                old, self._control = self._control, None
                for h in self.requests.values():
                    h.state.admitted = False  # waits again until the next generation admits it
            self.serving.clear()
            if old is not None:
                old.close()
        elif isinstance(msg, m.InstanceFailed):
            with self._lock:
                self._failed_term = msg.term
                self.failure = msg.why
                self.generation = None
                self._fail_all(f"instance failed: {msg.why}")
            self.serving.set()  # wakes whoever waits for the first generation: it will not come

    def _tick(self) -> None:
        while True:
            try:
                self.cancel(self._cancels.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        if now - self._checked < DEADLINE_CHECK_S:
            return
        self._checked = now
        expired: list[tuple[RequestHandle, str]] = []
        with self._lock:
            for h in self.requests.values():
                s = h.state
                stall = request_deadlines(0, len(s.prompt), s.max_tokens, self.wait_floor_s).stall_s
                if (why := expired_wait(s, now, stall)) is not None:
                    expired.append((h, why))
        for h, why in expired:
            log.warning("request %s: %s", h.request_id, why)
            self._expire(h, why)

    def _expire(self, handle: RequestHandle, why: str) -> None:
        """End a request whose wait passed its deadline, with that error; the leader releases it."""
        with self._lock:
            if self.requests.pop(handle.request_id, None) is None:
                return
            handle.state.expired = True
            handle._finish(error=why)
            sent_here = handle.state.sent_generation == self.generation and self.generation is not None
            control = self._control if sent_here else None
        if control is not None:
            rid = handle.request_id
            self._send(control, lambda seq: m.Cancel(front=self.name, seq=seq, request_id=rid))

    def _superseded(self, serving: m.Serving) -> None:
        """Raises _Superseded when an update queued behind `serving` outranks it: a view still listing a
        generation whose leader is gone must not hold the front while the next master's word waits."""
        key = (serving.term, serving.generation)
        for u in self._inbox.queued("updates"):
            if isinstance(u, m.Serving | m.Recovering) and (u.term, u.generation) > key:
                raise _Superseded
            if isinstance(u, m.InstanceFailed) and u.term >= serving.term:
                raise _Superseded

    def _on_event(self, env: Envelope) -> None:
        msg = env.message
        fault: str | None = None
        with self._lock:
            generation = self.generation
            if generation is None or env.generation != generation:
                return  # an old generation's late event: its requests are resent already
            if isinstance(msg, m.LeaderBeat):
                fault = self._check_beat(msg, own=env.source == "events")
            else:
                handle = self.requests.get(msg.request_id)
                if handle is not None:
                    fault = self._apply(handle, msg, env)
        if fault is not None and self._report_due(generation, time.monotonic()):
            self._report_fault(generation, fault)

    def _report_due(self, generation: int, now: float) -> bool:
        """A fault of `generation` is reported now: its first, or one still seen REPORT_AGAIN_S after."""
        last = self._reported
        if last is not None and last[0] == generation and now - last[1] < REPORT_AGAIN_S:
            return False
        self._reported = (generation, now)
        return True

    def _apply(self, handle: RequestHandle, msg: Any, env: Envelope) -> str | None:
        state = handle.state
        if isinstance(msg, m.TokenEvent):
            have = len(state.generated)
            if msg.index < have:
                return None  # a replayed token after a resume: the client has it
            if msg.index > have:
                return f"token {msg.index} of {state.request_id} arrived while the client holds {have}"
            handle._token(msg, env.tensor)
        elif isinstance(msg, m.Finished):
            if msg.reason != "cancelled" and msg.tokens > len(state.generated):
                have = len(state.generated)
                return f"{state.request_id} finished with {msg.tokens} tokens, the client holds {have}"
            # A fast resume folds generated tokens into the prompt the leader sees: never more than the
            # client's own prompt is reported as cached.
            state.cached_tokens = min(msg.cached_tokens, len(state.prompt))
            handle._finish(msg.reason)
            self.requests.pop(state.request_id, None)
        elif isinstance(msg, m.RequestFailed):
            handle._finish(error=msg.message)
            self.requests.pop(state.request_id, None)
        elif isinstance(msg, m.Admitted):
            state.admitted = True
        return None

    def _check_beat(self, beat: m.LeaderBeat, own: bool = False) -> str | None:
        """own: the beat on this front's reply key, listing its requests the leader holds (which requests
        it lost); else the beat to every front (figures). Either may say which Submits reached the leader."""
        seen = beat.seen.get(self.name, -1) if own else -1
        held = set(beat.requests)
        if not own:
            self.leader_held = len(held)
            if self.generation is not None:
                self.figures.take(beat, self.generation)
        received = beat.received.get(self.name, -1) if beat.received is not None else None
        now = time.monotonic()
        for h in self.requests.values():
            s = h.state
            if s.sent_generation != self.generation or s.sent_seq is None:
                continue
            if s.sent_seq <= seen and s.request_id not in held:
                return f"the leader no longer holds {s.request_id}, and its end never arrived"
            if received is not None and s.sent_seq > received and now - s.sent_at > SUBMIT_LOST_S:
                late = now - s.sent_at
                return (
                    f"the Submit of {s.request_id} has not reached the leader {late:.1f}s after it was sent"
                )
        return None
