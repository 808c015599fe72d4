"""What every API route shares: find (or place) the model's instance, turn text into a request on this node's
front, and turn the tokens that come back into text, timings and counts.

The front (front/front.py) owns the request state, so a request streaming through this node survives the
loss of any other node: the instance is rebuilt and the front resubmits. The routes only translate.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zenoh
from pydantic import BaseModel, Field

from shardline.api.errors import ApiError
from shardline.api.live import SAMPLE_S, Histories
from shardline.api.metrics import Metrics
from shardline.api.steps import StepCounts
from shardline.api.text import TextStream
from shardline.api.tools.prompt import Tool, function_spec, generic_messages, template_takes_tools
from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterClient, ClusterError
from shardline.cluster.placement import PlacementRequest
from shardline.compute.sampling import SamplingParams
from shardline.dataplane import messages as m
from shardline.dataplane.frame import decode
from shardline.errors import ContextLengthError, EngineError, OverloadError, RequestError
from shardline.front.figures import LeaderFigures
from shardline.front.front import Front
from shardline.front.request import RequestDeadlineError, RequestHandle, Token
from shardline.models.footprint import ModelFootprint, footprint_from_dir

log = logging.getLogger("shardline.api")
REMOVED_AFTER_S = 2.0  # an instance missing from views this long is gone (a new master's first view may lag)
# After a placement, how long to wait for the master's view to list the new instance: a few view periods,
# and a little more per stage (a bigger placement is a bigger view to fold and publish).
PLACED_VIEW_S = 5.0
PLACED_VIEW_PER_STAGE_S = 1.0


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: no HTTP API on this node
    api_key: str | None = None
    cors_origins: list[str] = []
    # Host names requests may be addressed to besides loopback ones; a node without a key on loopback checks
    # the Host header (see api.hosts), and any node given names here does.
    allowed_hosts: list[str] = []
    auto_place: bool = True  # a request for a model with no instance places one when it fits
    max_pending: int = Field(64, ge=1)  # requests in flight through this node; one more gets 429


# ---- the text side of a model ------------------------------------------------------------------------------


@dataclass
class ModelText:
    name: str
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    context_length: int
    vocab_size: int
    family: str = ""

    @property
    def eos(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict[str, Any]], tools: tuple[Tool, ...] = ()) -> list[int]:
        """The prompt of a conversation (with tool calls and results, see api/tools/prompt.py)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template and template_takes_tools(template):  # the model's own tool format
            specs = [function_spec(t) for t in tools] or None
            text = self.tokenizer.apply_chat_template(
                messages, tools=specs, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        messages = generic_messages(messages, tools)
        if template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        # No template: a plain transcript that ends where the assistant speaks.
        text = "".join(f"{msg['role']}: {msg['content']}\n" for msg in messages) + "assistant:"
        return self.tokenizer.encode(text)

    def text(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)


def load_model_text(model_dir: Path) -> ModelText:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    tokenizer = load_tokenizer(model_dir)
    return ModelText(
        name=model_dir.name,
        tokenizer=tokenizer,
        context_length=int(config.get("max_position_embeddings") or 2048),
        vocab_size=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        family=str(config.get("model_type", "")),
    )


# ---- one request in flight ---------------------------------------------------------------------------------


@dataclass
class Chunk:
    text: str
    tokens: list[Token]


@dataclass
class Timings:
    ttft_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    total_s: float = 0.0

    def as_dict(self) -> dict[str, float | None]:
        return {k: (round(v, 6) if v is not None else None) for k, v in self.__dict__.items()}


@dataclass
class Outcome:
    finish_reason: str  # "stop" (end token or stop string) or "length"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    text: str
    timings: Timings
    cached_tokens: int = 0  # of prompt_tokens, those the leader's prefix cache held (its Finished)


@dataclass
class ActiveRequest:
    """One request through this node's front, as text. Iterate `chunks()`; then `outcome` is set."""

    id: str
    model: str
    instance: str
    handle: RequestHandle
    stream: TextStream
    text: ModelText  # the model's tokenizer: routes format logprobs with it, with no await in between
    prompt_tokens: int
    started: float
    metrics: Metrics
    release: Callable[[], None]
    endpoint: str
    # Runs a callable later, off whatever thread a finaliser interrupted (which may hold any lock).
    defer: Callable[[Callable[[], None]], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    outcome: Outcome | None = None
    _first: float | None = None
    _last: float | None = None
    _fed: int = 0  # tokens taken from the front (the text stream stops counting at a stop string)
    _closed: bool = False
    used: list[Token] = field(default_factory=list)  # tokens whose text was sent (with their logprobs)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Text as it becomes safe to send; ends at the end token, max_tokens or a stop string.

        Leaving the iteration early (the client went away) cancels the request in the pipeline."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self.handle.watch(lambda: loop.call_soon_threadsafe(wake.set))
        outcome = "cancelled"
        try:
            while True:
                wake.clear()
                try:
                    tokens, ended = self.handle.drain()
                except RequestDeadlineError as exc:
                    outcome = "error"
                    raise ApiError(
                        503, f"the request timed out: {exc}", "timeout_error", code="timeout"
                    ) from exc
                except RequestError as exc:
                    outcome = "error"
                    raise ApiError(503, f"the request failed: {exc}", "server_error") from exc
                if tokens:
                    counted = self.stream.tokens
                    text = "".join(self._feed(t) for t in tokens)
                    used = tokens[: self.stream.tokens - counted]  # those before a stop string
                    self.used += used
                    if self.stream.stopped is not None:
                        self.handle.cancel_soon()  # the rest is not wanted: free the pipeline now
                        self._finish("stop")
                        yield Chunk(text + self.stream.flush(), used)
                        return
                    if text or used:
                        yield Chunk(text, used)
                if ended:
                    reason = "stop" if self.handle.finish_reason == "stop" else "length"
                    tail = self.stream.flush()
                    self._finish(reason)
                    if tail:
                        yield Chunk(tail, [])
                    return
                if not tokens:
                    await wake.wait()
        finally:
            self.close(outcome)

    def __del__(self) -> None:
        # A backstop: a run dropped on a path that never reached its response (an exception or a
        # cancellation between start and respond) still frees its slot and its place in the pipeline. A
        # finaliser may run inside any code holding any lock (the slot count's, the front's, a metric's):
        # it only hands the close to the service, which runs it later.
        if self._closed:
            return
        try:
            if self.defer is not None:
                self.defer(self.close)
            else:
                self.close()
        except Exception:
            pass

    def close(self, outcome: str = "cancelled") -> None:
        """End the request if it has not ended (cancelling it in the pipeline); free its slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.outcome is None:
            self.handle.cancel_soon()  # sent from the front's thread: no blocking put on the event loop
            self.metrics.requests.labels(self.endpoint, outcome).inc()
        self.release()

    def _feed(self, token: Token) -> str:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self.metrics.ttft.labels(self.model).observe(now - self.started)
        elif self._last is not None:
            self.metrics.itl.labels(self.model).observe(now - self._last)
        self._last = now
        self._fed += 1
        return self.stream.feed(token.token)

    def _finish(self, reason: str) -> None:
        now = time.monotonic()
        t = Timings(total_s=now - self.started)
        if self._first is not None:
            t.ttft_s = self._first - self.started
            t.prefill_tokens_per_s = self.prompt_tokens / max(t.ttft_s, 1e-9)
            n = self.stream.tokens
            if n > 1 and self._last is not None and self._last > self._first:
                t.decode_tokens_per_s = (n - 1) / (self._last - self._first)
        self.outcome = Outcome(
            finish_reason=reason,
            stop_sequence=self.stream.stopped,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.stream.tokens,
            text=self.stream.text,
            timings=t,
            cached_tokens=self.handle.state.cached_tokens,
        )
        self.metrics.tokens_out.labels(self.model).inc(self.stream.tokens)
        self.metrics.requests.labels(self.endpoint, "ok").inc()

    async def complete(self) -> Outcome:
        async for _ in self.chunks():
            pass
        assert self.outcome is not None
        return self.outcome


# ---- the service -------------------------------------------------------------------------------------------


class Service:
    def __init__(
        self, client: ClusterClient, models_root: Path, settings: ApiSettings, node_id: str = ""
    ) -> None:
        self.client = client
        self.models_root = models_root
        self.settings = settings
        self.node_id = node_id
        self.metrics = Metrics(self.gauges, lambda: self.pending, self.figures)
        self._texts: dict[str, ModelText] = {}
        self._texts_lock = threading.Lock()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._deferred: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # closes from finalisers
        self._finished: deque[float] = deque(maxlen=256)  # when recent requests ended: the drain rate
        self._ids = itertools.count()
        # Cluster events and views, fanned out to /events listeners (asyncio queues on the server's loop).
        self._events_seen: set[tuple[float, str, str, str]] = set()
        self.recent_events: deque[cm.ClusterEvent] = deque(maxlen=500)
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[tuple[str, Any]]]] = set()
        self._listeners_lock = threading.Lock()
        self._views: deque[cm.ClusterView] = deque(maxlen=1)
        self._view_ready = threading.Event()
        self._closed = threading.Event()
        self._steps = StepCounts()
        self._placing: dict[str, asyncio.Task[cm.InstanceRecord]] = {}  # model -> its one placement
        self.histories = Histories()
        self._missing: dict[str, float] = {}  # instance -> since when views no longer list it
        self._status_sub = client.session.declare_subscriber(
            f"{client.namespace}/i/*/*/status/*", self._on_status
        )
        client.listen(self._on_view)
        self._thread = threading.Thread(target=self._follow, daemon=True, name="api-views")
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._view_ready.set()
        self._thread.join(timeout=5)
        try:
            self._status_sub.undeclare()
        except zenoh.ZError:
            pass

    # ---- the cluster, as the API sees it -------------------------------------------------------------------

    def view(self) -> cm.ClusterView | None:
        return self.client.view

    def model_names(self) -> list[str]:
        """Models a request may name: those with an instance, and those some node holds whole."""
        view = self.client.view
        if view is None:
            return []
        names = {r.model for r in view.instances if r.phase != "failed"}
        if self.settings.auto_place:
            names |= {name for n in view.nodes if n.alive for name in n.models}
        return sorted(names)

    def instance_for(self, model: str) -> cm.InstanceRecord | None:
        """The instance serving `model` (a model name or an instance id), ready ones first."""
        view = self.client.view
        if view is None:
            return None
        live = [r for r in view.instances if model in (r.model, r.instance) and r.phase != "failed"]
        live.sort(key=lambda r: (r.phase != "ready", r.created_at))
        return live[0] if live else None

    def footprint(self, model: str) -> ModelFootprint | None:
        """What the model needs, read from this node's copy (None without a whole copy here)."""
        try:
            return footprint_from_dir(self.models_root / model, model)
        except Exception:
            return None

    def gauges(self) -> dict[str, tuple[int, int, int]]:
        return {i: (f.waiting(), f.running(), f.leader_held) for i, f in self.client.fronts().items()}

    def figures(self) -> dict[str, LeaderFigures]:
        """Each instance's figures from its leader's beats (every node's traffic), by instance."""
        return {i: f.figures for i, f in self.client.fronts().items()}

    async def text_of(self, model: str) -> ModelText:
        with self._texts_lock:
            text = self._texts.get(model)
        if text is not None:
            return text
        model_dir = self.models_root / model
        if not (model_dir / "config.json").is_file():
            raise ApiError(
                503,
                f"this node holds no copy of model {model!r} (its tokenizer): send the request to a node "
                "that holds the model or one of its stages",
                "service_unavailable",
                "model",
            )
        text = await asyncio.to_thread(load_model_text, model_dir)
        with self._texts_lock:
            return self._texts.setdefault(model, text)

    async def target(self, model: str) -> tuple[cm.InstanceRecord, Front, ModelText]:
        if not model:
            raise ApiError(400, "model is required", param="model")
        rec = self.instance_for(model)
        if rec is None:
            if model not in self.model_names():
                known = ", ".join(self.model_names()) or "none"
                raise ApiError(
                    404,
                    f"model {model!r} does not exist (available: {known})",
                    "not_found_error",
                    "model",
                    "model_not_found",
                )
            if not self.settings.auto_place:
                raise ApiError(
                    503,
                    f"model {model!r} has no instance, and this node does not place models on request",
                    "service_unavailable",
                    "model",
                )
            rec = await self._place(model)
        text = await self.text_of(rec.model)
        try:
            front = self.client.front(rec.instance, max_queue=self.settings.max_pending)
        except (ClusterError, EngineError) as exc:  # removed meanwhile, or this node is shutting down
            raise ApiError(
                503, f"model {model!r} cannot be served now: {exc}", "service_unavailable"
            ) from exc
        return rec, front, text

    async def _place(self, model: str) -> cm.InstanceRecord:
        """Place `model` once however many requests ask at once: the first starts the placement, the others
        await the same one (shielded: the first request going away does not cancel it for the others)."""
        task = self._placing.get(model)
        if task is None:
            task = asyncio.ensure_future(self._place_once(model))
            self._placing[model] = task

            def done(t: asyncio.Task[cm.InstanceRecord]) -> None:
                if self._placing.get(model) is t:
                    del self._placing[model]  # the next request finds the instance in the view, or retries
                if not t.cancelled():
                    t.exception()  # seen here, so no waiter left means no "never retrieved" warning

            task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _place_once(self, model: str) -> cm.InstanceRecord:
        rec = self.instance_for(model)  # placed meanwhile (by another node's request, or by hand)
        if rec is not None:
            return rec
        # if_absent: a request through another node may be placing the same model; the master answers
        # both with one instance.
        query = cm.Place(model=model, request=PlacementRequest(), if_absent=True)
        try:
            reply = await asyncio.to_thread(self.client.ask, query)
        except ClusterError as exc:
            raise ApiError(503, f"model {model!r} cannot be placed: {exc}", "service_unavailable") from exc
        if not reply.ok or reply.instance is None:
            raise ApiError(
                503,
                f"model {model!r} cannot be placed: {reply.error or 'no instance'}",
                "service_unavailable",
            )
        placed = reply.instance
        # The reply comes before the master's next view lists the instance, and a front needs the view's
        # record: wait for it, with a deadline, so the request is routed, never answered with a 500.
        wait_s = PLACED_VIEW_S + PLACED_VIEW_PER_STAGE_S * len(placed.stages)

        def listed(view: cm.ClusterView) -> bool:
            return any(r.instance == placed.instance for r in view.instances)

        try:
            await asyncio.to_thread(
                self.client.wait, listed, wait_s, f"instance {placed.instance} in the view"
            )
        except ClusterError as exc:
            raise ApiError(
                503,
                f"model {model!r} was placed as {placed.instance}, but the cluster's view did not list it "
                f"within {wait_s:.0f}s; retry",
                "service_unavailable",
            ) from exc
        return self.client.instance(placed.instance) or placed

    # ---- requests ------------------------------------------------------------------------------------------

    def defer(self, close: Callable[[], None]) -> None:
        """Run `close` later, from a thread that holds no lock (see ActiveRequest.__del__)."""
        self._deferred.put(close)

    def run_deferred(self) -> None:
        while True:
            try:
                close = self._deferred.get_nowait()
            except queue.Empty:
                return
            try:
                close()
            except Exception:
                log.exception("api: a deferred close failed")

    def _admit(self) -> None:
        self.run_deferred()
        with self._pending_lock:
            if self._pending >= self.settings.max_pending:
                raise ApiError(
                    429,
                    f"{self._pending} requests are in flight through this node (limit "
                    f"{self.settings.max_pending}); retry later",
                    "rate_limit_error",
                    code="rate_limit_exceeded",
                    retry_after_s=self._retry_after(),
                )
            self._pending += 1

    @property
    def pending(self) -> int:
        """Requests admitted through this node and not yet ended (the count max_pending limits)."""
        self.run_deferred()
        with self._pending_lock:
            return self._pending

    def _release(self) -> None:
        with self._pending_lock:
            self._pending -= 1
            self._finished.append(time.monotonic())

    def _retry_after(self) -> float:
        """About when one slot frees: the recent rate at which requests ended, else a second."""
        ends = list(self._finished)
        if len(ends) < 2 or ends[-1] <= ends[0]:
            return 1.0
        rate = (len(ends) - 1) / (ends[-1] - ends[0])
        return min(60.0, max(1.0, math.ceil(1.0 / rate)))

    async def start(
        self,
        endpoint: str,
        model: str,
        prompt: Callable[[ModelText], list[int]],
        max_tokens: int | None,
        sampling: SamplingParams,
        stop: list[str],
        ignore_eos: bool = False,
    ) -> ActiveRequest:
        """Submit a request; errors before any token (bad input, overload, no model) raise ApiError."""
        started = time.monotonic()
        try:
            rec, front, text = await self.target(model)
            # Chat templates and tokenisation take long on long prompts, and building the stop strings'
            # automaton takes milliseconds for the longest allowed: off the event loop, so other requests
            # (and their streams) do not wait behind them.
            ids, stream = await asyncio.to_thread(lambda: (prompt(text), TextStream(text.decode, stop)))
            if not ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            limit = _limit(ids, max_tokens, _context(rec, text), _prompt_param(endpoint))
            sampling = _with_end(sampling, text.eos, ignore_eos)
            self._admit()
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, _outcome(exc.status)).inc()
            raise
        try:
            eos = [] if ignore_eos else text.eos
            # Off the event loop: a submit puts on zenoh with congestion control BLOCK.
            submitted = asyncio.ensure_future(
                asyncio.to_thread(front.submit, ids, max_tokens=limit, sampling=sampling, stop_tokens=eos)
            )
            try:
                handle = await asyncio.shield(submitted)
            except asyncio.CancelledError:
                submitted.add_done_callback(_cancel_submitted)  # the client left: what it started ends too
                raise
        except BaseException as exc:
            self._release()
            err = _submit_error(exc)
            self.metrics.requests.labels(endpoint, _outcome(err.status)).inc()
            raise err from exc
        self.metrics.tokens_in.labels(rec.model).inc(len(ids))
        return ActiveRequest(
            id=uuid.uuid4().hex[:24],
            model=rec.model,
            instance=rec.instance,
            handle=handle,
            stream=stream,
            text=text,
            prompt_tokens=len(ids),
            started=started,
            metrics=self.metrics,
            release=self._release,
            endpoint=endpoint,
            defer=self.defer,
        )

    # ---- events --------------------------------------------------------------------------------------------

    def _on_view(self, view: cm.ClusterView) -> None:
        self._views.append(view)
        self._view_ready.set()

    def _follow(self) -> None:
        """Off zenoh's thread: fronts for every instance (live figures everywhere), events to listeners."""
        sampled = time.monotonic()
        while not self._closed.is_set():
            self._view_ready.wait(timeout=max(0.0, sampled + SAMPLE_S - time.monotonic()))
            self._view_ready.clear()
            self.run_deferred()
            if time.monotonic() - sampled >= SAMPLE_S:
                sampled = time.monotonic()
                self.histories.sample_all(self.figures(), sampled)
                self._broadcast("view", None)  # the sparklines move even when the cluster does not
            try:
                view = self._views.pop()
            except IndexError:
                continue
            try:
                self._take(view)
            except Exception:
                log.exception("api: following the view failed")

    def _take(self, view: cm.ClusterView) -> None:
        listed = {r.instance for r in view.instances}
        now = time.monotonic()
        for instance in self.client.fronts():
            if instance in listed:
                self._missing.pop(instance, None)
            elif now - self._missing.setdefault(instance, now) > REMOVED_AFTER_S:
                self._missing.pop(instance, None)
                self.client.drop_front(instance, f"instance {instance} was removed")
                self._steps.forget(instance)
                self.metrics.forget_instance(instance)
        for rec in view.instances:
            if rec.phase != "failed" and rec.instance not in self.client.fronts():
                try:
                    self.client.front(rec.instance, max_queue=self.settings.max_pending)
                except (ClusterError, EngineError):
                    pass
        new = []
        for e in view.events:
            key = (e.at, e.kind, e.node, e.instance)
            if key not in self._events_seen:
                self._events_seen.add(key)
                new.append(e)
                self.recent_events.append(e)
                self.metrics.cluster_events.labels(e.kind).inc()
        if len(self._events_seen) > 5000:  # keep the dedup set bounded: views carry only the newest few
            self._events_seen = {(e.at, e.kind, e.node, e.instance) for e in view.events}
        for e in new:
            self._broadcast("cluster", e.model_dump(mode="json"))
        self._broadcast("view", None)

    def _broadcast(self, kind: str, data: Any) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for loop, q in listeners:
            try:
                loop.call_soon_threadsafe(_offer, q, (kind, data))
            except RuntimeError:  # its loop closed
                pass

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=256)
        with self._listeners_lock:
            self._listeners.add((asyncio.get_running_loop(), q))
        return q

    def unsubscribe(self, q: asyncio.Queue[tuple[str, Any]]) -> None:
        with self._listeners_lock:
            self._listeners = {(lp, x) for lp, x in self._listeners if x is not q}

    def _on_status(self, sample: zenoh.Sample) -> None:
        try:
            msg, _ = decode(bytes(sample.payload.to_bytes()), m.STATUS)
        except Exception:
            return
        if not isinstance(msg, m.Heartbeat) or msg.last_step is None:
            return
        parts = str(sample.key_expr).split("/")  # {ns}/i/{instance}/g{gen}/status/{stage}
        if self._steps.advance(parts[2], msg.stage, msg.steps):
            self.metrics.observe_step(parts[2], msg.stage, msg.last_step.seconds)


