"""Everything that crosses a process boundary, one tagged union per channel.

Channels:
- ring: stage r -> r+1, last -> 0 (steps, results, release, stop);
- group: a tensor-parallel stage's face -> its members (the ring messages it obeys), and their sums;
- control: fronts -> leader (submit, cancel, shutdown);
- events: leader -> fronts (tokens, finishes, admissions, the leader's beat);
- status: runners, node agents and fronts -> the instance controller (what it judges health from);
- agent: controller -> node agent (start a runner, stop a generation);
- instance: controller -> fronts (a generation serves, is being rebuilt, the instance failed).

Models ignore unknown fields so a newer peer never wedges an older one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shardline.compute.sampling import SamplingParams
from shardline.dataplane.diagnostics import Diagnostic
from shardline.instance.spec import RunnerSpec
from shardline.trust.names import Name


class Wire(BaseModel):
    # Infinite logprobs are legitimate (a masked token): write them as JSON constants, not null.
    model_config = ConfigDict(extra="ignore", frozen=True, ser_json_inf_nan="constants")


class TensorMeta(Wire):
    dtype: str
    shape: list[int]


class StepTime(Wire):
    """How long one stage took for a step of n positions attending to `context` keys."""

    n: int
    context: int
    seconds: float
    reserve: int = 0  # KV positions the step allocated


# ---- ring: stage to stage, in order -------------------------------------------------------------------


class Prime(Wire):
    """A request's per-request settings, sent once: with its first step (the one that starts its KV cache).

    The stage that samples holds them until the request is released, and keeps the tokens they read up to
    date itself by appending each token it samples: later steps carry only ids, positions and lengths, so a
    step's header never grows with a request's settings or its output. A resumed request's first step carries
    what the sampler must continue from (its prompt's tail and the tokens generated already)."""

    sampling: SamplingParams
    context: list[int] = []  # the newest known tokens the repetition penalty reads (when it applies)
    output: list[int] = []  # generated already (a resume), when penalties or a constraint read them
    want_logits: bool = False


class Row(Wire):
    """One request's position in a batched decode step."""

    request_id: str
    pos: int
    sample: bool = True


class Step(Wire):
    """Run n positions of one request through a stage: token ids into stage 0, hidden states elsewhere.

    A batched decode step (`rows` given; request_id is BATCH_ID, n the number of rows) runs one position
    of each row's request, each with its own KV cache and position: tensors are (rows, 1[, hidden]).
    """

    kind: Literal["step"] = "step"
    seq: int
    request_id: str
    pos: int
    n: int
    sample: bool = False
    prime: Prime | None = None  # on a request's first step only: its settings, held by the stage that samples
    reserve: int = 0  # on a request's first step: positions its KV cache may grow to
    # Prefix cache (runner/prefix.py; the leader decides, every stage obeys in ring order):
    attach: list[int] = []  # on a request's first step: its cache starts as these cached blocks, in order
    seal: int | None = None  # this step fills one whole block: keep it as cached block `seal` afterwards
    trace: list[float] = []  # compute seconds of each stage so far: the leader learns every stage's speed
    tensor: TensorMeta | None = None
    rows: list[Row] = []

    @property
    def keys(self) -> int:
        """The most keys any of its positions attends to: what its attention costs scale with."""
        return max(r.pos for r in self.rows) + 1 if self.rows else self.pos + self.n


BATCH_ID = "\x00batch"  # the request id of a batched step: no front sends control characters


class RowResult(Wire):
    """A token sampled for one request (with its log-probabilities), or none when the step only fed."""

    request_id: str
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []


class StepResult(Wire):
    """Last stage -> leader: a step finished; with a token when it sampled (one per row when batched)."""

    kind: Literal["result"] = "result"
    seq: int
    request_id: str
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []
    trace: list[float] = []
    tensor: TensorMeta | None = None  # the logits, when asked for (every row's, when batched)
    rows: list[RowResult] = []
    # The head is split (Shard.head_split): nothing is sampled yet, and the tensor holds the hidden states and
    # the upper part of the logits, which the leader completes and samples from.
    head: bool = False


class Release(Wire):
    kind: Literal["release"] = "release"
    request_id: str


class Evict(Wire):
    """Drop these cached blocks (the leader's decision): requests that attached them keep their copies."""

    kind: Literal["evict"] = "evict"
    blocks: list[int]


class Stop(Wire):
    kind: Literal["stop"] = "stop"


RingMessage = Annotated[Step | StepResult | Release | Evict | Stop, Field(discriminator="kind")]
RING = TypeAdapter(RingMessage)


# ---- group: a tensor-parallel stage's face <-> its other members (dataplane/group.py) ------------------


class GroupHello(Wire):
    """A member's first frame to its face: who it is, proven with the cluster key over the face's nonce."""

    kind: Literal["group_hello"] = "group_hello"
    instance: str
    generation: int
    stage: int
    member: int
    mac: str = ""  # hex HMAC-SHA256 (empty in an open cluster)


GroupMessage = Annotated[Step | Release | Evict | Stop | GroupHello, Field(discriminator="kind")]
GROUP = TypeAdapter(GroupMessage)


# ---- control: fronts -> leader -----------------------------------------------------------------------


class RequestSpec(Wire):
    request_id: str
    prompt: list[int]
    generated: list[int] = []  # already streamed to the client; replayed as decode steps on resume
    index_base: int = 0  # tokens the client already has that are folded into `prompt` (fast resume)
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_tokens: list[int] = []
    want_logits: bool = False


class Submit(Wire):
    kind: Literal["submit"] = "submit"
    front: str  # the sending front and its message count: the leader's beat says what it has seen
    seq: int
    request: RequestSpec
    # A request the front accepted before this generation served (resent after a failure, or held while no
    # generation served): never refused for a full waiting queue, so a recovery loses nothing any front held.
    resubmit: bool = False


class Cancel(Wire):
    kind: Literal["cancel"] = "cancel"
    front: str
    seq: int
    request_id: str


class Shutdown(Wire):
    kind: Literal["shutdown"] = "shutdown"


ControlMessage = Annotated[Submit | Cancel | Shutdown, Field(discriminator="kind")]
CONTROL = TypeAdapter(ControlMessage)


# ---- events: leader -> fronts ------------------------------------------------------------------------


class TokenEvent(Wire):
    kind: Literal["token"] = "token"
    request_id: str
    index: int  # position in the generated sequence: a gap is a lost event, a repeat is a replay
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = []
    tensor: TensorMeta | None = None


class Finished(Wire):
    kind: Literal["finished"] = "finished"
    request_id: str
    reason: Literal["stop", "length", "cancelled"]
    tokens: int = 0  # tokens the client must hold now: fewer means an event was lost
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of a prefill


class RequestFailed(Wire):
    kind: Literal["failed"] = "failed"
    request_id: str
    message: str


class Admitted(Wire):
    """The leader reserved the request's KV and runs it: it no longer waits in a queue."""

    kind: Literal["admitted"] = "admitted"
    request_id: str


class LeaderBeat(Wire):
    """What the leader holds: a request a front sent (seq <= seen) that is not listed has lost its end."""

    kind: Literal["leader_beat"] = "leader_beat"
    seen: dict[str, int]  # front -> last control seq processed
    requests: list[str]  # admitted and waiting
    running: int = 0  # of those, admitted
    tokens: int = 0  # tokens this leader has sampled since it started: rates come from differences
    ttft_s: list[float] = []  # submit-to-first-token of the requests that got one since the last beat
    # Prefix cache, since this leader started: prompt tokens looked up and found (vLLM's prefix_cache_queries
    # and _hits), and the blocks cached now with the tokens each holds.
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_blocks: int = 0
    prefix_block_tokens: int = 0
    prefix_off: str = ""  # why this model keeps no prefix cache ("" when it may)
    # front -> newest control seq that reached the leader's process (on arrival, before it is processed);
    # None from an older leader: the front then cannot tell a lost Submit from a slow one
    received: dict[str, int] | None = None


Event = Annotated[TokenEvent | Finished | RequestFailed | Admitted | LeaderBeat, Field(discriminator="kind")]
EVENTS = TypeAdapter(Event)


# ---- status: -> the instance controller ----------------------------------------------------------------
# Each names its runner by `slot` (RunnerSpec.slot: its status key; a face's is its ring stage).


class Loading(Wire):
    kind: Literal["loading"] = "loading"
    slot: int
    pid: int


class Ready(Wire):
    kind: Literal["ready"] = "ready"
    slot: int
    pid: int
    weight_bytes: int
    layers: tuple[int, int]
    kv_bytes_per_token: int = 0  # this stage's layers
    warmup: list[StepTime] = []  # seeds the step deadline before any real step ran
    path: str = ""  # "fast", or "generic: " and why the fast path does not run it (compute/shard.py)
    expert_bytes: int = 0  # of weight_bytes, the routed experts it holds (an expert group's share)


class Heartbeat(Wire):
    kind: Literal["heartbeat"] = "heartbeat"
    slot: int
    steps: int
    busy: bool
    phase: Literal["loading", "ready"] = "ready"
    busy_for_s: float = 0.0  # how long the current step has been running (0 when idle)
    busy_n: int = 0  # the current step's positions and the keys it attends to: its deadline scales with them
    busy_context: int = 0
    busy_reserve: int = 0  # KV positions the current step allocates: a long prompt's first chunk does
    last_step: StepTime | None = None
    peak_bytes: int = 0  # MLX peak since the runner became ready
    kv_bytes: int = 0
    kv_cached_bytes: int = 0  # of kv_bytes, the prefix cache's blocks (each once)
    kv_peak_bytes: int = 0
    weight_bytes: int = 0
    constraint_tokenizer: bool = False  # it loaded the constraint engine's tokenizer (a fixed cost, ~40 MB)
    # Seconds of bounded work under way, sized to that work: building the constraint tokenizer holds the GIL
    # (no beat can be sent), compiling a request's grammar lengthens its step. The runner may stay silent
    # this much past the heartbeat timeout after this beat, and its current step may run this much past its
    # deadline. Sent just before the work starts; 0 once it is done.
    grace_s: float = Field(0.0, ge=0)
    # A tensor-parallel face: its group's sums, microseconds each (p50, p99) over its recent decode steps
    # and prefill chunks, and how many it made.
    group_sums: int = 0
    sum_us_decode: tuple[float, float] = (0.0, 0.0)
    sum_us_chunk: tuple[float, float] = (0.0, 0.0)
    # An expert group's face: tokens routed to each expert of each of its layers since it loaded ([] for a
    # dense layer): the load that routing-aware placement spreads (cluster/experts.py).
    routed: list[list[int]] = []
    dropped: int = 0  # frames this runner refused: unparsable, another generation, unknown request
    requests: int = 0


class RunnerFailed(Wire):
    kind: Literal["runner_failed"] = "runner_failed"
    slot: int
    reason: Literal["load", "deadline", "transport", "protocol", "compute"]
    message: str
    generation: int | None = None  # set when a node agent reports it for a runner that never started


class RunnerStarted(Wire):
    """Node agent: a runner process exists."""

    kind: Literal["runner_started"] = "runner_started"
    generation: int
    slot: int
    pid: int


class RunnerExited(Wire):
    """Node agent: a runner process is gone, and how."""

    kind: Literal["runner_exited"] = "runner_exited"
    generation: int
    slot: int
    pid: int
    code: int | None = None
    signal: int | None = None
    log_tail: list[str] = []


class RunnerStopped(Wire):
    """Node agent: the runner process is stopped (SIGSTOP, a debugger): it cannot make progress."""

    kind: Literal["runner_stopped"] = "runner_stopped"
    generation: int
    slot: int
    pid: int


class RunnerDiagnostic(Wire):
    """Node agent: a fatal diagnostic read from a runner's output."""

    kind: Literal["runner_diagnostic"] = "runner_diagnostic"
    generation: int
    slot: int
    diagnostic: Diagnostic


class WeightsProgress(Wire):
    """Node agent: the stage's weights are being copied from a peer (bring-up is progressing, not stuck)."""

    kind: Literal["weights_progress"] = "weights_progress"
    generation: int
    slot: int
    done: int
    total: int
    source: str = ""


class PeerLost(Wire):
    """Runner: the next stage's process is gone (its subscription vanished): it cannot have received more."""

    kind: Literal["peer_lost"] = "peer_lost"
    slot: int
    peer: int


class GenerationFault(Wire):
    """Front: the generation lost a message (a token gap, a request the leader no longer holds)."""

    kind: Literal["generation_fault"] = "generation_fault"
    generation: int
    why: str


class Resubmitted(Wire):
    """Front: requests it resent to a new generation."""

    kind: Literal["resubmitted"] = "resubmitted"
    generation: int
    requests: int


RunnerStatus = Annotated[
    Loading
    | Ready
    | Heartbeat
    | RunnerFailed
    | RunnerStarted
    | RunnerExited
    | RunnerStopped
    | RunnerDiagnostic
    | WeightsProgress
    | PeerLost
    | GenerationFault
    | Resubmitted,
    Field(discriminator="kind"),
]
STATUS = TypeAdapter(RunnerStatus)


# ---- agent: controller -> node agent ---------------------------------------------------------------------


class StartRunner(Wire):
    kind: Literal["start_runner"] = "start_runner"
    spec: RunnerSpec
    threads: int = 1
    reuse: bool = False  # a live runner of an older generation with this layer range joins instead
    sources: list[str] = []  # nodes holding the model's files, for a node that lacks them
    term: int = 0  # the master's term: a node obeys the highest it has seen
    view_seq: int = 0  # the master's newest view when it decided this: later views list the runner
    digest: str = ""  # the model digest its weights must have, local copy or fetched (never loaded unchecked)


class StopGeneration(Wire):
    """Stop every runner of the instance whose generation is not `keep` (-1: all), after `grace_s`."""

    kind: Literal["stop_generation"] = "stop_generation"
    instance: Name
    keep: int = -1
    grace_s: float = 0.0
    term: int = 0
    slots: list[int] = []  # only these runners (RunnerSpec.slot; empty: every one)


AgentCommand = Annotated[StartRunner | StopGeneration, Field(discriminator="kind")]
AGENT = TypeAdapter(AgentCommand)


# ---- runner: node agent -> one live runner ------------------------------------------------------------


class Rejoin(Wire):
    """Join generation spec.generation as spec.slot, keeping the loaded weights, dropping all KV."""

    kind: Literal["rejoin"] = "rejoin"
    spec: RunnerSpec


REJOIN = TypeAdapter(Rejoin)


# ---- instance: controller -> fronts ---------------------------------------------------------------------
# `term`: the master term whose controller said it (0 for a single machine's engine). A front orders what it
# hears by (term, generation): a master that was cut off and deposed may have launched generations the next
# master never knew, with higher ids than the one that master adopted and serves.


class Serving(Wire):
    kind: Literal["serving"] = "serving"
    generation: int
    term: int = 0
    kv_bytes_per_token: int  # all stages together
    kv_budget_bytes: int
    kv_block: int = 256  # positions per KV block (the prefill step): reservations are whole blocks


class Recovering(Wire):
    kind: Literal["recovering"] = "recovering"
    generation: int
    why: str
    term: int = 0


class InstanceFailed(Wire):
    kind: Literal["instance_failed"] = "instance_failed"
    why: str
    term: int = 0


InstanceUpdate = Annotated[Serving | Recovering | InstanceFailed, Field(discriminator="kind")]
INSTANCE = TypeAdapter(InstanceUpdate)
