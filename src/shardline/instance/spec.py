"""What a runner process is told to be (`RunnerSpec`, built by `runner_spec` alone), how it is named, and the
fault a test may inject into it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from shardline.instance.settings import InstanceSettings
from shardline.trust.names import Name, NameOrEmpty


def runner_name(ring: int, member: int, slot: int, group: int) -> str:
    """How messages name a runner: its ring stage (a face's slot is its ring stage), and for a group's other
    members their place and slot too."""
    return f"stage {ring}" if group <= 1 or member == 0 else f"stage {ring} member {member} (runner {slot})"


class Fault(BaseModel):
    """A failure to inject (tests, chaos bench): at `phase`, after `after_steps` steps of this stage.

    `slow` adds `seconds` to every step from `phase` on (a slow machine, still progressing); `drop_message`
    swallows this stage's outgoing ring message of one step; `drop_token` (stage 0) swallows one token event;
    `hold_gil` holds the GIL for `seconds` where the stage builds its constraint tokenizer (as a large
    vocabulary's build does), whatever the phase.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    phase: Literal["load", "warmup", "prefill", "decode"]
    action: Literal[
        "raise",
        "exit",
        "hang",
        "ring_abort",
        "sigkill",
        "sigstop",
        "slow",
        "drop_message",
        "drop_token",
        "hold_gil",
    ]
    after_steps: int = 0
    seconds: float = 0.0


class RunnerSpec(InstanceSettings):
    """One stage of one instance generation, and the settings it runs under (InstanceSettings' fields).

    A stage may be a tensor-parallel group of `group` runners: member 0 (the face) is the stage's place in
    the ring, the others follow their face (dataplane/group.py). `slot` names the runner among its
    instance's runners (its status key, its log, its node agent's record): the ring stage for a face, a slot
    past the ring's stages for another member, whose ring stage is then `position`.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    instance: Name
    generation: int
    slot: int
    stages: int
    model_dir: str  # on the node that runs it; a node agent fills it in from `model` when empty
    model: NameOrEmpty = (
        ""  # the model's name across the cluster (a node without its files fetches the stage)
    )
    namespace: str = "shardline"
    runner_id: str = ""  # set by the node agent: where a Rejoin reaches this process
    layer_start: int
    layer_end: int
    layer_total: int
    connect: list[str]
    listen: list[str] = ["tcp/127.0.0.1:0"]
    window: int = 0  # steps in flight around the ring; 0 = stages + 1
    score_budget: int = 0  # 0 = compute.attention default
    kv_budget_bytes: int = 0  # the leader admits requests while their KV reservations fit; 0 = no limit
    group: int = 1  # runners in this stage's tensor-parallel group
    member: int = 0  # this runner's place in it (0: the face)
    # An expert-parallel group (compute/experts.py): per layer of the stage, the member that holds each routed
    # expert ([] for a dense layer). Empty: a tensor-parallel group, or no group.
    expert_owners: list[list[int]] = []
    # An expert group whose members split attention by heads too (one sum more a layer, half the attention
    # and KV each) instead of each holding it whole; placement chooses (cluster/parallelism.py).
    expert_heads: bool = False
    position: int | None = None  # the ring stage, where `slot` is past the ring's stages
    cpu: int | None = None
    parent_pid: int | None = None
    fault: Fault | None = None

    @property
    def max_waiting(self) -> int:
        """Requests the leader holds unadmitted: a little more than fronts let wait (max_queue)."""
        return self.max_queue + 16

    @property
    def ring(self) -> int:
        """This runner's stage in the ring."""
        return self.slot if self.position is None else self.position

    @property
    def name(self) -> str:
        return runner_name(self.ring, self.member, self.slot, self.group)

    @property
    def is_face(self) -> bool:
        return self.member == 0

    @property
    def is_leader(self) -> bool:
        return self.ring == 0 and self.is_face

    @property
    def is_last(self) -> bool:
        return self.ring == self.stages - 1

    @property
    def next_stage(self) -> int:
        return (self.ring + 1) % self.stages

    @property
    def in_flight_window(self) -> int:
        return self.window or self.stages + 1


def runner_spec(
    settings: Mapping[str, Any],
    *,
    instance: str,
    generation: int,
    slot: int,
    stages: int,
    layers: tuple[int, int, int],
    endpoint: str,
    kv_budget_bytes: int,
    group: int = 1,
    member: int = 0,
    expert_owners: list[list[int]] | None = None,
    expert_heads: bool = False,
    position: int | None = None,
    model_dir: str = "",
    model: str = "",
    namespace: str = "shardline",
    window: int = 0,
    score_budget: int = 0,
    cpu: int | None = None,
    fault: Fault | None = None,
) -> RunnerSpec:
    """The spec of runner `slot` of one generation, for a local engine and a cluster's master alike.

    settings: the InstanceSettings fields it runs under (`settings_fields()`). layers: (start, end, total).
    position: the ring stage of a group's other member, None for a face (its slot is its ring stage).
    endpoint: the zenoh endpoint it connects to; it listens on the same host, on a port of its own.
    """
    host = endpoint.split("/", 1)[1].rpartition(":")[0]
    start, end, total = layers
    return RunnerSpec(
        instance=instance,
        generation=generation,
        slot=slot,
        stages=stages,
        group=group,
        member=member,
        expert_owners=expert_owners or [],
        expert_heads=expert_heads,
        position=position,
        model_dir=model_dir,
        model=model,
        namespace=namespace,
        layer_start=start,
        layer_end=end,
        layer_total=total,
        connect=[endpoint],
        listen=[f"tcp/{host}:0"],
        window=window,
        score_budget=score_budget,
        kv_budget_bytes=kv_budget_bytes,
        cpu=cpu,
        fault=fault,
        **settings,
    )
