"""One download per cluster, as the master decides it (cluster/downloads.py in cluster/master_state.py): a
place query for a hub model that no live node holds names one node to download it, every other query waits
on that same download, and the placement goes ahead once the node holds it whole. Pure: no processes."""

from __future__ import annotations

import pytest

from shardline.cluster import master_state as ms
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from tests.test_master_state import DIGEST, FP, REQ, RES, replies

SOURCE = "org/tiny:Q8_0"
NAME = "org--tiny--Q8_0"


def report(node: str, disk: int, *, holds: bool = False, progress: cm.DownloadProgress | None = None):
    models = {NAME: cm.LocalModel(full=True, footprint=FP.model_copy(update={"name": NAME}), digest=DIGEST)}
    return cm.NodeReport(
        node_id=node,
        name=node,
        endpoint="tcp/127.0.0.1:7447",
        started_at=0.0,
        resources=RES.model_copy(update={"disk_free": disk}),
        models=models if holds else {},
        downloads={NAME: progress} if progress is not None else {},
    )


def cluster(*reports: cm.NodeReport) -> cs.ClusterState:
    s = cs.ClusterState(me="a")
    for r in reports:
        s, _ = cs.apply(s, cs.Alive(r.node_id))
        s, _ = cs.apply(s, cs.ReportIn(r, at=0.0))
    return s


def master(state: cs.ClusterState) -> ms.MasterState:
    return ms.initial(ms.MasterConfig(me="a", report_s=0.5, threads=1), 1, ms.snapshot(state, 0.0, 1000.0))


def seen(s: ms.MasterState, state: cs.ClusterState, now: float = 1.0) -> ms.MasterState:
    s, _ = ms.apply(s, ms.Seen(ms.snapshot(state, now, 1000.0 + now)))
    return s


def ask(s: ms.MasterState, qid: int, via: str = "", at: float = 1.0) -> tuple[ms.MasterState, cm.MasterReply]:
    q = cm.Place(model=NAME, request=REQ, source=SOURCE, via=via, if_absent=True)
    s, out = ms.apply(s, ms.QueryIn(qid, q, salt=f"s{qid}", at=at))
    assert not [c for c in out if isinstance(c, ms.StartInstance)] or replies(out)[0].reply.ok
    return s, replies(out)[0].reply


@pytest.mark.timeout(10)
def test_one_node_downloads_the_one_with_most_disk_and_every_query_waits_on_it():
    nodes = [report("a", 10), report("b", 30), report("c", 20)]
    s = master(cluster(*nodes))
    s, r1 = ask(s, 1)
    assert not r1.ok and r1.download is not None and r1.download.node_id == "b"
    assert "being downloaded" in r1.error and SOURCE in r1.error
    s, r2 = ask(s, 2, via="c", at=2.0)  # a second client, through another node: the same download
    assert r2.download == r1.download and len(s.downloads) == 1
    assert [d.node_id for d in ms.view(s).downloads] == ["b"]
    # b reports progress, then holds the model whole: the download is over and the query places it.
    going = cm.DownloadProgress(source=SOURCE, phase="downloading", done_bytes=5, total_bytes=10)
    s = seen(s, cluster(nodes[0], report("b", 30, progress=going), nodes[2]))
    assert s.downloads and "50%" in ask(s, 3)[1].error
    done = cm.DownloadProgress(source=SOURCE, phase="done", done_bytes=10, total_bytes=10)
    s = seen(s, cluster(nodes[0], report("b", 30, holds=True, progress=done), nodes[2]))
    assert s.downloads == {} and ms.view(s).downloads == []
    s, r4 = ask(s, 4)
    assert r4.ok and r4.download is None and r4.instance is not None and r4.instance.model == NAME


@pytest.mark.timeout(10)
def test_the_node_asked_downloads_when_it_may_and_a_failed_or_dead_downloader_is_replaced():
    nodes = [report("a", 10), report("b", 30), report("c", 20)]
    s = master(cluster(*nodes))
    s, r = ask(s, 1, via="c")
    assert r.download is not None and r.download.node_id == "c"
    failed = cm.DownloadProgress(source=SOURCE, phase="failed", error="hub said 404")
    s = seen(s, cluster(nodes[0], nodes[1], report("c", 20, progress=failed)))
    assert s.downloads[NAME].node_id == "c"  # kept: waiting clients read why
    s, r = ask(s, 2, at=3.0)  # asked again: a new download, on the node chosen now
    assert r.download is not None and r.download.node_id == "b" and r.download.since == 3.0
    s = master(cluster(nodes[0], nodes[2]))  # b is gone
    s, r = ask(s, 3)
    assert r.download is not None and r.download.node_id == "c"


@pytest.mark.timeout(10)
def test_a_new_master_keeps_the_downloads_of_the_last_view_and_previews_download_nothing():
    nodes = [report("a", 10), report("b", 30)]
    s = master(cluster(*nodes))
    s, _ = ask(s, 1)
    state = cluster(*nodes)
    state, _ = cs.apply(state, cs.ViewIn(ms.view(s), 1000.0))
    s2 = master(state)
    assert s2.downloads == s.downloads
    q = cm.Place(model=NAME, request=REQ, source=SOURCE, dry_run=True)
    _, out = ms.apply(master(cluster(*nodes)), ms.QueryIn(9, q, salt="p", at=1.0))
    assert replies(out)[0].reply.download is None and not replies(out)[0].reply.ok
