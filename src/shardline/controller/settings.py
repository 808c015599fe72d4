"""How runners and their controller behave: chunking, deadlines, heartbeats, the restart budget.

One set of knobs for a local engine and for a cluster's master, so the two never drift apart.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shardline.controller.state import ControllerConfig


class RunSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    prefill_step: int = Field(256, ge=1)
    max_batch: int = Field(16, ge=1)  # decode positions of different requests batched in one step
    # A step may take deadline_slack x its estimate (from its size and the stage's measured speed, seeded by
    # warm-up), within [step_deadline_floor, step_timeout]. The runner watchdog waits watchdog_factor x that.
    step_timeout: float = Field(60.0, gt=0)
    step_deadline_floor: float = Field(2.0, gt=0)
    deadline_slack: float = Field(10.0, gt=0)
    watchdog_factor: float = Field(2.0, gt=0)
    load_timeout: float = Field(180.0, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    heartbeat_timeout: float = Field(4.0, gt=0)  # a runner silent this long is stalled (SIGSTOP, frozen host)
    max_restarts: int = Field(3, ge=0)  # within restart_window_s; one more failure marks the instance failed
    restart_window_s: float = Field(120.0, gt=0)
    backoff_s: float = Field(0.2, ge=0)  # doubled per consecutive failure, capped at backoff_max_s
    backoff_max_s: float = Field(5.0, ge=0)
    max_queue: int = Field(256, ge=1)  # requests waiting at a front; one more is refused with OverloadError

    def controller_config(self, stages: int) -> ControllerConfig:
        return ControllerConfig(
            stages=stages,
            load_timeout=self.load_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            step_deadline_floor=self.step_deadline_floor,
            step_deadline_ceiling=self.step_timeout,
            deadline_slack=self.deadline_slack,
            max_restarts=self.max_restarts,
            restart_window_s=self.restart_window_s,
            backoff_s=self.backoff_s,
            backoff_max_s=self.backoff_max_s,
        )

    def spec_fields(self) -> dict[str, Any]:
        """The RunnerSpec fields these settings decide."""
        return {
            "prefill_step": self.prefill_step,
            "max_batch": self.max_batch,
            "step_deadline_floor": self.step_deadline_floor,
            "step_deadline_ceiling": self.step_timeout,
            "deadline_slack": self.deadline_slack,
            "watchdog_factor": self.watchdog_factor,
            "load_timeout": self.load_timeout,
            "heartbeat_s": self.heartbeat_s,
            "max_waiting": self.max_queue + 16,  # the leader holds a little more than fronts let wait
        }
