"""What the instance controller hears (events) and what it does about them (effects), for the fold in
controller/state.py and the shell in controller/controller.py that carries the effects out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.dataplane import messages as m

Launch = tuple[str, m.StartRunner]  # a node agent's key, and what it is to start


# ---- events ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heard:
    """A status message (from a runner, its node agent or a front), stamped on arrival (monotonic)."""

    message: Any
    generation: int  # the key's: for messages that carry none
    received_at: float


@dataclass(frozen=True)
class Clock:
    """Time passed: judge the generation's health, or launch the next one when its backoff is over."""

    now: float  # monotonic
    wall: float  # time.time(), recorded with a failure


@dataclass(frozen=True)
class Begin:
    """Launch the first generation."""

    now: float


@dataclass(frozen=True)
class LaidOut:
    """The layout of a generation asked for (Lay): one launch per runner, in slot order."""

    generation: int
    launches: list[Launch]
    now: float


@dataclass(frozen=True)
class Adopt:
    """Take over a generation that serves already (a new master), instead of launching one."""

    generation: int
    stages: int
    agents: list[str]
    kv_bytes_per_token: int
    now: float


@dataclass(frozen=True)
class Broken:
    """Another role saw this generation break (its node left the cluster): recover it."""

    generation: int
    why: str
    stages: list[int]


@dataclass(frozen=True)
class Abandon:
    """The instance cannot go on (no layout fits, the controller itself failed): it fails with `why`."""

    why: str


@dataclass(frozen=True)
class Retire:
    """The instance is removed: every node agent stops its runners, leaving `grace_s` to the ring."""

    grace_s: float


Event = Heard | Clock | Begin | LaidOut | Adopt | Broken | Abandon | Retire


# ---- effects ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToAgent:
    """A command to a node agent (agents check who commands: the shell seals it)."""

    agent: str
    message: m.StartRunner | m.StopGeneration


@dataclass(frozen=True)
class ToFronts:
    """An announcement to the instance's fronts, on its updates key."""

    message: m.Serving | m.Recovering | m.InstanceFailed


@dataclass(frozen=True)
class Lay:
    """Compute the layout of `generation` and fold it back: LaidOut, or Abandon when nothing fits."""

    generation: int
    now: float


@dataclass(frozen=True)
class Note:
    """A line for the log."""

    level: int
    text: str


Effect = ToAgent | ToFronts | Lay | Note
