"""What a node is told: its settings (the `shardline node` flags), and the endpoint it listens on."""

from __future__ import annotations

import socket
from pathlib import Path

from platformdirs import user_data_dir
from pydantic import BaseModel, ConfigDict, Field

from shardline.api.service import ApiSettings
from shardline.instance.settings import InstanceSettings
from shardline.models.registry import cache_dir
from shardline.trust.credentials import Credentials


class ClusterInstanceSettings(InstanceSettings):
    """How a master configures the runners it starts and judges them: instance settings, its own policy."""

    reuse_survivors: bool = True  # after a failure, stages it did not blame keep their process and weights


class NodeConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    namespace: str = Field("shardline", pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    listen: str = "tcp/127.0.0.1:0"  # port 0: a free one is chosen
    peers: list[str] = []
    multicast_interface: str | None = None  # multicast scouting on this interface; None: off
    allow_faults: bool = False  # obey commands that inject faults: only for tests and benches
    credentials: Credentials = Credentials()  # the cluster key and TLS folder; none: an open cluster
    data_dir: Path | None = None
    models_dir: Path | None = None  # None: the model cache (where `shardline models pull` imports)
    memory_limit: int | None = Field(None, gt=0)
    holds_stages: bool = True  # False: this node never holds a stage (it may still be master and serve)
    name: str | None = None
    threads: int = Field(0, ge=0)  # per runner; 0: the machine's cores over the stages it holds
    compute_score: float | None = Field(None, gt=0)  # None: measured at start
    report_s: float = Field(0.5, gt=0)
    lease_ms: int = Field(2000, ge=200)
    settle_s: float = Field(1.5, ge=0)  # listen this long for a sitting master before claiming
    runners: ClusterInstanceSettings = ClusterInstanceSettings()
    api: ApiSettings | None = None  # the HTTP API this node serves; None: none

    def resolved_data_dir(self) -> Path:
        return self.data_dir or Path(user_data_dir("shardline")) / "node"

    def resolved_models_dir(self) -> Path:
        return self.models_dir or cache_dir()


def concrete_endpoint(endpoint: str) -> str:
    """tcp/HOST:0 -> tcp/HOST:<a free port>: runners and peers must know the real port."""
    proto, _, rest = endpoint.partition("/")
    host, _, port = rest.rpartition(":")
    if port != "0":
        return endpoint
    with socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return f"{proto}/{host}:{s.getsockname()[1]}"
