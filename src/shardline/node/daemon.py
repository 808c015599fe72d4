"""`shardline node`: one process per machine holding the node agent, the weight server and, on one node at a
time, the master.

The node publishes its own facts (identity, resources, models, runners, the newest view it saw) on a short
period and holds a liveliness token; it folds what it hears into a ClusterState (cluster/state.py:
`apply(state, event) -> (state, effects)`) and carries out the effects: send ballots, log cluster events,
take or drop the master role; it kills runners that the newest view no longer lists. Everything the master
knows can be rebuilt from these reports within one period.

Over 500 lines: the wiring of every duty a node has (election, reports, weights, downloads, the master role,
the API); each duty's logic lives in its own module.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import zenoh

from shardline.api.service import ApiSettings
from shardline.cluster import election, facts
from shardline.cluster import master_state as ms
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.keys import ClusterKeys, node_from_key
from shardline.cluster.links import LinkProber
from shardline.cluster.master import Master, Posted
from shardline.cluster.weights.server import Tamper, WeightServer
from shardline.cluster.weights.stage import StageWeights
from shardline.dataplane import messages as m
from shardline.dataplane.frame import decode, encode
from shardline.dataplane.transport import Link, open_session
from shardline.models.store.manifest import record_imports
from shardline.node.agent import NodeAgent
from shardline.node.config import NodeConfig, concrete_endpoint
from shardline.node.downloads import Downloads
from shardline.node.durable import ELECTION_FILE, load_election, save_election
from shardline.node.holdings import LocalModels
from shardline.node.resources import (
    compute_score,
    device_kind,
    node_identity,
    read_bandwidth,
    resources,
    rss_of,
)
from shardline.trust.refusals import refuse
from shardline.trust.seal import Checker, Sealer, certificate_name
from shardline.trust.seal import register as register_sealer

log = logging.getLogger("shardline.node")
API_URL_FILE = "api-url"
EVENTS_CAPACITY = 10_000
NOTICES_KEPT = 8  # the node's newest own events, repeated in its reports
NOTICE_TTL_S = 300.0  # ... for this long: a node that joins later need not learn old news
PEER_WAIT_S = 10.0  # a node with named peers campaigns alone only after this long without a link to one


class Node:
    def __init__(self, config: NodeConfig, *, weight_tamper: Tamper | None = None) -> None:
        """weight_tamper: a test-only fault of the weight server (tests/tampering_node.py)."""
        self.config = config
        self._weight_tamper = weight_tamper
        self.keys = ClusterKeys(config.namespace)
        data_dir = config.resolved_data_dir()
        self.node_id, self.name = node_identity(data_dir, config.name)
        if config.credentials.tls_dir is not None:  # a TLS node is its certificate's name (seals check it)
            self.node_id = certificate_name(config.credentials.tls_dir)
        self._sealer, self._checker = Sealer.of(config.credentials), Checker(config.credentials)
        self.models_root = config.resolved_models_dir()
        self.log_dir = data_dir / "logs"
        self.endpoint = config.credentials.endpoint(concrete_endpoint(config.listen))
        self.host = self.endpoint.split("/", 1)[1].rpartition(":")[0]
        self.link = Link(config.lease_ms, config.multicast_interface, config.credentials)
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.score = config.compute_score or compute_score()
        self.read_gbps = read_bandwidth()
        self.device = device_kind()
        self._election_path = data_dir / ELECTION_FILE
        fresh = cs.ClusterState(me=self.node_id, lease_s=config.lease_ms / 1000)
        # Immutable, replaced by the loop (and by an operator's ForgetNode): readers take it without the lock.
        self.state, self._durable = load_election(self._election_path, fresh)
        self.lock = threading.RLock()  # serialises the state's writers; never held while sending
        # Bounded: a loop that fell behind drops (and counts) rather than stalling zenoh's receive threads.
        self._events: queue.Queue[cs.Event | Posted] = queue.Queue(maxsize=EVENTS_CAPACITY)
        self.dropped_events = 0
        self._closed = threading.Event()
        self._leaving = False
        self.local_models = LocalModels(self.models_root)
        self.downloads = Downloads(self.node_id, self.models_root, self.local_models.rescan)
        self._fetching: dict[tuple[str, int], tuple[int, int]] = {}
        self._notices: deque[cm.ClusterEvent] = deque(maxlen=NOTICES_KEPT)
        self._met_at: float | None = None  # monotonic: when a link to a named peer was first up
        self.master: Master | None = None  # while this node is master; only the loop thread touches it
        self.api: Any = None  # api.server.ApiServer when the node serves HTTP
        self.session: zenoh.Session | None = None
        self._threads: list[threading.Thread] = []

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> Node:
        if self.config.holds_stages:  # before the first report: every model it lists has its digests recorded
            record_imports(self.models_root)
        self.session = s = open_session([self.endpoint], list(self.config.peers), self.link)
        register_sealer(s, self._sealer)  # the master's commands to node agents carry this node's seal
        if self.config.api is not None:  # first: a port in use fails the start before anything runs
            try:
                self.api = self._start_api(s, self.config.api)
            except OSError:
                s.close()
                raise
        self.stage_weights = StageWeights(
            s, self.config.namespace, self.node_id, self.models_root, self.local_models.rescan
        )
        self.agent = (
            NodeAgent(
                s,
                self.keys.agent(self.node_id),
                self.log_dir,
                fetch=self._fetch,
                obey=self._obey,
                allow_faults=self.config.allow_faults,
                credentials=self.config.credentials,
            ).start()
            if self.config.holds_stages
            else None
        )
        self.weights = WeightServer(
            s, self.config.namespace, self.node_id, self.models_root, tamper=self._weight_tamper
        )
        self._report_pub = s.declare_publisher(self.keys.report(self.node_id))
        self._view_pub = s.declare_publisher(self.keys.view)
        self._ballot_pub = s.declare_publisher(self.keys.ballot)
        self._subs = [
            s.declare_subscriber(self.keys.report_any, self._on_report),
            s.declare_subscriber(self.keys.view, self._on_report),
            s.declare_subscriber(self.keys.ballot, self._on_ballot),
            s.liveliness().declare_subscriber(self.keys.alive_any, self._on_alive, history=True),
        ]
        self._token = s.liveliness().declare_token(self.keys.alive(self.node_id))
        self.links = LinkProber(s, self.config.namespace, self.node_id, self._live_peers).start()
        self._enqueue(cs.Alive(self.node_id, time.time()))
        # The settle window opens now, when the node can hear others: measuring, hashing and the API's start
        # must not use it up, or a joining node campaigns alone before it hears the sitting master.
        self.started_mono = time.monotonic()
        for target, name in ((self._loop, "node-loop"), (self._reporter, "node-report")):
            t = threading.Thread(target=target, daemon=True, name=name)
            t.start()
            self._threads.append(t)
        log.info(
            "node %s (%s) on %s, namespace %s", self.node_id, self.name, self.endpoint, self.config.namespace
        )
        return self

    def _start_api(self, session: zenoh.Session, settings: ApiSettings) -> Any:
        from shardline.api.server import ApiServer
        from shardline.api.service import Service
        from shardline.cluster.client import ClusterClient

        client = ClusterClient([], self.config.namespace, self.config.credentials, session=session)
        service = Service(client, self.models_root, settings, self.node_id)
        try:
            server = ApiServer(service).start()
        except OSError:
            service.close()
            client.close()
            raise
        # Where the API listens (port 0 chose one), for scripts and tests that start nodes.
        (self.config.resolved_data_dir() / API_URL_FILE).write_text(server.url + "\n")
        return server

    def close(self) -> None:
        """Leave: hand mastery on (the instances it ran live on elsewhere), stop this node's own runners."""
        if self._closed.is_set():
            return
        self._leaving = True
        try:  # say so first: views show the node leaving while it hands over
            self._put(self._report_pub, encode(self.report()), self._checker.crl_der())
        except Exception:
            pass
        self._closed.set()
        if self.api is not None:
            self.api.close()  # requests streaming through this node end here: their clients see it
            self.api.service.close()
            self.api.service.client.close()
        for t in self._threads:
            t.join(timeout=5)
        if self.master is not None:
            self.master.close(stop_runners=False)  # instances live on: the next master adopts them
        if self.agent is not None:
            self.agent.close()
        self.weights.close()
        self.links.close()
        try:
            self._token.undeclare()
            for sub in self._subs:
                sub.undeclare()
            assert self.session is not None
            register_sealer(self.session, None)
            self.session.close()
        except Exception:
            pass

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed.wait(timeout)

    # ---- what arrives --------------------------------------------------------------------------------------

    def _on_alive(self, sample: zenoh.Sample) -> None:
        node = node_from_key(str(sample.key_expr))
        gone = sample.kind == zenoh.SampleKind.DELETE
        self._enqueue(cs.Gone(node) if gone else cs.Alive(node, time.time()))

    def _put(self, publisher: zenoh.Publisher, data: bytes, crl: bytes = b"") -> None:
        """Put `data` sealed as this node's (trust/seal.py): peers check who said it before folding it in."""
        publisher.put(data, attachment=self._sealer.seal(data, crl))

    def _unsealed(self, what: str, speaker: str, data: bytes, sample: zenoh.Sample) -> bool:
        """Whether `data` must be dropped: its seal does not show it is `speaker`'s (counted, never fatal)."""
        attachment = sample.attachment.to_bytes() if sample.attachment is not None else None
        if (why := self._checker.check(speaker, data, attachment)) is None:
            return False
        refuse(what, "seal", f"from {speaker!r}: {why}")
        return True

    def _on_report(self, sample: zenoh.Sample) -> None:
        data = bytes(sample.payload.to_bytes())
        try:
            msg, _ = decode(data, cm.REPORTS)
        except Exception as exc:  # never obeyed, never fatal
            log.warning("dropped a bad report on %s: %s", sample.key_expr, str(exc)[:200])
            return
        speaker = msg.node_id if isinstance(msg, cm.NodeReport) else msg.master
        if self._unsealed(msg.kind, speaker, data, sample):
            return
        if isinstance(msg, cm.NodeReport) and node_from_key(str(sample.key_expr)) != msg.node_id:
            refuse("node_report", "key", f"{msg.node_id!r} reported on {sample.key_expr}")
            return
        if sample.attachment is not None:
            self._checker.adopt_crl(sample.attachment.to_bytes())  # peers carry the CA's newest list
        if isinstance(msg, cm.NodeReport):
            self._enqueue(cs.ReportIn(msg, time.monotonic(), time.time()))
        else:
            self._enqueue(cs.ViewIn(msg, time.time()))

    def _on_ballot(self, sample: zenoh.Sample) -> None:
        data = bytes(sample.payload.to_bytes())
        try:
            msg, _ = decode(data, cm.BALLOTS)
        except Exception as exc:
            log.warning("dropped a bad ballot: %s", str(exc)[:200])
            return
        if self._unsealed(msg.kind, msg.candidate if isinstance(msg, cm.Claim) else msg.voter, data, sample):
            return
        self._enqueue(cs.ClaimIn(msg) if isinstance(msg, cm.Claim) else cs.VoteIn(msg, time.time()))

    def _enqueue(self, event: cs.Event) -> None:
        try:
            self._events.put_nowait(event)
        except queue.Full:
            self.dropped_events += (
                1  # reports and views repeat on a period; liveliness has the lease behind it
            )
            if self.dropped_events in (1, 10, 100) or self.dropped_events % 1000 == 0:
                log.warning("node loop behind: %d events dropped", self.dropped_events)

    def _obey(self, term: int) -> bool:
        """Whether a command of this master term is obeyed: the highest term seen, never one past the bound
        (a lower one is dropped and counted by the agent)."""
        return self.state.term <= term <= election.MAX_TERM

    # ---- the loop: fold, then act on the decisions ---------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                events = [self._events.get(timeout=0.1)]
            except queue.Empty:
                events = []
            while True:
                try:
                    events.append(self._events.get_nowait())
                except queue.Empty:
                    break
            try:
                self._step(events)
            except Exception:  # the node must outlive any one bad step
                log.exception("node step failed")

    def _step(self, all_events: list[cs.Event | Posted]) -> None:
        now, mono = time.time(), time.monotonic()
        events: list[cs.Event] = [e for e in all_events if not isinstance(e, Posted)]
        effects: list[cs.Effect] = []
        with self.lock:
            state = self.state
            settled = self._settled(mono)
            steps = [*events, cs.Tick(mono, now), cs.Campaign(mono, settled, self._patience(), now)]
            if self.master is not None:  # the master role runs: it changes the membership
                steps.append(cs.Reconfigure())
            for e in steps:
                state, fx = cs.apply(state, e)
                effects += fx
            self.state = state
        durable = cs.durable(state)
        if durable != self._durable:  # on disk before any vote, claim or view says it
            save_election(self._election_path, durable)
            self._durable = durable
        happened = cs.happened(effects)
        reconfigured = False
        term: int | None = None
        for fx in effects:
            if isinstance(fx, cs.Send):
                if isinstance(fx.ballot, cm.Claim):
                    log.info("node %s asks for votes for term %d", self.node_id, fx.ballot.term)
                self._put(self._ballot_pub, encode(fx.ballot))
            elif isinstance(fx, cs.Won):
                term = fx.term
            elif isinstance(fx, cs.Reconfigured):
                log.info("membership: %s", fx.membership)
                reconfigured = True
        for e in happened:
            log.info("%s %s", e.kind, e.node)
        if self.master is not None and not state.is_master:
            log.warning("node %s is no longer master (term %d)", self.node_id, state.term)
            self.master.close(stop_runners=False, wait=False)  # its controllers end off this loop
            self.master = None
        if term is not None:
            say = log.info if term == 1 else log.warning  # a change of master is news; the first is not
            say("node %s becomes master with term %d", self.node_id, term)
            self.master = self._new_master(term)
        if self.master is not None:
            # Only what was posted to this master: a deposed one's queries and updates are dropped.
            posted = [e.event for e in all_events if isinstance(e, Posted) and e.master is self.master]
            self.master.step(posted, self._snapshot, bool(happened) or reconfigured)
        view = state.view
        if view is not None and any(isinstance(e, cs.ViewIn) for e in events):
            if self.agent is not None:
                self._fence(view)
            if self.config.holds_stages:
                self.downloads.follow(view)

    def _snapshot(self) -> ms.Snapshot:
        return ms.snapshot(self.state, time.monotonic(), time.time())

    def _forget(self, node: str) -> str:
        """Called from zenoh's thread: an operator's removal of a dead member (committed by the loop)."""
        with self.lock:
            self.state, effects = cs.apply(self.state, cs.ForgetNode(node))
        why = next((fx.why for fx in effects if isinstance(fx, cs.Refused)), "")
        log.warning("forget %s: %s", node, why or "removal proposed")
        return why

    def _log_events(self, events: list[cm.ClusterEvent]) -> None:
        with self.lock:
            self.state, _ = cs.apply(self.state, cs.Record(tuple(events)))

    def _new_master(self, term: int) -> Master:
        assert self.session is not None
        r = self.config.runners
        config = ms.MasterConfig(
            me=self.node_id,
            namespace=self.config.namespace,
            report_s=self.config.report_s,
            threads=self.config.threads,
            spec_fields=r.settings_fields(),
        )
        return Master(
            self.session,
            config,
            r,
            term,
            self._snapshot(),
            post=self._events.put,
            publish=self.publish_view,
            log_events=self._log_events,
            forget=self._forget,
            reuse=r.reuse_survivors,
        )

    def _settled(self, mono: float) -> bool:
        """Whether this node has listened long enough for a sitting master: settle_s after start, and, when
        peers were named, settle_s after the first link to one came up (or PEER_WAIT_S without any: named
        peers that never answer do not keep a node masterless for ever)."""
        unmet = self.config.peers and self._met_at is None and self.session is not None
        if unmet and any(True for _ in self.session.info.peers_zid()):  # type: ignore[union-attr]
            self._met_at = mono
        if mono - self.started_mono < self.config.settle_s:
            return False
        if not self.config.peers:
            return True
        if self._met_at is None:
            return mono - self.started_mono >= PEER_WAIT_S
        return mono - self._met_at >= self.config.settle_s

    def _patience(self) -> float:
        """How long a campaign waits for votes: past a voter's lease and a report period. A voter that still
        sees the old master defers its vote until its own lease says it is gone; a campaign given up sooner
        asks again for a higher term and that vote comes for the old one (a soak partition took 11 campaigns
        and 12 s, terms 4 to 14, with one report period of patience)."""
        return max(1.0, 2 * self.config.report_s, self.state.lease_s + 2 * self.config.report_s)

    def _fence(self, view: cm.ClusterView) -> None:
        """Kill runners of generations the newest view no longer lists (a master's StopGeneration may have
        been lost with it)."""
        assert self.agent is not None
        held = self.runner_infos()
        for instance, keep in facts.stale_runners(view, held):
            log.warning("stopping runners of %s not in the view (keeping generation %d)", instance, keep)
            self.agent.stop_instance(instance, keep)

    def publish_view(self, view: cm.ClusterView) -> None:
        self._put(self._view_pub, encode(view), self._checker.crl_der())
        self._enqueue(cs.ViewIn(view, time.time()))

    # ---- reports -------------------------------------------------------------------------------------------

    def runner_infos(self) -> list[cm.RunnerInfo]:
        if self.agent is None:
            return []
        infos = [
            cm.RunnerInfo(
                instance=i,
                generation=g,
                slot=s,
                start=spec.layer_start,
                end=spec.layer_end,
                pid=pid,
                issued=issued,
            )
            for (i, g, s), spec, pid, issued in self.agent.held()
        ]
        return infos

    def _notice(self, node: str, message: str, instance: str = "") -> None:
        """A weights event of this node's own, in its next reports (the master's view shows it)."""
        log.warning("%s", message)
        with self.lock:
            last = self._notices[-1].at if self._notices else 0.0
            at = max(time.time(), last + 1e-6)  # strictly increasing: nodes fold each notice once
            self._notices.append(
                cm.ClusterEvent(at=at, kind="weights", node=node, instance=instance, message=message)
            )

    def report(self) -> cm.NodeReport:
        held = rss_of(pid for _, _, pid, _ in self.agent.held()) if self.agent is not None else 0
        state = self.state
        term, instances = state.term, state.instances()
        config, ballot_term = cs.config_key(state.membership), cs.known_term(state)
        with self.lock:
            notices = [n for n in self._notices if time.time() - n.at < NOTICE_TTL_S]
        return cm.NodeReport(
            node_id=self.node_id,
            name=self.name,
            endpoint=self.endpoint,
            started_at=self.started_at,
            holds_stages=self.config.holds_stages,
            api=self.api.url if self.api is not None else "",
            leaving=self._leaving,
            resources=resources(
                self.score, self.device, self.config.memory_limit, held, self.read_gbps, self.models_root
            ),
            models=self.local_models.get() if self.config.holds_stages else {},
            runners=self.runner_infos(),
            term=term,
            config=config,
            ballot_term=ballot_term,
            instances=instances,
            notices=notices,
            links=self.links.snapshot(),
            downloads=self.downloads.progress(),
        )

    def _live_peers(self) -> list[str]:
        state = self.state
        return sorted(n for n in state.alive if n in state.reports and state.reports[n].holds_stages)

    def _reporter(self) -> None:
        while not self._closed.wait(self.config.report_s):  # the report period, not a synchronisation
            try:
                r = self.report()
                self._put(self._report_pub, encode(r), self._checker.crl_der())
                self._enqueue(cs.ReportIn(r, time.monotonic(), time.time()))
            except Exception:
                log.exception("report failed")

    # ---- weights -------------------------------------------------------------------------------------------

    def _fetch(self, cmd: m.StartRunner, progress: Any) -> Path:
        """The local directory of the command's model with the stage's tensors, every byte checked against
        the digest the command names: copied from a source node when this node's own copy is absent or bad."""
        spec = cmd.spec
        return self.stage_weights.get(
            spec.model,
            spec.layer_start,
            spec.layer_end,
            cmd.digest,
            cmd.sources,
            progress,
            notify=lambda node, message: self._notice(node, message, spec.instance),
        )
