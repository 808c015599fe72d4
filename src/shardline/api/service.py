"""What every API route shares: the target of a request (the model's instance, placed on request when it has
none), admission (429 past max_pending) and the start of an active request on this node's front.

The front (front/front.py) owns the request state, so a request streaming through this node survives the
loss of any other node: the instance is rebuilt and the front resubmits. The routes only translate. Beside
this module: the model's text (api/model_text.py), the active request (api/active.py) and what the API hears
from the cluster (api/events.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field

from shardline.api.active import ActiveRequest
from shardline.api.errors import ApiError
from shardline.api.events import Events
from shardline.api.metrics import Metrics
from shardline.api.model_text import ModelText, load_model_text
from shardline.api.text_stream import TextStream
from shardline.cluster import downloads
from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterClient, ClusterError
from shardline.cluster.placement import PlacementRequest
from shardline.compute.constraints import Objects
from shardline.compute.sampling import SamplingParams
from shardline.errors import ContextLengthError, EngineError, OverloadError
from shardline.front.figures import LeaderFigures
from shardline.front.front import Front
from shardline.front.request import RequestHandle
from shardline.models.footprint import ModelFootprint, footprint_from_dir

log = logging.getLogger("shardline.api")
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
    # Objects in a request's schema that do not say which other keys they take: closed (none) or open.
    structured_objects: Objects = "closed"


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
        self._placing: dict[str, asyncio.Task[cm.InstanceRecord]] = {}  # model -> its one placement
        self.events = Events(client, self.metrics, self.run_deferred, settings.max_pending)

    def close(self) -> None:
        self.events.close()

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

    def reference(self, model: str) -> tuple[str, str]:
        """(name, source) of what a request or a placement names (cluster/downloads.py `named`). Never a
        path: this node's files are not the client's to name."""
        return downloads.named(model)

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
        return {i: (f.waiting(), f.running(), f.leader_held) for i, f in self.client.fronts.all().items()}

    def figures(self) -> dict[str, LeaderFigures]:
        """Each instance's figures from its leader's beats (every node's traffic), by instance."""
        return self.events.figures()

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
        model, source = self.reference(model)
        rec = self.instance_for(model)
        if rec is None and source and self.settings.auto_place and model not in self.model_names():
            await self._download(model, source)  # raises: the model is on its way, or cannot come
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

    async def _download(self, model: str, source: str) -> None:
        """A request names a hub model no live node holds: one node starts downloading it for the cluster,
        and the request is answered at once (503, retry later) rather than held for the minutes it takes."""
        query = cm.Place(model=model, if_absent=True, source=source, via=self.node_id)
        try:
            reply = await asyncio.to_thread(self.client.ask, query)
        except ClusterError as exc:
            raise ApiError(503, f"model {source!r} cannot be placed: {exc}", "service_unavailable") from exc
        if reply.download is None and not reply.ok:
            raise ApiError(503, f"model {source!r} cannot be placed: {reply.error}", "service_unavailable")
        if reply.download is not None:
            raise ApiError(
                503, f"{reply.error}; retry when it is done", "service_unavailable", "model", retry_after_s=10
            )

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


def _cancel_submitted(done: asyncio.Future[RequestHandle]) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result().cancel_soon()


def _context(rec: cm.InstanceRecord, text: ModelText) -> int:
    """The context a request may fill: the model's, or the instance's where that is smaller."""
    return min(text.context_length, rec.context_length or text.context_length)


def _prompt_param(endpoint: str) -> str:
    if endpoint == "responses":
        return "input"
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
