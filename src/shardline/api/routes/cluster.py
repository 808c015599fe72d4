"""Cluster routes: /health, /state, placing and removing instances, and /events (a live SSE feed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from shardline.api.errors import ApiError, error_responses
from shardline.api.live import LivePoint, hit_rate, recent_ttft
from shardline.api.middleware.api_key import carries_key
from shardline.api.middleware.hosts import is_loopback
from shardline.api.service import Service
from shardline.api.streaming import STREAMED_SSE, sse
from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterError
from shardline.cluster.placement import Placement, PlacementRequest

STATE_PERIOD_S = 1.0  # at most one state snapshot per second on /events
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle feed


class Health(BaseModel):
    ok: bool
    # The rest is the cluster as this node sees it: only for a caller with the API key, or, on a node without
    # one, a caller on this machine. A probe needs only the status.
    node: str | None = None
    master: str | None = None
    term: int | None = None
    pending: int | None = None  # HTTP requests this node admitted and has not ended (max_pending: 429)


class Live(BaseModel):
    running: int  # this node's requests the instance is running
    queued: int  # this node's requests waiting for it
    leader_requests: int  # what the leader holds, from every node
    # The instance as a whole (every node's requests), from the leader's beats:
    instance_running: int = 0
    instance_queued: int = 0
    tokens_per_s: float = 0.0  # over the last sample period
    ttft_s: float | None = None  # median time to first token over the last minute
    # The prefix cache, over all its leaders as this node heard them: prompt tokens looked up and found,
    # their ratio (None before any lookup), and the blocks cached now with the tokens each holds.
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_hit_rate: float | None = None
    prefix_blocks: int = 0
    prefix_block_tokens: int = 0
    prefix_off: str = ""  # why the model keeps no prefix cache ("" when it may)
    history: list[LivePoint] = []  # a point every few seconds, oldest first


class InstanceState(cm.InstanceRecord):
    live: Live | None = None


class NodeState(cm.NodeSummary):
    master: bool = False


class State(BaseModel):
    node: str  # the node answering
    term: int
    master: str | None
    seq: int
    nodes: list[NodeState]
    instances: list[InstanceState]
    events: list[cm.ClusterEvent]
    at: float


class PlaceBody(BaseModel):
    model: str = Field(min_length=1, max_length=256)
    sequences: int = Field(4, ge=1, le=4096)
    reserve_tokens: int | None = Field(None, ge=1, le=1 << 24)
    max_stages: int | None = Field(None, ge=1, le=1024)


class Preview(BaseModel):
    model: str
    fits: bool
    placement: Placement | None = None
    reason: str = ""
    layout: str = ""  # pipeline stages or tensor-parallel groups, and why (with every candidate's figures)


class Removed(BaseModel):
    removed: str


def state_of(service: Service) -> State:
    view = service.view()
    fronts = service.client.fronts.all()
    instances = []
    for rec in view.instances if view else []:
        f = fronts.get(rec.instance)
        live = None
        if f is not None:
            history = service.events.histories.points(rec.instance)
            live = Live(
                running=f.running(),
                queued=f.waiting(),
                leader_requests=f.leader_held,
                instance_running=f.figures.running,
                instance_queued=f.figures.waiting,
                tokens_per_s=history[-1].tokens_per_s if history else 0.0,
                ttft_s=recent_ttft(f.figures, time.monotonic()),
                prefix_queries=f.figures.prefix_queries,
                prefix_hits=f.figures.prefix_hits,
                prefix_hit_rate=hit_rate(f.figures.prefix_queries, f.figures.prefix_hits),
                prefix_blocks=f.figures.prefix_blocks,
                prefix_block_tokens=f.figures.prefix_block_tokens,
                prefix_off=f.figures.prefix_off,
                history=history,
            )
        instances.append(InstanceState(**rec.model_dump(), live=live))
    nodes = [NodeState(**n.model_dump(), master=view.master == n.node_id) for n in view.nodes] if view else []
    return State(
        node=service.node_id,
        term=view.term if view else 0,
        master=view.master if view else None,
        seq=view.seq if view else 0,
        nodes=nodes,
        instances=instances,
        events=list(service.events.recent_events)[-100:],
        at=time.time(),
    )


def router(service: Service) -> APIRouter:
    r = APIRouter(tags=["Cluster"])
    auth = error_responses("openai", 401)

    @r.get("/health", response_model=Health, response_model_exclude_unset=True)
    async def health(request: Request) -> Health:
        """Liveness: `{"ok": true}`; with the API key (or from this machine, on a node without one) also the
        node's id, the master and term it follows and its pending requests."""
        if not may_see_cluster(service, request):
            return Health(ok=True)
        view = service.view()
        return Health(
            ok=True,
            node=service.node_id,
            master=view.master if view else None,
            term=view.term if view else 0,
            pending=service.pending,
        )

    @r.get("/state", response_model=State, responses=auth)
    async def state() -> State:
        return state_of(service)

    @r.get(
        "/instances/preview", response_model=Preview, responses=error_responses("openai", 400, 401, 404, 503)
    )
    async def preview(
        model: str = Query(min_length=1, max_length=256),
        sequences: int = Query(4, ge=1, le=4096),
        reserve_tokens: int | None = Query(None, ge=1, le=1 << 24),
    ) -> Preview:
        _known(service, model)
        req = PlacementRequest(sequences=sequences, reserve_tokens=reserve_tokens)
        try:
            reply = await asyncio.to_thread(service.client.place, model, req, True)
        except ClusterError as exc:
            return Preview(model=model, fits=False, reason=str(exc))
        return Preview(model=model, fits=True, placement=reply.placement, layout=reply.layout)

    @r.post(
        "/instances",
        response_model=InstanceState,
        status_code=201,
        responses=error_responses("openai", 400, 401, 404, 409, 503),
    )
    async def place(body: PlaceBody) -> InstanceState:
        """Place a model: a name the cluster lists, or a hub repository no node holds yet, which one node
        downloads for everyone first (this answers once it is placed; /state shows the download meanwhile)."""
        name, source = service.reference(body.model)
        if not source:
            _known(service, name)
        req = PlacementRequest(
            sequences=body.sequences, reserve_tokens=body.reserve_tokens, max_stages=body.max_stages
        )
        try:
            reply = await asyncio.to_thread(
                lambda: service.client.place(name, req, source=source, via=service.node_id)
            )
        except ClusterError as exc:
            raise ApiError(409, f"model {body.model!r} cannot be placed: {exc}", "placement_error") from exc
        assert reply.instance is not None
        return InstanceState(**reply.instance.model_dump())

    @r.delete(
        "/instances/{instance}", response_model=Removed, responses=error_responses("openai", 401, 404, 503)
    )
    async def remove(instance: str) -> Removed:
        if service.client.instance(instance) is None:
            raise ApiError(404, f"no instance {instance!r}", "not_found_error", "instance")
        try:
            await asyncio.to_thread(service.client.remove, instance)
        except ClusterError as exc:
            raise ApiError(503, str(exc), "service_unavailable") from exc
        return Removed(removed=instance)

    @r.get(
        "/events",
        responses={200: STREAMED_SSE, **auth},
        response_class=StreamingResponse,
    )
    async def events() -> StreamingResponse:
        """Server-sent events: `state` (the whole /state, on connect and at most once a second after a
        change) and `cluster` (each join, leave, placement, failure and recovery, as it happens)."""
        return StreamingResponse(
            _feed(service), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    return r


def may_see_cluster(service: Service, request: Request) -> bool:
    key = service.settings.api_key
    if key:
        return carries_key(request, key)
    return request.client is not None and is_loopback(request.client.host)


def _known(service: Service, model: str) -> None:
    if model not in service.model_names():
        known = ", ".join(service.model_names()) or "none"
        raise ApiError(
            404, f"model {model!r} is on no live node (known: {known})", "not_found_error", "model"
        )


async def _feed(service: Service) -> AsyncIterator[bytes]:
    q = service.events.subscribe()
    try:
        yield sse(state_of(service).model_dump(mode="json"), "state")
        last_state = time.monotonic()
        dirty = False
        while True:
            wait = KEEPALIVE_S if not dirty else max(0.0, STATE_PERIOD_S - (time.monotonic() - last_state))
            try:
                kind, data = await asyncio.wait_for(q.get(), timeout=wait)
            except TimeoutError:
                kind, data = ("tick", None)
            if kind == "cluster":
                yield sse(data, "cluster")
            elif kind == "view":
                dirty = True
            if dirty and time.monotonic() - last_state >= STATE_PERIOD_S:
                yield sse(state_of(service).model_dump(mode="json"), "state")
                last_state, dirty = time.monotonic(), False
            elif kind == "tick" and not dirty:
                yield b": keep-alive\n\n"
    finally:
        service.events.unsubscribe(q)
