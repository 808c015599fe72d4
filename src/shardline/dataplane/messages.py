"""Everything that crosses a process boundary, one tagged union per channel.

Channels: the ring (stage r -> r+1, last -> 0), control (front -> leader), events (leader -> front) and
status (runner -> front). Models ignore unknown fields so a newer peer never wedges an older one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shardline.compute.sampling import SamplingParams


class Wire(BaseModel):
    # Infinite logprobs are legitimate (a masked token): write them as JSON constants, not null.
    model_config = ConfigDict(extra="ignore", frozen=True, ser_json_inf_nan="constants")


class TensorMeta(Wire):
    dtype: str
    shape: list[int]


# ---- ring: stage to stage, in order -------------------------------------------------------------------


class Step(Wire):
    """Run n positions of one request through a stage: token ids into stage 0, hidden states elsewhere."""

    kind: Literal["step"] = "step"
    seq: int
    request_id: str
    pos: int
    n: int
    sample: bool = False
    sampling: SamplingParams | None = None
    context: list[int] = []
    want_logits: bool = False
    reserve: int = 0  # on a request's first step: positions to allocate the KV cache for at once
    tensor: TensorMeta | None = None


class StepResult(Wire):
    """Last stage -> leader: a step finished; with a token when it sampled."""

    kind: Literal["result"] = "result"
    seq: int
    request_id: str
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []
    tensor: TensorMeta | None = None  # the logits, when asked for


class Release(Wire):
    kind: Literal["release"] = "release"
    request_id: str


class Stop(Wire):
    kind: Literal["stop"] = "stop"


RingMessage = Annotated[Step | StepResult | Release | Stop, Field(discriminator="kind")]
RING = TypeAdapter(RingMessage)


# ---- control: front -> leader ------------------------------------------------------------------------


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
    request: RequestSpec


class Cancel(Wire):
    kind: Literal["cancel"] = "cancel"
    request_id: str


class Shutdown(Wire):
    kind: Literal["shutdown"] = "shutdown"


ControlMessage = Annotated[Submit | Cancel | Shutdown, Field(discriminator="kind")]
CONTROL = TypeAdapter(ControlMessage)


# ---- events: leader -> front -------------------------------------------------------------------------


class TokenEvent(Wire):
    kind: Literal["token"] = "token"
    request_id: str
    index: int  # position in the generated sequence, so the front can drop duplicates after a resume
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = []
    tensor: TensorMeta | None = None


class Finished(Wire):
    kind: Literal["finished"] = "finished"
    request_id: str
    reason: Literal["stop", "length", "cancelled"]


class RequestFailed(Wire):
    kind: Literal["failed"] = "failed"
    request_id: str
    message: str


Event = Annotated[TokenEvent | Finished | RequestFailed, Field(discriminator="kind")]
EVENTS = TypeAdapter(Event)


# ---- status: runner -> front --------------------------------------------------------------------------


class Loading(Wire):
    kind: Literal["loading"] = "loading"
    stage: int
    pid: int


class Ready(Wire):
    kind: Literal["ready"] = "ready"
    stage: int
    pid: int
    weight_bytes: int
    layers: tuple[int, int]


class Heartbeat(Wire):
    kind: Literal["heartbeat"] = "heartbeat"
    stage: int
    steps: int
    busy: bool
    phase: Literal["loading", "ready"] = "ready"
    busy_for_s: float = 0.0  # how long the current step has been running (0 when idle)
    last_step_s: float = 0.0  # duration of the last completed step
    peak_bytes: int = 0  # MLX peak since the runner became ready
    kv_peak_bytes: int = 0
    weight_bytes: int = 0


class RunnerFailed(Wire):
    kind: Literal["runner_failed"] = "runner_failed"
    stage: int
    reason: Literal["load", "deadline", "transport", "protocol", "compute", "peer"]
    message: str


class Exited(Wire):
    kind: Literal["exited"] = "exited"
    stage: int


RunnerStatus = Annotated[Loading | Ready | Heartbeat | RunnerFailed | Exited, Field(discriminator="kind")]
STATUS = TypeAdapter(RunnerStatus)
