"""What a runner process is told to be: one stage of one instance generation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Fault(BaseModel):
    """A failure to inject (tests, chaos bench): at `phase`, after `after_steps` steps of this stage.

    `slow` adds `seconds` to every step from `phase` on (a slow machine, still progressing); `drop_message`
    swallows this stage's outgoing ring message of one step; `drop_token` (stage 0) swallows one token event.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    phase: Literal["load", "warmup", "prefill", "decode"]
    action: Literal[
        "raise", "exit", "hang", "ring_abort", "sigkill", "sigstop", "slow", "drop_message", "drop_token"
    ]
    after_steps: int = 0
    seconds: float = 0.0


class RunnerSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    instance: str
    generation: int
    stage: int
    stages: int
    model_dir: str  # on the node that runs it; a node agent fills it in from `model` when empty
    model: str = ""  # the model's name across the cluster (a node without its files fetches the stage)
    namespace: str = "shardline"
    runner_id: str = ""  # set by the node agent: where a Rejoin reaches this process
    layer_start: int
    layer_end: int
    layer_total: int
    connect: list[str]
    listen: list[str] = ["tcp/127.0.0.1:0"]
    prefill_step: int = 256
    window: int = 0  # steps in flight around the ring; 0 = stages + 1
    max_batch: int = 16  # decode positions of different requests in one step; 1 = one request per step
    # Step deadlines: deadline_slack x the step's estimated time, within [floor, ceiling]; the runner's own
    # watchdog waits watchdog_factor times that, so the controller names a stall first when it can.
    step_deadline_floor: float = 2.0
    step_deadline_ceiling: float = 60.0
    deadline_slack: float = 10.0
    watchdog_factor: float = 2.0
    load_timeout: float = 120.0
    score_budget: int = 0  # 0 = compute.attention default
    kv_budget_bytes: int = 0  # the leader admits requests while their KV reservations fit; 0 = no limit
    max_waiting: int = 1024  # requests the leader holds unadmitted; fronts bound theirs below this
    cpu: int | None = None
    parent_pid: int | None = None
    heartbeat_s: float = 1.0
    fault: Fault | None = None

    @property
    def is_leader(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def next_stage(self) -> int:
        return (self.stage + 1) % self.stages

    @property
    def in_flight_window(self) -> int:
        return self.window or self.stages + 1
