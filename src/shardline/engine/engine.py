"""One instance on this machine: the facade that wires a node agent, an instance controller and a front.

The three roles talk only through typed messages on zenoh keys (see dataplane/messages.py), as they will
when they live on different machines; here they share one process and one session. The CLI, the benches
and the tests use this one entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import psutil
from platformdirs import user_state_dir
from pydantic import Field

from shardline.cluster.experts import layout_owners
from shardline.cluster.keys import ClusterKeys
from shardline.cluster.placement import split_for_stages
from shardline.compute import tensor_parallel
from shardline.compute.pipeline_limits import pipeline_refusal
from shardline.compute.shard import check_architecture
from shardline.controller.controller import InstanceController, Launch
from shardline.controller.state import ControllerConfig, Failure
from shardline.dataplane import messages as m
from shardline.dataplane.transport import Keys, open_session
from shardline.errors import ContextLengthError, EngineError, OverloadError, RequestError
from shardline.front.front import ModelLimits
from shardline.front.lifecycle import Fronts
from shardline.instance.settings import InstanceSettings
from shardline.instance.slots import runner_slots
from shardline.instance.spec import Fault, RunnerSpec, runner_spec
from shardline.models.errors import CorruptModelError
from shardline.models.footprint import footprint_from_dir
from shardline.node.agent import NodeAgent, stage_log

__all__ = ["ContextLengthError", "Engine", "EngineConfig", "EngineError", "OverloadError", "RequestError"]


class EngineConfig(InstanceSettings):
    model_dir: Path
    stages: int = Field(2, ge=1)
    # Runners per stage: a tensor-parallel group (compute/tensor_parallel.py) of this size, 1: none.
    tp: int = Field(1, ge=1)
    # What a group of `tp` splits: "tensor", every layer by heads and columns; "expert", a MoE model's routed
    # experts, whole, by member (compute/expert_parallel.py), with attention whole on every member.
    group_kind: Literal["tensor", "expert"] = "tensor"
    # Measured tokens routed to each expert, per model layer ([] for a dense layer): an expert group spreads
    # hot experts across its members by them (cluster/experts.py); empty: experts in contiguous blocks.
    expert_load: list[list[float]] = []
    # An expert group's members split attention by heads too, instead of each holding it whole.
    expert_heads: bool = False
    window: int = Field(0, ge=0)
    # KV bytes the leader may reserve for running requests (0: half the memory available at start), as they
    # use it: requests whose prompts do not fit now wait, up to max_queue of them (one more is refused with
    # OverloadError), and when running ones outgrow it the newest goes back to the queue.
    kv_budget_bytes: int = Field(0, ge=0)
    score_budget: int = Field(0, ge=0)
    # Prompts may be this long (0: the model's trained context). Past it the model computes but its output
    # means little: for benchmarks of memory and speed at lengths the model was not trained for.
    context_length: int = Field(0, ge=0)
    pin_cpus: bool = False
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    faults: dict[int, Fault] = {}  # stage -> failure to inject (tests, chaos bench)
    faults_every_generation: bool = False  # False: only the first generation fails, so recovery can succeed
    # exact: replay prompt chunks then emitted tokens as decode steps (fault-free numerics, greedy unchanged);
    # fast: one prefill of prompt + emitted (fewer steps; a near tie can flip). `bench resume` measures both.
    resume: Literal["exact", "fast"] = "exact"

    @property
    def runners(self) -> int:
        return self.stages * self.tp

    def controller(self) -> ControllerConfig:
        # The controller watches runners: a stage's group members are judged like stages of their own.
        return ControllerConfig.of(self, self.runners)


LOGS_KEPT = 20  # engines' stage log folders kept in the state directory (runs that ended with a failure)
LOG_PREFIX = "engine-"


def logs_root() -> Path:
    """Where engines keep their stage logs: the user's state directory (on Linux XDG_STATE_HOME, by
    default ~/.local/state, then shardline/logs), never the temp dir, which nothing bounds or cleans."""
    return Path(user_state_dir("shardline")) / "logs"


def logs_to_drop(folders: list[tuple[str, float]], keep: int) -> list[str]:
    """Of (name, modified time) of earlier engines' log folders, those to remove so that `keep` remain: the
    oldest first."""
    newest_first = sorted(folders, key=lambda f: (f[1], f[0]), reverse=True)
    return [name for name, _ in newest_first[max(0, keep) :]]


def _new_log_dir(instance: str) -> Path:
    """A fresh folder for this engine's stage logs, after dropping the oldest so that at most LOGS_KEPT
    remain with it."""
    root = logs_root()
    root.mkdir(parents=True, exist_ok=True)
    found = []
    for p in root.iterdir():
        if p.name.startswith(LOG_PREFIX) and p.is_dir():
            try:
                found.append((p.name, p.stat().st_mtime))
            except OSError:
                pass  # another engine removed it meanwhile
    for name in logs_to_drop(found, LOGS_KEPT - 1):
        shutil.rmtree(root / name, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{LOG_PREFIX}{instance}-", dir=root))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def read_model_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise EngineError(f"model config {path} is not a JSON object")
    try:
        check_architecture(config)
    except ValueError as exc:
        raise EngineError(str(exc)) from exc
    return config


def _stage_ranges(model_dir: Path, stages: int) -> list[tuple[int, int]]:
    config = json.loads((model_dir / "config.json").read_text())
    if why := pipeline_refusal(str(config.get("model_type") or ""), stages):
        raise EngineError(why)
    try:
        return split_for_stages(footprint_from_dir(model_dir), stages)
    except CorruptModelError as exc:
        raise EngineError(f"cannot use model {model_dir}: {exc}") from exc


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = read_model_config(config.model_dir)
        self.layers = int(self.model_config.get("num_hidden_layers") or 0)
        try:
            if config.group_kind == "tensor":
                tensor_parallel.check_split(self.model_config, config.tp)
        except tensor_parallel.GroupSumError as exc:
            raise EngineError(f"cannot split {config.model_dir.name} for --tp {config.tp}: {exc}") from exc
        # Before anything is opened: a model whose weight files are unreadable fails here, and leaves nothing.
        self._ranges = (
            _stage_ranges(config.model_dir, config.stages) if 1 <= config.stages <= self.layers else []
        )
        # Each stage's expert map, per held layer (RunnerSpec.expert_owners); empty: no expert groups.
        self.expert_owners = self._expert_owners() if config.tp > 1 and config.group_kind == "expert" else []
        trained = int(self.model_config.get("max_position_embeddings") or 2**31)
        self.context_length = config.context_length or trained
        self.instance = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        self._start_failure: str | None = None
        env_dir = os.environ.get("SHARDLINE_LOG_DIR")
        log_dir = config.log_dir or (Path(env_dir) if env_dir else None)
        # A folder of its own is removed after a clean run; one the caller named is the caller's.
        self._own_logs = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else _new_log_dir(self.instance)
        self.endpoint = f"tcp/{config.host}:{_free_port(config.host)}"
        self.session = open_session([self.endpoint], [])
        self.kv_budget_bytes = config.kv_budget_bytes or int(psutil.virtual_memory().available * 0.5)
        self.instance_keys = Keys(self.instance)
        self.agent_key = agent_key = ClusterKeys().agent(f"local-{self.instance}")
        self.agent = NodeAgent(self.session, agent_key, self.log_dir, allow_faults=True)  # tests inject them
        limits = ModelLimits(int(self.model_config.get("vocab_size") or 2**31), self.context_length)
        self.fronts = Fronts(self.session, self.instance_keys.namespace)
        self.front = self.fronts.open(
            self.instance, limits, start=False, max_queue=config.max_queue, resume=config.resume
        )
        # Requests go to the front as they are: one piece of code validates and submits for every caller.
        self.submit = self.front.submit
        self.cancel = self.front.cancel
        hidden = int(self.model_config.get("hidden_size") or 1024)
        self.controller = (
            InstanceController(
                self.session,
                self.instance_keys,
                config.controller(),
                lambda generation: self._layout(agent_key, generation),
                self.kv_budget_bytes,
                attn_keys=6 * hidden,
            )
            if 1 <= config.stages <= self.layers
            else None
        )

    def _layout(self, agent_key: str, generation: int) -> list[Launch]:
        """Every stage on this machine's agent, the layers split by placement's cost model (the head's stage
        gets fewer), so that equal cores take about equally long."""
        launches = []
        for slot, (stage, member) in enumerate(runner_slots(len(self._ranges), self.config.tp)):
            start, end = self._ranges[stage]
            spec, threads = self._spec_for(generation, slot, start, end, member, stage if member else None)
            launches.append((agent_key, m.StartRunner(spec=spec, threads=threads)))
        return launches

    def _expert_owners(self) -> list[list[list[int]]]:
        """Each stage's expert map (cluster/experts.py): by measured load where given, else by bytes."""
        fp = footprint_from_dir(self.config.model_dir)
        if fp.expert_split:
            raise EngineError(f"cannot run {self.config.model_dir.name} in expert groups: {fp.expert_split}")
        try:
            return layout_owners(fp, self._ranges, self.config.tp, load=self.config.expert_load or None)
        except ValueError as exc:
            raise EngineError(f"cannot place {self.config.model_dir.name}'s experts: {exc}") from exc

    def _spec_for(
        self, generation: int, slot: int, start: int, end: int, member: int = 0, position: int | None = None
    ) -> tuple[RunnerSpec, int]:
        """Runner `slot` (a face's slot is its ring stage; a group member's ring stage is `position`), and the
        threads it may use."""
        cfg = self.config
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        inject = cfg.faults if (generation == 0 or cfg.faults_every_generation) else {}
        stage = slot if position is None else position
        spec = runner_spec(
            cfg.settings_fields(),
            instance=self.instance,
            generation=generation,
            slot=slot,
            stages=cfg.stages,
            layers=(start, end, self.layers),
            endpoint=self.endpoint,
            kv_budget_bytes=self.kv_budget_bytes,
            group=cfg.tp,
            member=member,
            expert_owners=self.expert_owners[stage] if self.expert_owners else None,
            expert_heads=cfg.expert_heads,
            position=position,
            model_dir=str(cfg.model_dir),
            window=cfg.window,
            score_budget=cfg.score_budget,
            cpu=cpus[slot % len(cpus)] if cfg.pin_cpus else None,
            fault=inject.get(slot),
        )
        return spec, 1 if cfg.pin_cpus else max(1, len(cpus) // cfg.runners)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> Engine:
        """Bring the first generation up, retrying within the restart budget; raise if it cannot."""
        if self.controller is None:
            self.shutdown()
            raise EngineError(
                f"{self.config.stages} stages requested, the model has only {self.layers} layers"
            )
        with self._lock:
            if self._closed:
                raise EngineError("engine is shut down")
            if self._started:
                return self
            self._started = True
            self.front.start()
            self.agent.start()
            self.controller.start(wait_for=10.0)
        cfg = self.config
        bound = (cfg.max_restarts + 1) * (cfg.load_timeout + cfg.backoff_max_s) + 30
        phase = self.controller.wait_settled(bound)
        if phase == "serving":
            self.front.serving.wait(self.front.match_timeout + 5)
        if phase != "serving" or not self.front.serving.is_set() or self.front.failure:
            why = self.controller.state.failure or self.front.failure or f"instance not serving ({phase})"
            self._start_failure = why  # its logs are kept: they say why
            self.shutdown()
            raise EngineError(why)
        return self

    def shutdown(self, grace: float = 5.0) -> None:
        """Every handle ends, every runner of every generation is stopped and reaped. Safe from any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.fronts.close_all("engine shut down")
        if self.controller is not None:
            self.controller.stop(grace)
        self.agent.close(grace)
        try:
            self.session.close()
        except Exception:
            pass
        if self._own_logs and self.clean:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- what the roles know -----------------------------------------------------------------------------

    @property
    def recoveries(self) -> list[Failure]:
        return list(self.controller.state.failures) if self.controller else []

    @property
    def clean(self) -> bool:
        """Nothing failed: no stage had to be recovered, and the instance did not fail (its logs hold
        nothing to look into)."""
        return not self.recoveries and self.failure is None and self._start_failure is None

    @property
    def failure(self) -> str | None:
        return self.controller.state.failure if self.controller else None

    @property
    def serving(self) -> bool:
        return self.controller is not None and self.controller.state.phase == "serving"

    @property
    def generation(self) -> int:
        return self.controller.state.generation if self.controller else -1

    @property
    def keys(self) -> Keys:
        return self.instance_keys.at(self.generation)

    def stage_log(self, stage: int) -> Path:
        return stage_log(self.log_dir, self.instance, stage)

    def runner_pids(self) -> list[int]:
        """The current generation's runner processes, by stage."""
        return self.agent.pids(self.generation)

    def paths(self) -> list[str]:
        """Each ready runner's compute path, by slot: "fast", or "generic: " and why ("" before Ready)."""
        assert self.controller is not None
        with self.controller._cond:
            return [v.ready.path if v.ready is not None else "" for v in self.controller.state.views]

    def all_runner_pids(self) -> list[int]:
        return self.agent.all_pids()

    def fresh_heartbeats(self, timeout: float) -> list[m.Heartbeat]:
        """Wait for one heartbeat from every stage sent after this call (runner counters are then current)."""
        beats = self.controller.fresh_heartbeats(timeout) if self.controller else None
        if beats is None:
            raise EngineError(f"no heartbeat from every stage within {timeout:.0f}s")
        return beats

    def dropped(self) -> dict[str, int]:
        """Messages each role refused (unparsable, another generation, unknown stage)."""
        return {"front": self.front.dropped, "controller": self.controller.dropped if self.controller else 0}

    def wait_recovered(self, count: int, timeout: float) -> bool:
        """True once `count` failures were recovered from and the instance serves again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.recoveries
            if len(recs) >= count and all(r.recovered_at for r in recs) and self.front.serving.is_set():
                return True
            self.front.serving.wait(0.05)
        return False
