"""What crosses between nodes and the master: node reports, the master's view, and queries to the master.

One tagged union per channel, as in dataplane/messages.py: models ignore unknown fields so a newer node
never wedges an older one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from shardline.cluster.placement import Placement, PlacementRequest
from shardline.dataplane.messages import Wire
from shardline.models.footprint import ModelFootprint
from shardline.trust.names import Name

InstancePhase = Literal["placed", "weights", "loading", "warming", "ready", "recovering", "failed"]


# ---- node -> everyone: the node's own facts, republished on a period ---------------------------------------


class Resources(Wire):
    memory_total: int
    memory_available: int  # what placement may use now: the --memory-limit share less what runners hold
    memory_limit: int | None = None
    compute_score: float  # GFLOP/s of a short float32 matmul on the node's MLX device
    device: str
    cpus: int
    read_gbps: float = 0.0  # memory read bandwidth, measured at start (what a decode step's weights cost)
    disk_free: int = 0  # bytes free where the node keeps its models (who downloads a model none holds)


class LinkFact(Wire):
    """A node's measurement of its link to a peer: a small query's round trip, and bulk bandwidth."""

    rtt_us: float
    bytes_per_s: float


class LocalModel(Wire):
    """A model whose files are on the node: whole (with its footprint), or one stage's layer range."""

    full: bool
    start: int = 0
    end: int = 0
    footprint: ModelFootprint | None = None
    # The model digest (models/store/manifest.py): of its import record, or the one a stage was checked
    # against; "" while a whole model is still being hashed. Short: the per-file digests stay on the node.
    digest: str = ""
    imported_at: float = 0.0  # a whole model: when its digests were recorded (for people: it decides nothing)


class DownloadProgress(Wire):
    """A model this node downloads for the cluster (the master asked it: ClusterView.downloads)."""

    source: str  # the reference it downloads (a hub repository, org/name[@revision][:QUANT])
    phase: Literal["downloading", "importing", "done", "failed"]
    done_bytes: int = 0
    total_bytes: int = 0  # 0 while unknown
    error: str = ""  # failed: why, in one line


class RunnerInfo(Wire):
    instance: str
    generation: int
    slot: int  # the runner among its instance's runners (RunnerSpec.slot)
    start: int
    end: int
    pid: int | None = None  # None while the stage's weights are being fetched
    issued: tuple[int, int] = (0, 0)  # (term, view seq) of the master when it started this runner


class NodeReport(Wire):
    kind: Literal["node_report"] = "node_report"
    node_id: str
    name: str
    endpoint: str  # where peers (and runners) connect to this node's session
    started_at: float  # wall clock
    holds_stages: bool = True  # False: never holds a stage (--no-stages)
    api: str = ""  # the node's HTTP API (http://host:port), "" without one
    leaving: bool = False  # its last report: it is shutting down
    resources: Resources
    models: dict[str, LocalModel] = {}
    runners: list[RunnerInfo] = []
    term: int = 0  # the highest master term this node has seen: a new master learns it from reports
    config: tuple[int, int] = (0, 0)  # (term, version) of the membership it holds: its acknowledgement
    ballot_term: int = 0  # the highest term it voted or was asked for votes in: campaigns ask above it
    instances: list[InstanceRecord] = []  # as of the newest view it saw: nothing lives only in the master
    notices: list[ClusterEvent] = []  # its newest own events (a weight source refused): every node folds them
    links: dict[str, LinkFact] = {}  # peer node -> its measured link to it (placement's tensor parallelism)
    downloads: dict[str, DownloadProgress] = {}  # model name -> this node's download of it for the cluster


# ---- master -> everyone: the cluster as the master sees it -------------------------------------------------


class StageRecord(Wire):
    """One runner of an instance, in slot order (instance/slots.py: runner_slots)."""

    node_id: str
    start: int
    end: int
    ring: int | None = None  # its stage in the ring, where it is a tensor-parallel member (slot != stage)
    member: int = 0  # its place in its stage's group (0: the face, or a pipeline stage)
    phase: str = "placed"
    pid: int | None = None
    weights_done: int = 0
    weights_total: int = 0
    # How it computes its layers: "fast" (llama-shaped blocks in native ops), or "generic: " and why not
    # (compute/shard.py); "" until it is ready.
    path: str = ""
    # An expert-parallel group's face: per layer of its stage, the member holding each routed expert ([] for
    # a dense layer; cluster/experts.py). Its members run by their face's; [] for any other runner.
    expert_owners: list[list[int]] = []
    expert_heads: bool = False  # its expert group's members split attention by heads too (its face's)


