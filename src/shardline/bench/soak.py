"""`shardline bench soak`: minutes of HTTP load near capacity through every node of a local cluster, chaos.

A local N-node cluster places the model, then K client threads send chat completions (streamed and whole,
temperature 0 and a fixed seed) with the official `openai` client to every node's HTTP port in turn, for the
whole run. Meanwhile, at random (seeded) intervals: a node is SIGKILLed and restarted, a node or a runner is
SIGSTOPped for a bounded pause and SIGCONTed, and raw httpx clients hang up before the first byte or after a
few bytes.

Nothing goes on the machine's real interfaces. Without network namespaces the nodes use loopback endpoints
with multicast scouting off. With them (`--netns`, the default as root), each node runs in its own host of a
`NetLab` and the clients in one more: every thread of the soak that speaks HTTP to the nodes runs inside the
client host's namespace (`NetLab.inside`), since from the root namespace the lab's addresses would be routed
out of the machine. A further fault then unplugs a node's cable for a few seconds (`link_flap`), and another
cuts the switch in two (`partition`): the master and one other node (the master alone below five nodes) on one
side, the other nodes and the client host on the other, held for 10-20 s (5-10 leases of 2 s: the majority
elects a new master meanwhile), then healed. The clients stay with the majority, so a request to a minority
node's front started during the cut cannot connect and goes to the next node; one that was in flight at a
minority front waits for the heal (the front resubmits what it holds once it hears the new generation).

Throughout the run (`abusive_client`), one more client sends one request a second (at most 4 in flight) with
the largest body the chat API accepts: `n` at its cap, as many biased tokens as the API allows (OpenAI's 300
where it names no cap), the most and longest stop strings, the longest schema; between two of those, the same
body with one parameter one past its cap, or a full-vocabulary or duplicated `logit_bias`. The caps are read
from the API's code (bench/chaos.py: api_limits). Each must be served (200 with `n` choices) or refused with a
400; anything else is a failure.

What counts:
- every greedy answer must equal the first clean answer to the same prompt (taken before the chaos starts);
- requests_lost: requests a node accepted that never got an answer within the deadline, or got a wrong one;
  429/503 refusals are `refused`; a failed connection (a node down) is `unreachable`, and the client retries
  on the next node; a request whose own node was SIGKILLed under it is `cut_by_node_kill` (its front is gone,
  as the design allows), not lost; one that ended in an error (an HTTP error status, a broken stream or
  connection) while its node was on the minority side of a partition is `cut_by_partition` (its own node was
  cut off: the design allows an error there), not lost and not in http_5xx (kept apart, with examples); one
  that got no answer within the deadline is lost wherever its node was;
- http_5xx, leaked_slots (`pending` of /health, or `shardline_requests_pending` of /metrics, once idle),
  rss_growth_ratio per node, orphan_processes, time to first token, the faults done;
- masters_per_term_max: the most distinct masters any term had, over what every node said (its /state, asked
  from inside the node's own namespace, so a cut-off side is heard during a partition too);
- instance_failures: instances that any node ever listed as failed (phase or event), which fails every
  request on them;
- abusive_client: per variant, how many were served, refused with a 400, or failed (and why).

Here: the run and its report. The parts, one job each: soak_cluster.py (the nodes as the soak reaches them),
soak_load.py (the clients), soak_faults.py (the faults drawn, and when each happened), soak_watch.py (what is
sampled while it runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from shardline.bench.soak_cluster import SoakCluster
from shardline.bench.soak_faults import (
    FAULT_INTERVAL_S,
    FAULT_KINDS,
    Chaos,
    FaultRecord,
    fault_kinds,
    use_netns,
)
from shardline.bench.soak_load import QUESTIONS, Load
from shardline.bench.soak_watch import MARKER, ORPHAN_GRACE_S, Watch
from shardline.testing.cluster import FAST_RUNNERS, MODEL_RUNNERS, LabCluster, LocalCluster
from shardline.testing.netns import Host, NetLab, open_lab

LAB_NAME = "slsoak"  # the lab's namespaces: slsoak-br, slsoak-0.. (slsoak2-.. while another soak runs)

TARGETS = {
    "requests_lost": "== 0",
    "http_5xx": "== 0",
    "leaked_slots": "== 0",
    "orphan_processes": "== 0",
    "masters_per_term_max": "== 1",
    "instance_failures": "== 0",
    "abusive_client": "every request served or refused with a 400",
    "abusive_as_expected": "the largest body served, every one past a cap refused with a 400",
    "rss_growth_ratio": "<= 1.05",
}


def tiny_chat_model(path: Path, seed: int = 0) -> Path:
    """A tiny random llama with the default model's tokenizer (so the HTTP API can tokenize chats)."""
    from shardline.models.registry import resolve_model
    from shardline.testing.tiny import make_tiny_model

    src = resolve_model(None, progress=False)
    vocab = int(json.loads((src / "config.json").read_text())["vocab_size"])
    make_tiny_model(path, "llama", seed=seed, vocab=vocab, layers=6)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    return path


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, round(q * (len(s) - 1)))], 3)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


