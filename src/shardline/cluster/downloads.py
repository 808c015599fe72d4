"""One download per cluster: which node fetches a model that no live node holds (pure decisions).

The master keeps one `Download` per model (in its state and its view). The node named downloads the model
into its models directory and says how far it got in its reports; once its copy is whole and hashed, the
master places the model as any other, and the other nodes copy their stages from that node, verified
(cluster/weights/). No other node ever contacts the hub for it.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardline.cluster import messages as cm
from shardline.cluster.state import ClusterState


def named(model: str) -> tuple[str, str]:
    """(name, source) of what a client names: a model name as the cluster lists it, or a hub repository
    (`org/name[@revision][:QUANT]`), whose name is the one its download is kept under and whose source one
    node downloads it from for everyone."""
    from shardline.models.hub import parse_repo_ref

    ref = parse_repo_ref(model) if "/" in model else None
    return (ref.model_name, model) if ref is not None else (model, "")


def held(snap: ClusterState, model: str) -> bool:
    """A live node holds the whole model with its digest recorded: the download (if any) is over."""
    return any(
        n in snap.alive | {snap.me} and (m := r.models.get(model)) is not None and m.full and bool(m.digest)
        for n, r in snap.reports.items()
    )


def progress(snap: ClusterState, d: cm.Download) -> cm.DownloadProgress | None:
    """What the downloading node last reported of this download (None: nothing yet)."""
    r = snap.reports.get(d.node_id)
    p = r.downloads.get(d.model) if r is not None else None
    return p if p is not None and p.source == d.source else None


def _usable(snap: ClusterState, d: cm.Download) -> bool:
    """The download can still end: its node is alive and has not said it failed."""
    r = snap.reports.get(d.node_id)
    if d.node_id not in snap.alive | {snap.me} or r is None or r.leaving:
        return False
    p = progress(snap, d)
    return p is None or p.phase != "failed"


def downloader(snap: ClusterState, via: str) -> str | None:
    """The node to download: the one the client asked through when it may hold weights, else the live one
    with the most free disk (ties: the node id, so every master picks the same)."""
    live = [
        (r.resources.disk_free, n)
        for n, r in snap.reports.items()
        if n in snap.alive | {snap.me} and r.holds_stages and not r.leaving
    ]
    if any(n == via for _, n in live):
        return via
    return max(live, key=lambda t: (t[0], t[1]))[1] if live else None


def ask(
    downloads: Mapping[str, cm.Download], snap: ClusterState, model: str, source: str, via: str, at: float
) -> tuple[dict[str, cm.Download], cm.Download | None]:
    """The download of `model` a place query waits on: the running one, or a new one (a failed or orphaned
    one is asked again, of the node chosen now). None: no node could download it."""
    current = downloads.get(model)
    if current is not None and current.source == source and _usable(snap, current):
        return dict(downloads), current
    node = downloader(snap, via)
    rest = {k: v for k, v in downloads.items() if k != model}
    if node is None:
        return rest, None
    d = cm.Download(model=model, source=source, node_id=node, since=at)
    return {**rest, model: d}, d


def settle(downloads: Mapping[str, cm.Download], snap: ClusterState) -> dict[str, cm.Download]:
    """Drop the downloads that are over: the model is held whole by a live node. Failed ones stay, so that
    waiting clients read why, until a place query asks again."""
    return {k: d for k, d in downloads.items() if not held(snap, k)}


def waiting_reason(snap: ClusterState, d: cm.Download) -> str:
    """The place query's answer while the download runs, in a sentence."""
    p = progress(snap, d)
    done = ""
    if p is not None and p.total_bytes:
        done = f" ({p.done_bytes / p.total_bytes:.0%} of {p.total_bytes / 1e9:.2f} GB)"
    return f"model {d.model!r} is being downloaded from {d.source} by node {d.node_id}{done}"


def wait_on(
    downloads: Mapping[str, cm.Download], snap: ClusterState, q: cm.Place, at: float, term: int
) -> tuple[dict[str, cm.Download], cm.MasterReply, cm.ClusterEvent | None]:
    """The master's answer to a place query for a model no live node holds, named with a source: the
    downloads after it, the reply (the download to wait on, or why none can run), and a new one's event."""
    held, d = ask(downloads, snap, q.model, q.source, q.via, at)
    if d is None:
        error = f"model {q.model!r} is on no live node, and no live node may download it"
        return held, cm.MasterReply(ok=False, error=error, term=term), None
    reply = cm.MasterReply(ok=False, error=waiting_reason(snap, d), download=d, term=term)
    new = d.since == at  # asked now, not a running one
    event = cm.ClusterEvent(at=at, kind="download", node=d.node_id, message=f"{q.model} from {d.source}")
    return held, reply, event if new else None