class InstanceRecord(Wire):
    instance: str
    model: str
    generation: int = -1
    phase: InstancePhase = "placed"
    why: str = ""
    stages: list[StageRecord] = []
    request: PlacementRequest = PlacementRequest()
    kv_bytes_per_token: int = 0
    kv_budget_bytes: int = 0
    vocab_size: int = 0
    context_length: int = 0
    recoveries: int = 0
    created_at: float = 0.0  # wall clock
    digest: str = ""  # the model digest every copy of its stages must have (state.py: expected_digest)
    weight_format: str = ""  # how its weights are stored (ModelFootprint.weight_format), for people
    layout: str = ""  # pipeline or tensor-parallel groups, and why (cluster/parallelism.py), for people
    # Measured routing: per model layer, tokens routed to each of its experts ([] where unmeasured). Where
    # it is, a new expert map spreads the hot experts (cluster/experts.py: owners_by_load).
    expert_load: list[list[float]] = []


class NodeSummary(Wire):
    node_id: str
    name: str
    endpoint: str
    alive: bool
    resources: Resources | None = None
    models: list[str] = []
    api: str = ""
    leaving: bool = False  # shutting down: its instances are being moved
    left_at: float | None = None  # not alive: when it was last seen (wall clock)
    downloads: dict[str, DownloadProgress] = {}  # as its report says (the dashboard's progress bars)


class ClusterEvent(Wire):
    at: float  # wall clock
    kind: Literal[
        "join",
        "leave",
        "master",
        "placed",
        "ready",
        "failure",
        "recovered",
        "failed",
        "removed",
        "weights",
        "download",
    ]
    node: str = ""
    instance: str = ""
    message: str = ""
    pause_s: float | None = None  # recovered: how long the instance did not serve


class Membership(Wire):
    """The agreed membership whose quorum elects a master (cluster/election.py). It changes one node at a
    time: the master proposes `members` (committed=False, changing `base`) and commits it once a quorum of
    both hold it (their reports' `config`)."""

    members: list[str]
    version: int = 1  # counts changes
    term: int = 0  # the master term that proposed this version: (term, version) orders memberships
    committed: bool = True
    base: list[str] = []  # while not committed: the committed membership it changes

    def key(self) -> tuple[int, int]:
        return (self.term, self.version)


class Download(Wire):
    """The master's word that one node downloads `model` from `source` for the whole cluster: the others
    copy its stages from that node (cluster/weights), never from the hub."""

    model: str
    source: str
    node_id: str
    since: float  # wall clock, when it was asked


class ClusterView(Wire):
    kind: Literal["view"] = "view"
    term: int
    master: str
    seq: int = 0  # counts this master's views: a view older than a command does not judge its runners
    membership: Membership | None = None  # the agreed membership (None: an older master's view)
    nodes: list[NodeSummary] = []
    instances: list[InstanceRecord] = []
    events: list[ClusterEvent] = []  # the newest few, oldest first
    downloads: list[Download] = []  # models being downloaded for the cluster, one node each


ReportMessage = Annotated[NodeReport | ClusterView, Field(discriminator="kind")]
REPORTS = TypeAdapter(ReportMessage)


# ---- node -> everyone: elections (cluster/election.py) --------------------------------------------------


class Claim(Wire):
    """A candidate asks for votes for `term`; `members` is everyone whose quorum it needs; `membership` the
    agreed membership it holds (None: a fresh cluster forming its first), which voters compare with theirs."""

    kind: Literal["claim"] = "claim"
    term: int
    candidate: str
    members: list[str]
    membership: Membership | None = None


class Vote(Wire):
    kind: Literal["vote"] = "vote"
    term: int
    candidate: str
    voter: str


BallotMessage = Annotated[Claim | Vote, Field(discriminator="kind")]
BALLOTS = TypeAdapter(BallotMessage)


# ---- client -> master: queries, answered by whichever node is master ---------------------------------------


class Place(Wire):
    kind: Literal["place"] = "place"
    model: Name
    request: PlacementRequest = PlacementRequest()
    dry_run: bool = False
    # Place only when the model has no live instance, else answer with that one (the API's auto-place:
    # requests through different nodes may ask for the same model at once).
    if_absent: bool = False
    nonce: str = ""  # the same query sent again (a retry) is answered once
    # Where the model comes from when no live node holds it (a hub reference, models/hub.py): one node
    # downloads it for everyone. "" : placed only from the copies nodes hold.
    source: str = Field("", max_length=512)
    via: str = ""  # the node the client asked through: it downloads, when it has the room


class Remove(Wire):
    kind: Literal["remove"] = "remove"
    instance: Name
    nonce: str = ""


class Forget(Wire):
    """An operator's word that a member that died will not return: the master removes it from the agreed
    membership (a committed change), so that it no longer counts against the quorum."""

    kind: Literal["forget"] = "forget"
    node: Name
    nonce: str = ""


MasterQuery = Annotated[Place | Remove | Forget, Field(discriminator="kind")]
QUERY = TypeAdapter(MasterQuery)


class MasterReply(Wire):
    ok: bool
    error: str = ""
    term: int = 0
    placement: Placement | None = None
    instance: InstanceRecord | None = None
    runners: list[StageRecord] = []  # what would be launched: the placement's stages, or its groups
    layout: str = ""  # pipeline or groups, and why
    download: Download | None = None  # not placed yet: this download must end first (then ask again)


NodeReport.model_rebuild()