def _offer(q: asyncio.Queue[tuple[str, Any]], item: tuple[str, Any]) -> None:
    if q.full():  # a slow listener misses events rather than holding memory; it can re-read /state
        try:
            q.get_nowait()
        except asyncio.QueueEmpty:
            pass
    q.put_nowait(item)


def _cancel_submitted(done: asyncio.Future[RequestHandle]) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result().cancel_soon()


def _context(rec: cm.InstanceRecord, text: ModelText) -> int:
    """The context a request may fill: the model's, or the instance's where that is smaller."""
    return min(text.context_length, rec.context_length or text.context_length)


def _prompt_param(endpoint: str) -> str:
    return "prompt" if endpoint in ("completions", "ollama_generate") else "messages"


def _limit(ids: list[int], max_tokens: int | None, context: int, prompt_param: str) -> int:
    """max_tokens as asked, checked against the context; not asked: what is left of the context."""
    if len(ids) >= context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; the model's context is {context} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    left = context - len(ids)
    if max_tokens is None:
        return left
    if max_tokens > left:
        # Refused, not clamped: a client asking for more than fits would otherwise get a silent "length".
        raise ApiError(
            400,
            f"max_tokens is {max_tokens}, but the prompt's {len(ids)} tokens leave {left} of the model's "
            f"{context}-token context; ask for at most {left}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _with_end(sampling: SamplingParams, eos: list[int], ignore_eos: bool) -> SamplingParams:
    """A constraint ends the output with the model's end tokens, allowed once its grammar accepts."""
    c = sampling.constraint
    if c is None:
        return sampling
    if ignore_eos or not eos:
        raise ApiError(400, "a constrained output must be able to end: drop ignore_eos", param="ignore_eos")
    return sampling.model_copy(update={"constraint": c.model_copy(update={"end": tuple(eos)})})


def _outcome(status: int) -> str:
    return {400: "invalid", 401: "unauthorized", 404: "not_found", 429: "rejected"}.get(status, "error")


def _submit_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, OverloadError):
        return ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded", retry_after_s=1.0)
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    if isinstance(exc, EngineError):
        return ApiError(503, str(exc), "service_unavailable")
    raise exc
