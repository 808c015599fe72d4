"""Stage 0: owns the schedule and admission. Every other stage executes what it sends, in order.

Over 500 lines: one state machine on one thread; admission, KV reservations, the steps it plans and the
results it takes read and write the same per-request state, which split apart would be handed back and forth
(its pure parts are apart already: schedule.py, prefix.py, batch_rates.py, row_costs.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from shardline.compute.constraints import compile_grace_s
from shardline.compute.kv import round_up
from shardline.compute.sampling import SamplingParams
from shardline.dataplane import messages as m
from shardline.dataplane.frame import tensor_meta
from shardline.dataplane.transport import DeadlineExceeded, Envelope, Inbox, Outbox
from shardline.instance.deadline import DeadlinePolicy, Speed
from shardline.instance.spec import RunnerSpec
from shardline.runner import schedule
from shardline.runner.batch_rates import BatchRates
from shardline.runner.faults import Faults
from shardline.runner.prefix import PrefixLedger
from shardline.runner.row_costs import RowCosts
from shardline.runner.signals import RejoinRequested, StopRunner
from shardline.runner.stage import WARMUP_ID, Compute, ProtocolError, Stage

TOKEN_FIELDS = {"token", "logprob", "top_logprobs"}
log = logging.getLogger("shardline.leader")
# A front's name is a key chunk of its reply key: anything else cannot be answered, and is not served.
FRONT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
REPLY_OUTBOXES = 256  # fronts answered at once; the least recently used beyond it are closed


@dataclass
class InFlight:
    request_id: str  # BATCH_ID for a batched step
    n: int
    context: int
    rows: tuple[str, ...] = ()  # a batched step's requests, in row order
    reserve: int = 0  # KV positions the step allocates (a prompt's first chunk)
    sent_at: float = 0.0
    alone: bool = False  # nothing else was in flight: its time around the ring has no queueing in it
    step: m.Step | None = None  # as sent: with a split head, the leader samples it
    # Seconds allowed on top of the estimate: the sampling stage compiles a constrained request's grammar
    # within its first sampling step (announced there as grace too), work no step timing has measured.
    grace: float = 0.0


class Leader:
    """The instance's one decision-maker, on stage 0's face: it admits requests, plans each step, sends it
    through its own stage and down the ring, and turns the results that come back into each front's events.

    It is handed what it uses, not the runner process (runner/process.py): its inbox (control and ring
    results), its stage (the stage itself, or on a tensor-parallel face its mirror), `compute` (one step
    through the stage, timed and watched), the outbox to stage 1 (None on a ring of one stage), the events
    outbox every front hears, and `open_reply` for a front's own events key (None: all go on `events`).
    `received` is the process's count of what reached it from each front, updated as messages arrive.
    """

    def __init__(
        self,
        spec: RunnerSpec,
        stage: Stage,
        compute: Compute,
        inbox: Inbox,
        downstream: Outbox | None,
        events: Outbox,
        *,
        policy: DeadlinePolicy,
        faults: Faults,
        received: Mapping[str, int],
        attn_keys: int = 0,
        open_reply: Callable[[str], Outbox] | None = None,
    ) -> None:
        self.spec = spec
        self.stage = stage
        self.compute = compute
        self.inbox = inbox
        self.downstream = downstream
        self.events = events
        self.policy = policy
        self.faults = faults
        self.received = received
        self.open_reply = open_reply
        self.requests: dict[str, schedule.LeaderRequest] = {}  # admitted
        self.waiting: deque[m.RequestSpec] = deque()  # KV does not fit yet: strict FIFO
        # KV is reserved as it is used: each running request's reservation covers this many positions, and
        # grows a block at a time; when the budget is out, the newest request goes back to the queue.
        self.covered: dict[str, int] = {}
        self.compiled: set[str] = set()  # requests whose grammar was compiled since their prime
        self.preempted: dict[str, m.RequestSpec] = {}  # going back to the queue once nothing is in flight
        self.starved = False  # a running request waits for a block: nothing new is admitted meanwhile
        self.front_of: dict[str, str] = {}  # request -> the front that sent it (its events go there)
        self.replies: OrderedDict[str, Outbox] = OrderedDict()
        self.replies_lock = threading.Lock()  # the leader's thread adds outboxes, the heartbeat's reads them
        self.in_flight: OrderedDict[int, InFlight] = OrderedDict()  # step seq -> step, oldest first
        self.seen: dict[str, int] = {}  # front -> last control seq
        # Every request held (waiting or admitted), in one dict the beat copies in one step: a request moves
        # from `waiting` to `requests` without ever leaving this, so no beat can catch it in neither.
        self.held: dict[str, None] = {}
        self.early: list[Envelope] = []  # control messages that arrived during warm-up
        self.stage_speed = [Speed(attn_keys=attn_keys) for _ in range(self.spec.stages)]
        self.row_costs = RowCosts.for_stages(self.spec.stages)
        self.batch_rates = BatchRates()
        own_layers = self.spec.layer_end - self.spec.layer_start
        # Its own share of its heads' KV, for the whole model: every stage's tensor groups split the heads
        # alike; an expert group's members each hold the attention, and its KV, whole (unless split by heads).
        split = 1 if self.spec.expert_owners and not self.spec.expert_heads else self.spec.group
        per_layer = self.stage.kv_bytes_per_token * split // own_layers
        self.kv_bytes_per_token = per_layer * self.spec.layer_total
        # KV reservations and the prefix cache, in blocks of one prefill chunk (the stages' KV blocks).
        block = self.spec.prefill_step
        # Every stage of a model tells the same: the reason comes from the model's cache kinds.
        self.prefix_off = self.stage.shard.prefix_reason if self.spec.prefix_cache else ""
        self.ledger = PrefixLedger(
            block,
            block * self.kv_bytes_per_token,
            self.spec.kv_budget_bytes,
            self.spec.prefix_cache and not self.prefix_off,
        )
        self.seq = 0
        self.tick = 0
        self.arrivals = 0
        self.last_progress = 0.0  # when a result last arrived, or the ring went from idle to busy
        # Live figures for the beat: tokens sampled, and how long new requests waited for their first one.
        self.sampled = 0
        self.submitted_at: dict[str, float] = {}
        self.ttfts: deque[float] = deque(maxlen=256)

    # ---- warm-up and deadlines ------------------------------------------------------------------------

    def warm_ring(self) -> None:
        """One decode-sized and one chunk-sized step around the whole ring before Ready."""
        deadline = time.monotonic() + self.spec.load_timeout
        chunk = min(self.spec.prefill_step, 512)
        sizes = sorted({1, chunk})
        total = max(sizes)
        prompt = [0] * total
        for pos, n in ((0, sizes[0]), *(((sizes[0], total - sizes[0]),) if len(sizes) > 1 else ())):
            self.seq += 1
            step = m.Step(
                seq=self.seq,
                request_id=WARMUP_ID,
                pos=pos,
                n=n,
                sample=True,
                prime=m.Prime(sampling=SamplingParams()) if pos == 0 else None,
                reserve=total + 1 if pos == 0 else 0,
            )
            out, tensor = self.compute(step, mx.array([prompt[pos : pos + n]], dtype=mx.int32))
            if self.downstream is None:
                self._observe(step, out.trace)
                continue
            self.downstream.send(out, tensor)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(
                        f"warm-up step did not come around the ring within {self.spec.load_timeout:.0f}s"
                    )
                env = self.inbox.get(timeout=left)
                msg = env.message
                if isinstance(msg, m.StepResult) and msg.seq == self.seq:
                    if msg.head:
                        msg, _ = self._finish_head(msg, step, env.tensor)
                    self._observe(step, msg.trace)
                    break
                if env.source == "control":
                    self.early.append(env)  # a front that heard early: served, in order, once warm
                    continue
                if isinstance(msg, m.Rejoin):
                    raise RejoinRequested(msg.spec)
                self.inbox.drop(f"{msg.kind} during ring warm-up")
        self.stage.release(WARMUP_ID)
        if self.downstream is not None:
            self.downstream.send(m.Release(request_id=WARMUP_ID))

    def _observe(self, step: m.Step | InFlight, trace: list[float]) -> None:
        if len(trace) != self.spec.stages:
            return
        context = step.context if isinstance(step, InFlight) else step.pos + step.n
        for speed, seconds in zip(self.stage_speed, trace, strict=True):
            speed.observe(step.n, context, seconds, step.reserve)

    def result_timeout(self) -> float:
        """How long the next result may take: every in-flight step through every stage, with slack.

        A backstop for lost messages, later than a stalled stage's own watchdog so that names it first."""
        estimate = sum(
            s.estimate(f.n, f.context, f.reserve) for f in self.in_flight.values() for s in self.stage_speed
        )
        factor = max(3.0, self.spec.watchdog_factor + 1.0)
        return factor * self.policy.clamp(estimate) + sum(f.grace for f in self.in_flight.values())

    # ---- loop -------------------------------------------------------------------------------------------

    def serve(self) -> None:
        for env in self.early:
            self.handle(env)
        self.early.clear()
        while True:
            timeout = None
            if self.in_flight:
                allowed = self.result_timeout()
                timeout = max(0.0, self.last_progress + allowed - time.monotonic())
            try:
                env = self.inbox.get(timeout=timeout)
            except DeadlineExceeded:
                oldest = next(iter(self.in_flight))
                raise DeadlineExceeded(
                    f"result of step {oldest} not back within {allowed:.1f}s "
                    f"({len(self.in_flight)} steps in flight)"
                ) from None
            self.handle(env)
            self.drain()
            self.act()

    def drain(self) -> None:
        # Take in what already arrived before deciding, so decisions see every result and cancel.
        while (more := self.inbox.get_nowait()) is not None:
            self.handle(more)

    def act(self) -> None:
        window = self.spec.in_flight_window
        while True:
            requests = list(self.requests.values())
            streams = sum(1 for r in requests if r.decoding)
            predicted = schedule.micro_batches(
                streams, self.spec.stages, self.spec.max_batch, self.row_costs.estimate, self.row_costs.rest_s
            )
            batches = predicted
            if self.spec.max_batch > 1:
                batches = self.batch_rates.pick(streams, predicted, max(1, min(self.spec.stages, streams)))
            action = schedule.plan(
                requests,
                len(self.in_flight),
                window,
                self.spec.prefill_step,
                batches,
                self.spec.max_batch,
                sum(1 for f in self.in_flight.values() if f.rows),
            )
            if action is None:
                return
            if isinstance(action, schedule.ReleaseRequest):
                self.release(action.request_id)
                self.drain()
                continue
            room = self.room(action.rows if isinstance(action, schedule.FeedBatch) else (action,))
            if room == "wait":
                return  # blocks come back with results in flight
            if room == "replan":
                continue
            if isinstance(action, schedule.FeedBatch):
                self.feed_rows(action.rows)
            else:
                self.batch_rates.disturb()  # a prefill chunk shares the stages: not a decode-only segment
                self.feed(action)
            self.drain()

    def handle(self, env: Any) -> None:
        msg = env.message
        if isinstance(msg, m.Submit | m.Cancel):
            if isinstance(msg, m.Submit):
                if not FRONT_NAME.fullmatch(msg.front):
                    self.inbox.drop(f"submit from a front named {msg.front[:40]!r}, which no key can answer")
                    return
                if msg.request.request_id not in self.held:
                    self.front_of[msg.request.request_id] = msg.front
                self.on_submit(msg.request, msg.resubmit)
            else:
                self.on_cancel(msg.request_id)
            # Seen only once handled: a beat that counts this seq must already hold the request (or its end
            # went out before the beat), else the front reads a request the leader never had as lost.
            self.seen[msg.front] = max(self.seen.get(msg.front, -1), msg.seq)
            return
        if isinstance(msg, m.Rejoin):
            raise RejoinRequested(msg.spec)
        elif isinstance(msg, m.Shutdown):
            self.stage.stop()
            if self.downstream is not None:
                self.downstream.send(m.Stop())
            raise StopRunner
        elif isinstance(msg, m.StepResult):
            self.on_result(msg, env)
        else:
            self.inbox.drop(f"leader does not take {msg.kind} messages")

    def on_submit(self, spec: m.RequestSpec, resubmit: bool = False) -> None:
        rid = spec.request_id
        if rid in self.held or rid == WARMUP_ID:
            self.inbox.drop(f"duplicate submit of {rid}")  # a front's resend: the first one stands
            return
        need = self.reservation(spec)
        budget = self.spec.kv_budget_bytes
        if budget and need > budget:
            tokens = len(spec.prompt) + len(spec.generated)
            self.emit(
                m.RequestFailed(
                    request_id=rid,
                    message=f"its {tokens} tokens need {need} bytes of KV; the instance holds {budget}",
                )
            )
            self.front_of.pop(rid, None)
        elif len(self.waiting) >= self.spec.max_waiting and not resubmit:
            # A resubmission was accepted already (by an earlier generation): each front bounds its own, so
            # a recovery never refuses what every front held.
            self.emit(m.RequestFailed(request_id=rid, message="leader queue full"))
            self.front_of.pop(rid, None)
        else:
            if not spec.generated and spec.index_base == 0:  # a resumed request has had its first token
                self.submitted_at[rid] = time.monotonic()
            self.held[rid] = None
            self.waiting.append(spec)
            self.admit()

    def reservation(self, spec: m.RequestSpec) -> int:
        """The KV a request is admitted against, as if nothing were cached: every token it knows and the
        next one. It grows a block at a time as it is used (room), never by what max_tokens might reach."""
        return self.ledger.need(self.first_positions(spec))

    @staticmethod
    def first_positions(spec: m.RequestSpec) -> int:
        return len(spec.prompt) + len(spec.generated) + 1

    def admit(self) -> None:
        if self.starved:
            return  # what frees goes to the running request that waits for a block first
        count, evicted = self.ledger.admit([self.reservation(s) for s in self.waiting])
        self.evict(evicted)
        for _ in range(count):
            spec = self.waiting.popleft()
            self.ledger.start(spec.request_id, self.reservation(spec), spec.prompt)
            self.covered[spec.request_id] = round_up(self.first_positions(spec), self.ledger.block)
            self.requests[spec.request_id] = schedule.LeaderRequest(spec=spec, arrival=self.arrivals)
            self.arrivals += 1
            self.emit(m.Admitted(request_id=spec.request_id))

    def on_cancel(self, request_id: str) -> None:
        for spec in self.waiting:
            if spec.request_id == request_id:
                self.waiting.remove(spec)
                self.held.pop(request_id, None)
                self.submitted_at.pop(request_id, None)
                tokens = spec.index_base + len(spec.generated)
                self.emit(m.Finished(request_id=request_id, reason="cancelled", tokens=tokens))
                self.front_of.pop(request_id, None)
                return
        spec = self.preempted.pop(request_id, None)
        if spec is not None:  # going back to the queue once its steps return: it ends instead
            self.finished(request_id, "cancelled", spec.index_base + len(spec.generated))
            return
        req = self.requests.get(request_id)
        if req is not None and not req.done:
            req.done = True  # released once its steps in flight come back
            tokens = req.spec.index_base + req.generated
            self.finished(request_id, "cancelled", tokens)

    def _sent(self, step: schedule.FeedStep) -> m.Row:
        """Mark one request's step as sent: its row (ids, position, whether it samples; nothing else)."""
        req = self.requests[step.request_id]
        self.tick += 1
        schedule.apply_step_sent(req, step, self.tick)
        return m.Row(request_id=step.request_id, pos=step.pos, sample=step.sample)

    def _prime(self, req: schedule.LeaderRequest) -> m.Prime:
        """A request's settings for its first step, and what its sampler continues from: the stage that
        samples holds them and appends each token it samples, as `known` grows here by the same tokens."""
        sp = req.spec.sampling
        context = req.known[-sp.repetition_context :] if sp.repetition_penalty != 1.0 else []
        # Generated tokens start where the original prompt ended (a fast resume folded some into `prompt`).
        # A constraint's state is a function of them: the sampling stage rebuilds its matcher from them.
        output = req.known[req.prompt_len - req.spec.index_base :] if sp.needs_output else []
        return m.Prime(sampling=sp, context=context, output=output, want_logits=req.spec.want_logits)

    def feed(self, step: schedule.FeedStep) -> None:
        req = self.requests[step.request_id]
        first = step.pos == 0
        attach: list[int] = []
        if first:
            # Whole cached blocks of its prompt, short of its last known token (whose step samples).
            limit = min(req.prompt_len, len(req.known) - 1) // self.ledger.block
            attach = self.ledger.attach(step.request_id, limit, req.prompt_len)
            if attach:
                req.fed = len(attach) * self.ledger.block
                resumed = schedule.next_chunk(req, self.spec.prefill_step)
                assert resumed is not None  # the last known token is never attached
                step = resumed
        seal = None
        block = self.ledger.block
        if step.n == block and step.pos % block == 0 and step.pos + step.n <= req.prompt_len:
            seal = self.ledger.seal(step.request_id, step.pos // block)
        self._sent(step)
        self.seq += 1
        msg = m.Step(
            seq=self.seq,
            request_id=step.request_id,
            pos=step.pos,
            n=step.n,
            sample=step.sample,
            prime=self._prime(req) if first else None,
            reserve=len(req.known) + 1 if first else 0,
            attach=attach,
            seal=seal,
        )
        tokens = req.known[step.pos : step.pos + step.n]
        grace = self._compile_grace(req, first, step.sample)
        flight = InFlight(step.request_id, step.n, step.pos + step.n, reserve=msg.reserve, grace=grace)
        self._send(msg, flight, [tokens])
        if attach:
            self.admit()  # its reservation shrank by the blocks it attached

    def _compile_grace(self, req: schedule.LeaderRequest, first: bool, sample: bool) -> float:
        """The allowance for compiling a request's grammar, on its first sampling step after each prime."""
        rid, c = req.spec.request_id, req.spec.sampling.constraint
        if first:
            self.compiled.discard(rid)  # primed anew (a resume, a preemption): the stage compiles again
        if c is None or not sample or rid in self.compiled:
            return 0.0
        self.compiled.add(rid)
        return compile_grace_s(len(c.source))

    def feed_rows(self, steps: tuple[schedule.FeedStep, ...]) -> None:
        rows = [self._sent(step) for step in steps]
        self.seq += 1
        msg = m.Step(seq=self.seq, request_id=m.BATCH_ID, pos=0, n=len(rows), sample=True, rows=rows)
        ids = tuple(r.request_id for r in rows)
        tokens = [self.requests[s.request_id].known[s.pos : s.pos + 1] for s in steps]
        self._send(msg, InFlight(m.BATCH_ID, len(rows), msg.keys, ids), tokens)

    def _send(self, msg: m.Step, flight: InFlight, tokens: list[list[int]]) -> None:
        flight.sent_at = time.monotonic()
        flight.step = msg
        if not self.in_flight:
            self.last_progress = flight.sent_at
            flight.alone = True
        self.in_flight[self.seq] = flight
        out, tensor = self.compute(msg, mx.array(tokens, dtype=mx.int32))
        if self.downstream is None:  # a single stage is its own last stage
            self.on_result(out, None, tensor)
        else:
            self.downstream.send(out, tensor)

    def on_result(self, res: m.StepResult, env: Any, logits: Any = None) -> None:
        f = self.in_flight.get(res.seq)
        if f is None or f.request_id != res.request_id:
            self.inbox.drop(f"result for step {res.seq} of {res.request_id}, which is not in flight")
            return
        lost = [s for s in self.in_flight if s < res.seq]
        if lost:  # the ring is in order: an earlier result that never came is a lost message
            raise ProtocolError(f"results of steps {lost} never arrived (got {res.seq})")
        if env is not None:
            logits = env.tensor
        if res.head:
            res, logits = self._finish_head(res, f.step, logits)
        del self.in_flight[res.seq]
        self.last_progress = time.monotonic()
        self._observe(f, res.trace)
        if not f.rows:
            self.batch_rates.disturb()
            self._took(m.RowResult(request_id=f.request_id, **res.model_dump(include=TOKEN_FIELDS)), logits)
            return
        if [r.request_id for r in res.rows] != list(f.rows):
            raise ProtocolError(f"result of batched step {res.seq} does not match its rows")
        round_trip = self.last_progress - f.sent_at if f.alone else None
        self.row_costs.observe(len(f.rows), res.trace, round_trip)
        self.batch_rates.observe(self.last_progress, sum(1 for r in res.rows if r.token is not None))
        for i, row in enumerate(res.rows):
            self._took(row, logits[i] if logits is not None else None)

    def _finish_head(self, res: m.StepResult, step: m.Step | None, packed: Any) -> tuple[m.StepResult, Any]:
        """The last stage computed its part of a split head: complete the logits and sample here. The time
        counts as the first stage's, whose core it runs on."""
        if packed is None or step is None or not self.stage.shard.head_split:
            raise ProtocolError(f"result of step {res.seq} leaves a head to finish that this stage lacks")
        started = time.monotonic()
        done, logits = self.stage.finish_head(step, packed)
        trace = list(res.trace)
        if trace:
            trace[0] += time.monotonic() - started
        return done.model_copy(update={"trace": trace}), logits

    def _took(self, res: m.RowResult, logits: Any) -> None:
        """One request's share of a result: its token, if the step sampled one and it still wants it."""
        req = self.requests[res.request_id]
        req.in_flight -= 1
        if res.token is None or req.done:
            return
        reason = schedule.apply_token(req, res.token)
        self.sampled += 1
        if (t0 := self.submitted_at.pop(res.request_id, None)) is not None:
            self.ttfts.append(time.monotonic() - t0)
        if reason != "stop" and not self.faults.take_drop("drop_token", "decode", self.stage.steps):
            self.emit(
                m.TokenEvent(
                    request_id=res.request_id,
                    index=req.spec.index_base + req.generated - 1,
                    token=res.token,
                    logprob=res.logprob or 0.0,
                    top_logprobs=res.top_logprobs,
                    tensor=tensor_meta(logits) if logits is not None else None,
                ),
                logits,
            )
        if reason is not None:
            tokens = req.spec.index_base + req.generated
            self.finished(res.request_id, reason, tokens)

    def finished(self, request_id: str, reason: Literal["stop", "length", "cancelled"], tokens: int) -> None:
        cached = self.ledger.cached_tokens(request_id)
        self.emit(m.Finished(request_id=request_id, reason=reason, tokens=tokens, cached_tokens=cached))

    def release(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        req.released = True
        self.covered.pop(request_id, None)
        self.compiled.discard(request_id)
        requeue = self.preempted.pop(request_id, None)
        if requeue is None:
            self.held.pop(request_id, None)
            self.submitted_at.pop(request_id, None)
            self.front_of.pop(request_id, None)
        self.stage.release(request_id)
        if self.downstream is not None:
            self.downstream.send(m.Release(request_id=request_id))
        self.evict(self.ledger.release(request_id))
        if requeue is not None:
            # First in line again (it was admitted before everything waiting); its blocks went to the
            # request that needed them, so it is admitted when something else ends.
            self.waiting.appendleft(requeue)
            return
        self.starved = False
        self.admit()

    # ---- KV as it is used -----------------------------------------------------------------------------

    def room(self, steps: tuple[schedule.FeedStep, ...]) -> Literal["go", "wait", "replan"]:
        """Grow the reservations of the requests in a step to the positions it fills. Where the budget is
        out: wait for blocks in flight to come back, or send the newest request back to the queue."""
        block = self.ledger.block
        for step in steps:
            rid = step.request_id
            covered = self.covered.get(rid, 0)
            blocks = schedule.grown_blocks(covered, step.pos + step.n, block)
            if not blocks:
                continue
            extra = blocks * self.ledger.block_bytes
            count, evicted = self.ledger.admit([extra])
            self.evict(evicted)
            if count:
                self.ledger.held[rid].reserved += extra
                self.covered[rid] = round_up(covered, block) + blocks * block
                self.starved = False
                continue
            self.starved = True
            decision, victim = schedule.make_room(list(self.requests.values()), rid)
            if decision == "wait":
                return "wait"
            assert victim is not None
            if decision == "truncate":
                log.warning("request %s alone fills the KV budget: it ends at %d positions", rid, covered)
                req = self.requests[rid]
                req.done = True
                self.finished(rid, "length", req.spec.index_base + req.generated)
            else:
                self.preempt(victim)
            return "replan"
        return "go"

    def preempt(self, request_id: str) -> None:
        """Back to the queue, with every token it has (a resume within this generation): its steps in
        flight come back unused, then its KV is released everywhere, and it recomputes when admitted."""
        req = self.requests[request_id]
        req.done = True
        generated = req.known[len(req.spec.prompt) :]
        self.preempted[request_id] = req.spec.model_copy(update={"generated": generated})
        log.info(
            "request %s goes back to the queue after %d tokens: the KV budget is out",
            request_id,
            req.generated,
        )

    def evict(self, blocks: list[int]) -> None:
        """Cached blocks the ledger dropped: every stage drops them, in ring order (before any later step)."""
        if not blocks:
            return
        self.stage.evict(blocks)
        if self.downstream is not None:
            self.downstream.send(m.Evict(blocks=blocks))

    def beat(self) -> None:
        """From the heartbeat thread: each copy is atomic under the GIL, and `seen` is copied first.

        The leader thread adds a request to `held` before it counts its seq in `seen`, and drops it only
        after its end went out; so every request this beat counts as seen is in `held` or has ended."""
        seen = dict(self.seen)
        held = list(self.held)
        received = dict(self.received)  # after seen: whatever seen counts was received before
        running = len(self.requests)
        ttfts = []
        while self.ttfts:
            ttfts.append(self.ttfts.popleft())
        ledger = self.ledger
        beat = m.LeaderBeat(
            seen=seen,
            requests=held,
            running=running,
            tokens=self.sampled,
            ttft_s=ttfts,
            received=received,
            prefix_queries=ledger.queries,
            prefix_hits=ledger.hits,
            prefix_blocks=len(ledger.blocks),
            prefix_block_tokens=ledger.block if ledger.enabled else 0,
            prefix_off=self.prefix_off,
        )
        self.emit(beat)
        # Each front's own beat, behind its requests' ends on its reply key: only there can a front tell a
        # lost end (a beat on another key may overtake the end it follows).
        front_of = dict(self.front_of)
        mine: dict[str, list[str]] = {}
        for rid in held:
            if (front := front_of.get(rid)) is not None:
                mine.setdefault(front, []).append(rid)
        with self.replies_lock:
            outs = [(front, out) for front, out in self.replies.items() if front in seen]
        for front, out in outs:
            own = m.LeaderBeat(seen={front: seen[front]}, requests=mine.get(front, []), running=running)
            try:
                out.send(own)
            except Exception as exc:  # an outbox closed meanwhile: its front gets the next beat
                log.debug("beat to %s failed: %s", front, exc)

    def emit(self, event: Any, tensor: Any = None) -> None:
        """A request's events go to its own front only; beats to every front (each reads its part)."""
        front = self.front_of.get(getattr(event, "request_id", ""))
        out = self.reply_to(front) if front is not None else None
        (out or self.events).send(event, tensor)

    def reply_to(self, front: str) -> Outbox | None:
        if self.open_reply is None:
            return None
        with self.replies_lock:
            out = self.replies.get(front)
            if out is None:
                out = self.replies[front] = self.open_reply(front)
                while len(self.replies) > REPLY_OUTBOXES:
                    self.replies.popitem(last=False)[1].close()
            self.replies.move_to_end(front)
            return out