class Soak:
    """One soak: the cluster as reached over HTTP (nodes), the load, the chaos and the watch, and the
    record of the faults done that the load's outcomes are judged against."""

    def __init__(
        self,
        cluster: LocalCluster,
        model: str,
        seconds: float,
        concurrency: int,
        seed: int,
        max_tokens: int,
        deadline_s: float,
        recover_s: float,
        fault_interval_s: float,
        fault_kinds: tuple[str, ...] = FAULT_KINDS,
        lab: NetLab | None = None,
        client_host: Host | None = None,
        vocab: int | None = None,
        run_id: str = "",
    ) -> None:
        self.seconds = seconds
        self.concurrency = concurrency
        self.seed = seed
        self.nodes = SoakCluster(cluster, model, lab, client_host)
        self.record = FaultRecord()
        abusive = "abusive_client" in fault_kinds
        self.load = Load(self.nodes, self.record, seed, max_tokens, deadline_s, abusive, vocab)
        self.chaos = Chaos(self.nodes, self.record, seed, seconds, fault_interval_s, recover_s, fault_kinds)
        self.watch = Watch(self.nodes, self.record, run_id)

    def run(self) -> dict[str, Any]:
        """The load, the chaos and the watch for `seconds`; then the wait for every request and fault to
        end, and the report."""
        nodes, load, watch = self.nodes, self.load, self.watch
        nodes.t0 = time.monotonic()
        threads = [
            threading.Thread(target=load.worker, args=(w,), daemon=True) for w in range(self.concurrency)
        ]
        threads += [
            threading.Thread(target=self.chaos.run, daemon=True),
            threading.Thread(target=load.disconnector, daemon=True),
        ]
        if load.abusive:
            threads.append(threading.Thread(target=load.abuser, daemon=True))
        sampler = threading.Thread(target=watch.run, daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        try:
            nodes.stop.wait(self.seconds)
            t_end = time.monotonic()
            nodes.load_over.set()
            # Every request still out ends by its deadline; a fault in progress ends with its recovery.
            join_by = time.monotonic() + load.deadline_s + self.chaos.recover_s + 30
            for t in threads:
                t.join(max(0.1, join_by - time.monotonic()))
            nodes.wait_healthy(self.chaos.recover_s)
            leaked = None
            idle_by = time.monotonic() + 20
            while time.monotonic() < idle_by:
                leaked = watch.pending()
                if not leaked:
                    break
                nodes.stop.wait(1.0)
            watch.check_orphans()
        finally:
            nodes.stop.set()
            nodes.load_over.set()
            sampler.join(5)
        c, done = load.c, self.record.done
        ratios = {nid: watch.daemon_rss_ratio(nid, nodes.t0, t_end) for nid in nodes.ids}
        across = {nid: watch.rss_ratio(nid, nodes.t0, t_end) for nid in nodes.ids}
        return {
            "minutes": round(self.seconds / 60, 3),
            "nodes": len(nodes.ids),
            "model": nodes.model,
            "concurrency": self.concurrency,
            "fault_interval_s": round(self.chaos.interval_s, 1),
            "netns": nodes.lab is not None,
            "fault_kinds": list(self.chaos.kinds),
            "seed": self.seed,
            "requests_ok": c.ok,
            "requests_lost": c.lost,
            "wrong_answers": c.wrong,
            "timed_out": c.timed_out,
            "refused": c.refused,
            "unreachable": c.unreachable,
            "cut_by_node_kill": c.cut,
            "cut_by_partition": c.cut_by_partition,
            "clients_during_partition": "with the majority" if "partition" in self.chaos.kinds else None,
            "stale_connection_after_flap": c.cut_by_flap,  # or after a partition
            "http_5xx": c.http_5xx,
            "leaked_slots": leaked,
            "rss_growth_ratio": ratios,
            "rss_growth_ratio_across_restarts": across,  # the node's last fifth over its first, any process
            "runner_rss_growth_ratio": watch.runner_ratios(nodes.t0, t_end),
            "rss_mb_each_minute": watch.rss_series(),
            "orphan_processes": len(watch.orphans),
            "masters_per_term_max": max((len(v) for v in watch.masters.values()), default=None),
            "terms_seen": sorted(watch.masters),
            "masters_by_term": {str(t): sorted(m) for t, m in sorted(watch.masters.items())},
            "instance_failures": len(watch.failed_instances),
            "failed_instances": dict(watch.failed_instances),
            "ttft_p50_s": _pct(c.ttft, 0.5),
            "ttft_p99_s": _pct(c.ttft, 0.99),
            "kills": done["kills"],
            "stops": done["stops"],
            "link_flaps": done["link_flaps"],
            "partitions": done["partitions"],
            "disconnects": c.disconnects,
            "abusive_client": (
                load.abuse.report(load.limits, {v: len(b) for v, b in load.abusive.items()}, self.seconds)
                if load.abusive
                else None
            ),
            "faults": self.chaos.log,
            "instances_final": [
                {k: i.get(k) for k in ("instance", "phase", "generation", "recoveries")}
                for i in nodes.state().get("instances", [])
            ],
            "lost_examples": c.lost_examples,
            "http_5xx_examples": c.http_5xx_examples,
            "cut_by_partition_examples": c.cut_by_partition_examples,
            "machine": _cpu(),
        }


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _targets(r: dict[str, Any]) -> dict[str, bool | None]:
    """Each target of TARGETS met (True), missed (False), or not measured in this run (None)."""
    rss = [v for v in (r["rss_growth_ratio"] or {}).values() if v is not None]
    rss += list((r.get("runner_rss_growth_ratio") or {}).values())
    abuse = r.get("abusive_client")
    return {
        "requests_lost": r["requests_lost"] == 0,
        "http_5xx": r["http_5xx"] == 0,
        "leaked_slots": None if r["leaked_slots"] is None else r["leaked_slots"] == 0,
        "orphan_processes": r["orphan_processes"] == 0,
        "masters_per_term_max": r["masters_per_term_max"] == 1,
        "instance_failures": r["instance_failures"] == 0,
        "abusive_client": None if not abuse else abuse["failures"] == 0 and abuse["sent"] > 0,
        "abusive_as_expected": None if not abuse else abuse["unexpected"] == 0 and abuse["sent"] > 0,
        "rss_growth_ratio": all(v <= 1.05 for v in rss) if rss else None,
    }


def _abuse_line(a: dict[str, Any] | None) -> str:
    if not a:
        return "off"
    return (
        f"{a['sent']} sent: {a['served']} served, {a['refused_400']} refused (400), {a['failures']} failed, "
        f"{a['unexpected']} not as expected, {a['skipped_ticks']} ticks skipped"
    )


def _cluster(root: Path, ids: list[str], model_dir: Path, tiny: bool, lab: NetLab | None) -> LocalCluster:
    """The nodes on loopback, or each in its own host of the lab (hosts 0..n-1; the last host is the
    clients')."""
    settings: dict[str, Any] = {
        "extra": ["--prefill-step", "8" if tiny else "64"],
        "runners": dict(FAST_RUNNERS if tiny else MODEL_RUNNERS),
        "api": True,
    }
    if lab is not None:
        return LabCluster(root / "cluster", ids, model_dir.parent, lab=lab, **settings)
    return LocalCluster(root / "cluster", ids, model_dir.parent, **settings)


def _sweep_runners(soak: Soak) -> None:
    """Runners still alive after the cluster shut down (a grace for kills in flight) are orphans: counted,
    then killed."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    left = soak.watch.our_runners()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)  # polling the process table, bounded by the deadline
        left = [p for p in left if _running(p)]
    for p in left:
        soak.watch.orphans.setdefault(p.pid, "alive after the cluster shut down")
        with contextlib.suppress(psutil.Error):
            p.kill()


def _keep_logs(cluster: LocalCluster, json_path: Path) -> Path:
    """Every node's log, copied beside the JSON (`<name>.logs/<node>.log`): a missed target is explained
    there, and the run's own folder is removed."""
    out = json_path.parent / f"{json_path.stem}.logs"
    out.mkdir(parents=True, exist_ok=True)
    for nid, n in cluster.nodes.items():
        if n.log is not None and n.log.is_file():
            shutil.copy(n.log, out / f"{nid}.log")
    return out


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run(
    minutes: float = 10.0,
    nodes: int = 3,
    json_path: Path | None = None,
    model: str | None = None,
    concurrency: int | None = None,
    seed: int = 0,
    max_tokens: int | None = None,
    fault_interval_s: float | None = None,
    netns: bool | None = None,
    faults: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The soak; `model` is None (the default model), "tiny" (a tiny random model, for smoke runs) or a path
    or name `resolve_model` knows. `netns`: None runs the nodes in network namespaces where they work (as
    root), True insists, False never. `faults`: the fault kinds to draw from (default: every one the mode
    can do)."""
    from shardline.models.registry import resolve_model

    if minutes <= 0 or nodes < 2:
        raise ValueError("--minutes must be > 0 and --nodes >= 2")
    in_lab = use_netns(netns)
    kinds = fault_kinds(faults, in_lab, nodes)
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-soak-"))
    tiny = model == "tiny"
    if tiny:
        model_dir = tiny_chat_model(root / "models" / "soak-tiny", seed)
    else:
        model_dir = resolve_model(model, progress=False)
    run_id = uuid.uuid4().hex
    old = os.environ.get(MARKER)
    os.environ[MARKER] = run_id  # inherited by every node and runner this run starts
    ids = [f"n{i}" for i in range(nodes)]
    result: dict[str, Any] | None = None
    restore = None
    # The lab before our SIGTERM handler: NetLab puts its own hook (close every lab) in place once per
    # process; ours stands in front of it for the run and hands it back after.
    lab = open_lab(LAB_NAME, nodes + 1) if in_lab else None
    try:
        cluster = _cluster(root, ids, model_dir, tiny, lab)
        soak = Soak(
            cluster,
            model_dir.name,
            seconds=minutes * 60,
            concurrency=concurrency or 2 * nodes,
            seed=seed,
            max_tokens=max_tokens or (16 if tiny else 32),
            deadline_s=60.0 if tiny else 180.0,
            recover_s=60.0 if tiny else 180.0,
            fault_interval_s=fault_interval_s or min(FAULT_INTERVAL_S, max(3.0, minutes * 60 / 6)),
            fault_kinds=kinds,
            lab=lab,
            client_host=lab.hosts[nodes] if lab is not None else None,
            vocab=int(json.loads((model_dir / "config.json").read_text())["vocab_size"]),
            run_id=run_id,
        )
        if threading.current_thread() is threading.main_thread():
            # SIGTERM ends the run like Ctrl-C: the cluster is shut down and every process it started is gone.
            restore = signal.signal(signal.SIGTERM, _interrupt)
        try:
            cluster.start()
            # Everything that speaks HTTP to the nodes from here on (this thread and every thread it starts)
            # does it from the client host; the block ends (back in our own namespace) before any cleanup.
            with soak.nodes.inside_lab():
                soak.nodes.setup()
                soak.load.reference()
                where = f"in network namespaces ({lab.name_prefix}-*)" if lab is not None else "on loopback"
                print(
                    f"soak: {nodes} nodes ready {where}, {len(QUESTIONS)} reference answers taken; "
                    f"load for {minutes:g} min",
                    file=sys.stderr,
                )
                result = soak.run()
        finally:
            soak.nodes.stop.set()
            soak.nodes.load_over.set()
            cluster.close()
            _sweep_runners(soak)
            if result is not None and json_path is not None and False in _targets(result).values():
                result["logs"] = str(_keep_logs(cluster, json_path))
    finally:
        try:
            if lab is not None:
                lab.close()  # anything left in its namespaces is killed; the namespaces are deleted
        finally:
            if restore is not None:
                signal.signal(signal.SIGTERM, restore)
            if old is None:
                os.environ.pop(MARKER, None)
            else:
                os.environ[MARKER] = old
            shutil.rmtree(root, ignore_errors=True)
    assert result is not None
    result["orphan_processes"] = len(soak.watch.orphans)
    result["orphans"] = [f"{pid}: {why}" for pid, why in soak.watch.orphans.items()]
    result["targets_met"] = _targets(result)
    summary = (
        f"\nbench soak: {result['minutes']:g} min, {nodes} nodes, {result['machine']}\n"
        f"  ok {result['requests_ok']}  lost {result['requests_lost']} (wrong {result['wrong_answers']}, "
        f"timed out {result['timed_out']})  refused {result['refused']}  "
        f"unreachable {result['unreachable']}  cut by node kill {result['cut_by_node_kill']}  "
        f"5xx {result['http_5xx']}\n"
        f"  faults: {result['kills']} kills, {result['stops']} stops, {result['link_flaps']} link flaps, "
        f"{result['partitions']} partitions (cut by one: {result['cut_by_partition']}), "
        f"{result['disconnects']} disconnects; "
        f"ttft p50/p99 {result['ttft_p50_s']}/{result['ttft_p99_s']} s\n"
        f"  leaked_slots {result['leaked_slots']}  orphans {result['orphan_processes']}  masters/term max "
        f"{result['masters_per_term_max']}  instance failures {result['instance_failures']}  "
        f"rss growth {result['rss_growth_ratio']}\n"
        f"  abusive client: {_abuse_line(result['abusive_client'])}\n"
        f"  targets met: {result['targets_met']}"
    )
    print(json.dumps(result, indent=1))
    print(summary, file=sys.stderr)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    return result
