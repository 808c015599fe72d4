"""How an instance's runners and their controller behave: chunking, deadlines, heartbeats, the restart budget.

The one definition of each of these settings (its name, its default, its bounds). A local engine's config,
a cluster's runner settings, the controller's config and the spec a runner process is started with all
extend this class, so a setting cannot be spelled or defaulted differently in two places.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shardline.instance.deadline import DeadlinePolicy


class InstanceSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    prefill_step: int = Field(256, ge=1)
    max_batch: int = Field(16, ge=1)  # decode positions of different requests batched in one step
    # Keep prompts' KV in blocks of prefill_step tokens and start later requests after the blocks their
    # prompts begin with (runner/prefix.py); off, every prompt is prefilled in full.
    prefix_cache: bool = True
    # A step may take deadline_slack x its estimate (from its size and the stage's measured speed, seeded by
    # warm-up), within [step_deadline_floor, step_timeout]. The runner watchdog waits watchdog_factor x that,
    # so the controller names a stall first when it can.
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

    @property
    def policy(self) -> DeadlinePolicy:
        return DeadlinePolicy(self.step_deadline_floor, self.step_timeout, self.deadline_slack)

    def settings_fields(self) -> dict[str, Any]:
        """Just the InstanceSettings fields of this object (a subclass carries more): to build another one."""
        return {name: getattr(self, name) for name in InstanceSettings.model_fields}


def default(name: str) -> Any:
    """A setting's one default, for command-line flags that set it."""
    return InstanceSettings.model_fields[name].default
