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
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil

from shardline.bench.chaos import (
    ABUSIVE_EXPECTED,
    ABUSIVE_PLAN,
    ApiLimits,
    abusive_body,
    abusive_outcome,
    api_limits,
    partition_sides,
)
from shardline.testing.cluster import FAST_RUNNERS, MODEL_RUNNERS, LabCluster, LocalCluster, NodeProc
from shardline.testing.netns import NETNS_DIR, Host, NetLab, netns_available, open_lab

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how the tides work.",
    "Name three colours of the rainbow.",
    "What makes a good cup of tea?",
    "Describe a walk through a forest in autumn.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
]
MARKER = "SHARDLINE_SOAK_RUN"  # in every node's (so every runner's) environment: the run they belong to
ORPHAN_GRACE_S = 10.0  # a runner may outlive its node this long (it notices and exits) before it is an orphan
FAULT_INTERVAL_S = 60.0  # mean seconds between node kills and stops (shorter runs: a sixth of the run)
RESTART_EXCLUDE_S = 60.0  # RSS samples this soon after a node (re)started are not compared
FAULT_KINDS = ("node_kill", "node_stop", "runner_stop", "abusive_client")
NETNS_FAULT_KINDS = (*FAULT_KINDS, "link_flap", "partition")  # a cable to pull, a switch to cut: a lab
NETNS_ONLY = ("link_flap", "partition")
CONTINUOUS_FAULTS = ("abusive_client",)  # runs the whole soak; the chaos thread draws the others
LINK_DOWN_S = (1.0, 6.0)  # a link flap keeps the cable out this long (seeded, uniform)
PARTITION_HOLD_S = (10.0, 20.0)  # 5-10 leases (--lease-ms 2000 in the test clusters): a new master is due
PARTITION_MIN_NODES = 3  # fewer, and neither side holds a majority
ABUSIVE_INTERVAL_S = 1.0
ABUSIVE_IN_FLIGHT = 4  # a tick that finds this many still out is skipped (counted), not queued
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


@dataclass
class Counts:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: int = 0
    lost: int = 0
    wrong: int = 0
    timed_out: int = 0
    refused: int = 0
    unreachable: int = 0
    cut: int = 0
    cut_by_flap: int = 0
    cut_by_partition: int = 0
    http_5xx: int = 0
    disconnects: int = 0
    kills: int = 0
    stops: int = 0
    link_flaps: int = 0
    partitions: int = 0
    ttft: list[float] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)
    http_5xx_examples: list[str] = field(default_factory=list)
    cut_by_partition_examples: list[str] = field(default_factory=list)

    def partition_cut(self, what: str) -> None:
        with self.lock:
            self.cut_by_partition += 1
            if len(self.cut_by_partition_examples) < 20:
                self.cut_by_partition_examples.append(what[:300])

    def server_error(self, what: str) -> None:
        with self.lock:
            self.http_5xx += 1
            if len(self.http_5xx_examples) < 20:
                self.http_5xx_examples.append(what[:300])

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def lose(self, why: str, **kw: int) -> None:
        with self.lock:
            self.lost += 1
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)
            if len(self.lost_examples) < 20:
                self.lost_examples.append(why[:300])


@dataclass
class Abuse:
    """What the abusive client's requests came to: per variant, each outcome (and each HTTP status)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_variant: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    failure_examples: list[str] = field(default_factory=list)
    unexpected_examples: list[str] = field(default_factory=list)
    unreachable: int = 0  # a node that refused the connection: the request went to the next node
    stale_after_cut: int = 0  # a pooled connection the node closed while cut off: sent again elsewhere
    skipped_ticks: int = 0

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def record(self, variant: str, outcome: str, status: int | None, why: str = "") -> None:
        """outcome: served, refused_400, failure, cut_by_node_kill or cut_by_partition."""
        with self.lock:
            counts = self.by_variant[variant]
            counts[outcome] += 1
            if status is not None:
                counts[f"http_{status}"] += 1
            if outcome == "failure" and len(self.failure_examples) < 20:
                self.failure_examples.append(f"{variant}: {why}"[:300])
            expected = "served" if ABUSIVE_EXPECTED[variant] == 200 else "refused_400"
            if outcome in ("served", "refused_400") and outcome != expected:
                counts["unexpected"] += 1
                if len(self.unexpected_examples) < 20:
                    self.unexpected_examples.append(f"{variant}: {outcome}, expected {expected} {why}"[:300])

    def report(self, limits: ApiLimits | None, bytes_of: dict[str, int], seconds: float) -> dict[str, Any]:
        with self.lock:
            variants = {v: dict(sorted(c.items())) for v, c in sorted(self.by_variant.items())}
        total: dict[str, int] = defaultdict(int)
        for c in variants.values():
            for k, v in c.items():
                total[k] += v
        ends = ("served", "refused_400", "failure", "cut_by_node_kill", "cut_by_partition")
        return {
            "sent": sum(total[k] for k in ends),
            "served": total["served"],
            "refused_400": total["refused_400"],
            "failures": total["failure"],
            "unexpected": total["unexpected"],
            "cut_by_node_kill": total["cut_by_node_kill"],
            "cut_by_partition": total["cut_by_partition"],
            "unreachable": self.unreachable,
            "stale_connection_after_cut": self.stale_after_cut,
            "skipped_ticks": self.skipped_ticks,  # a second with ABUSIVE_IN_FLIGHT still out: none sent
            "rate_per_s": round(sum(total[k] for k in ends) / seconds, 3) if seconds > 0 else None,
            "in_flight_max": ABUSIVE_IN_FLIGHT,
            "expected": dict(ABUSIVE_EXPECTED),
            "by_variant": variants,
            "limits": limits.as_dict() if limits is not None else None,
            "body_bytes": bytes_of,
            "failure_examples": list(self.failure_examples),
            "unexpected_examples": list(self.unexpected_examples),
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


def _get(url: str, timeout: float = 2.0) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None


class Soak:
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
    ) -> None:
        self.cluster = cluster
        self.model = model
        self.seconds = seconds
        self.concurrency = concurrency
        self.seed = seed
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.recover_s = recover_s
        self.fault_interval_s = fault_interval_s
        self.fault_kinds = fault_kinds
        self.lab = lab
        self.client_host = client_host
        # The client host's namespace (its nsfs inode), where every HTTP request to the nodes must start.
        self.client_ns = os.stat(NETNS_DIR / client_host.name).st_ino if client_host else None
        self.ids = list(cluster.nodes)
        self.c = Counts()
        self.stop = threading.Event()  # Ctrl-C or the end of the run: every thread returns soon after
        self.load_over = threading.Event()
        self.apis: dict[str, str] = {}
        self.api_lock = threading.Lock()
        self.kill_times: dict[str, list[float]] = defaultdict(list)  # node -> when it was SIGKILLed
        self.flaps: dict[str, list[tuple[float, float]]] = defaultdict(list)  # node -> (down, up) times
        self.restarts: dict[str, list[float]] = defaultdict(list)  # node -> when it was restarted
        self.orphaned_since: dict[int, float] = {}  # runner pid -> when it was first seen without its node
        self.run_id = ""
        self.t0 = time.monotonic()
        self.rss: dict[str, list[tuple[float, int]]] = defaultdict(list)  # node daemon alone
        self.daemon_pid: dict[str, list[int]] = defaultdict(list)  # beside each sample of self.rss
        self.runner_rss: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)  # (node, pid)
        self.masters: dict[int, set[str]] = defaultdict(set)
        self.orphans: dict[int, str] = {}  # pid -> when it was found
        self.expected: dict[int, str] = {}
        self.fault_log: list[dict[str, Any]] = []
        # Partitions: [cut at, healed at (None while cut), the minority's nodes].
        self.partitions: list[tuple[float, float | None, frozenset[str]]] = []
        self.failed_instances: dict[str, str] = {}  # instance -> what said it failed, first seen
        self.abuse = Abuse()
        self.limits: ApiLimits | None = None
        self.abusive: dict[str, bytes] = {}  # variant -> its body, serialised once
        self.abusive_n: dict[str, int] = {}  # variant -> the choices a 200 must hold
        if "abusive_client" in fault_kinds:
            if vocab is None:
                raise ValueError("the abusive client needs the model's vocabulary size")
            self.limits = api_limits(vocab)
            for variant in ABUSIVE_EXPECTED:
                body = abusive_body(variant, self.limits, model, max_tokens, seed)
                self.abusive[variant] = json.dumps(body).encode()
                self.abusive_n[variant] = int(body["n"])

    # ---- the cluster -------------------------------------------------------------------------------------

    def api(self, node_id: str) -> str:
        """The node's HTTP base URL; every request to a node asks for it first, so it checks where from."""
        self._check_netns()
        with self.api_lock:
            return self.apis[node_id]

    def _check_netns(self) -> None:
        """In a lab, HTTP to the nodes only from inside the client host: in the root namespace the lab's
        addresses follow the default route out of the machine."""
        if self.client_ns is not None and os.stat("/proc/thread-self/ns/net").st_ino != self.client_ns:
            raise RuntimeError(f"HTTP to the lab's nodes from outside {self.client_host}: not sent")

    def inside_lab(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread, and the threads it starts, in the client host (no lab: where it is)."""
        if self.lab is None or self.client_host is None:
            return contextlib.nullcontext()
        return self.lab.inside(self.client_host)

    def _read_api(self, n: NodeProc, timeout: float) -> str:
        path = n.data_dir / "api-url"
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if time.monotonic() > deadline or (n.proc is not None and n.proc.poll() is not None):
                raise RuntimeError(f"node {n.node_id} serves no HTTP API:\n{n.tail()}")
            self.stop.wait(0.1)
        return path.read_text().strip()

    def state(self, node_id: str | None = None) -> dict[str, Any]:
        for nid in [node_id] if node_id else self.ids:
            r = _get(self.api(nid) + "/state", 3.0)
            if r is not None and r.status_code == 200:
                return r.json()
        return {}

    def healthy(self) -> bool:
        """Every node answers /health, sees every node alive, and the instance is ready."""
        for nid in self.ids:
            r = _get(self.api(nid) + "/health", 2.0)
            if r is None or r.status_code != 200:
                return False
        s = self.state()
        alive = sum(n.get("alive", False) for n in s.get("nodes", []))
        ready = [
            i for i in s.get("instances", []) if i.get("model") == self.model and i.get("phase") == "ready"
        ]
        return alive == len(self.ids) and bool(ready)

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            if self.healthy():
                return True
            self.stop.wait(0.5)
        return False

    def setup(self) -> None:
        for nid, n in self.cluster.nodes.items():
            self.apis[nid] = self._read_api(n, 120)
        first = self.ids[0]
        deadline = time.monotonic() + 120
        while sum(n.get("alive", False) for n in self.state(first).get("nodes", [])) < len(self.ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every node joined:\n{self.cluster.logs()}")
            self.stop.wait(0.5)
        r = httpx.post(self.api(first) + "/instances", json={"model": self.model}, timeout=120)
        if r.status_code != 201:
            raise RuntimeError(f"placing {self.model}: {r.status_code} {r.text}")
        if not self.wait_healthy(600):
            raise RuntimeError(f"the instance never became ready:\n{self.cluster.logs()}")

    # ---- requests ----------------------------------------------------------------------------------------

    def _body(self, i: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "seed": self.seed,
        }

    def reference(self) -> None:
        """The first clean answer to every prompt, before any fault (non-streamed, through the first node)."""
        import openai

        oai = openai.OpenAI(base_url=self.api(self.ids[0]) + "/v1", api_key="-", max_retries=2, timeout=300)
        for i in range(len(QUESTIONS)):
            r = oai.chat.completions.create(**self._body(i))
            self.expected[i] = r.choices[0].message.content or ""

    def _refused_after_flap(self, node_id: str, start: float, cause: BaseException | None) -> bool:
        """A request that found its pooled connection to a node closed by the node while the node's link
        was down: the server's keep-alive timer (5 s) ran out during the flap, and its FIN reached the
        client only after the request went out on that connection. The node never received the request
        ("Server disconnected without sending a response": no byte of an answer), so it is not lost; a
        client retries it as it would any request refused on a stale connection."""
        if type(cause).__name__ != "RemoteProtocolError" or "without sending a response" not in str(cause):
            return False
        return any(down <= start and start - up <= 30.0 for down, up in self.flaps.get(node_id, []))

    def _partitioned_during(self, node_id: str, start: float) -> bool:
        """The node was on the minority side of a partition at some moment since `start`."""
        now = time.monotonic()
        return any(
            node_id in cut and down <= now and (up is None or start <= up)
            for down, up, cut in self.partitions
        )

    def _stale_after_cut(self, node_id: str, start: float, cause: BaseException | None) -> bool:
        """As _refused_after_flap, for a node a partition cut off from the clients."""
        if type(cause).__name__ != "RemoteProtocolError" or "without sending a response" not in str(cause):
            return False
        return any(
            node_id in cut and down <= start and (up is None or start - up <= 30.0)
            for down, up, cut in self.partitions
        )

    def _killed_during(self, node_id: str, start: float) -> bool:
        now = time.monotonic()
        return any(start - 0.5 <= t <= now for t in self.kill_times.get(node_id, []))

    def one(self, clients: dict[str, Any], rng: random.Random, start_node: int) -> None:
        """One logical request: tried on the nodes in turn while they refuse the connection."""
        import openai

        i = rng.randrange(len(QUESTIONS))
        stream = rng.random() < 0.5
        for k in range(len(self.ids)):
            nid = self.ids[(start_node + k) % len(self.ids)]
            url = self.api(nid)
            oai = clients.get(url)
            if oai is None:
                oai = clients[url] = openai.OpenAI(
                    base_url=url + "/v1",
                    api_key="-",
                    max_retries=0,
                    timeout=openai.Timeout(self.deadline_s, connect=3.0),
                )
            sent = time.monotonic()
            try:
                if stream:
                    parts: list[str] = []
                    first: float | None = None
                    with oai.chat.completions.create(**self._body(i), stream=True) as s:
                        for chunk in s:
                            if chunk.choices and chunk.choices[0].delta.content:
                                first = first or time.monotonic()
                                parts.append(chunk.choices[0].delta.content)
                    text = "".join(parts)
                    if first is not None:
                        with self.c.lock:
                            self.c.ttft.append(first - sent)
                else:
                    r = oai.chat.completions.create(**self._body(i))
                    text = r.choices[0].message.content or ""
            except openai.APIConnectionError as exc:
                cause = exc.__cause__
                # The client's transport (httpx or httpx2) failed to connect: never accepted.
                if type(cause).__name__ in ("ConnectError", "ConnectTimeout"):
                    self.c.add(unreachable=1)  # never accepted: try the next node
                    continue
                if self._killed_during(nid, sent):
                    self.c.add(cut=1)
                elif self._refused_after_flap(nid, sent, cause) or self._stale_after_cut(nid, sent, cause):
                    self.c.add(cut_by_flap=1)
                    continue  # never received: the next node takes it
                elif not isinstance(exc, openai.APITimeoutError) and self._partitioned_during(nid, sent):
                    self.c.partition_cut(f"{nid} {type(exc).__name__}: {cause!r}")
                elif isinstance(exc, openai.APITimeoutError):
                    self.c.lose(
                        f"{nid} sent at {sent - self.t0:.1f}s: timeout after {time.monotonic() - sent:.1f}s",
                        timed_out=1,
                    )
                else:
                    self.c.lose(
                        f"{nid} sent at {sent - self.t0:.1f}s: {type(exc).__name__}: {exc!r} {cause!r}"
                    )
                return
            except openai.APIStatusError as exc:
                code = exc.status_code
                if code != 400 and self._partitioned_during(nid, sent):
                    self.c.partition_cut(f"{nid} HTTP {code}: {str(exc)[:200]}")
                    return
                self.c.add(refused=int(code in (429, 503)))
                if code >= 500:
                    self.c.server_error(f"{nid} HTTP {code}: {str(exc)[:200]}")
                if code not in (429, 503):
                    self.c.lose(f"{nid} sent at {sent - self.t0:.1f}s: HTTP {code}: {str(exc)[:200]}")
                else:
                    self.stop.wait(0.5)
                return
            except Exception as exc:  # an error event or a broken stream mid-answer
                if self._killed_during(nid, sent):
                    self.c.add(cut=1)
                elif self._partitioned_during(nid, sent):
                    self.c.partition_cut(f"{nid} {type(exc).__name__}: {str(exc)[:200]}")
                else:
                    self.c.lose(
                        f"{nid} sent at {sent - self.t0:.1f}s: {type(exc).__name__}: {str(exc)[:200]}"
                    )
                return
            if text == self.expected[i]:
                self.c.add(ok=1)
            else:
                self.c.lose(
                    f"{nid} sent at {sent - self.t0:.1f}s: wrong ({'stream' if stream else 'whole'}) q{i}: "
                    f"{text[:80]!r} != {self.expected[i][:80]!r}",
                    wrong=1,
                )
            return
        self.stop.wait(0.5)  # every node refused the connection: a moment before the next request

    def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        clients: dict[str, Any] = {}
        n = 0
        while not self.load_over.is_set():
            try:
                self.one(clients, rng, (w + n) % len(self.ids))
            except Exception as exc:  # the bench's own bug: said, counted as lost, never a dead worker
                self.c.lose(f"client error {type(exc).__name__}: {exc}")
            n += 1
        for c in clients.values():
            c.close()

    # ---- the abusive client ------------------------------------------------------------------------------

    def abuse_one(self, variant: str, start_node: int) -> None:
        """One abusive request, tried on the nodes in turn while they refuse the connection."""
        body = self.abusive[variant]
        timeout = httpx.Timeout(self.deadline_s, connect=3.0)
        headers = {"Content-Type": "application/json"}
        for k in range(len(self.ids)):
            nid = self.ids[(start_node + k) % len(self.ids)]
            url = self.api(nid) + "/v1/chat/completions"
            sent = time.monotonic()
            try:
                r = httpx.post(url, content=body, headers=headers, timeout=timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self.abuse.add(unreachable=1)
                continue
            except httpx.HTTPError as exc:
                if self._killed_during(nid, sent):
                    self.abuse.record(variant, "cut_by_node_kill", None)
                elif self._refused_after_flap(nid, sent, exc) or self._stale_after_cut(nid, sent, exc):
                    self.abuse.add(stale_after_cut=1)
                    continue
                elif not isinstance(exc, httpx.TimeoutException) and self._partitioned_during(nid, sent):
                    self.abuse.record(variant, "cut_by_partition", None)
                else:
                    took, at = time.monotonic() - sent, sent - self.t0
                    why = f"{nid} sent at {at:.1f}s: {type(exc).__name__} after {took:.1f}s"
                    self.abuse.record(variant, "failure", None, why)
                return
            code = r.status_code
            outcome = abusive_outcome(code)
            why = f"{nid} sent at {sent - self.t0:.1f}s: HTTP {code}: {r.text[:200]}"
            if outcome == "failure" and self._partitioned_during(nid, sent):
                outcome = "cut_by_partition"
            elif code >= 500:
                self.c.server_error(f"abusive {variant} {why}")
            if outcome == "served":
                want = self.abusive_n[variant]
                got = len(r.json().get("choices", []))
                if got != want:
                    outcome, why = "failure", f"{nid} served {got} choices of n={want}"
            self.abuse.record(variant, outcome, code, why)
            return
        self.abuse.record(variant, "failure", None, "every node refused the connection")

    def abuser(self) -> None:
        """ABUSIVE_PLAN in turn, one request a second on the nodes in turn, until the load ends; then every
        request still out ends (by its deadline)."""
        slots = threading.BoundedSemaphore(ABUSIVE_IN_FLIGHT)
        out: list[threading.Thread] = []

        def one(variant: str, start: int) -> None:
            try:
                self.abuse_one(variant, start)
            except Exception as exc:  # the bench's own bug: said and counted, never a dead client
                self.abuse.record(variant, "failure", None, f"client error {type(exc).__name__}: {exc}")
            finally:
                slots.release()

        k = 0
        tick = time.monotonic()
        while not self.load_over.is_set():
            if slots.acquire(blocking=False):
                variant = ABUSIVE_PLAN[k % len(ABUSIVE_PLAN)]
                t = threading.Thread(target=one, args=(variant, k % len(self.ids)), daemon=True)
                t.start()  # born in this thread's namespace: the client host's
                out.append(t)
                k += 1
            else:
                self.abuse.add(skipped_ticks=1)
            tick += ABUSIVE_INTERVAL_S
            self.load_over.wait(max(0.0, tick - time.monotonic()))
            out = [t for t in out if t.is_alive()]
        for t in out:
            t.join(self.deadline_s + 10)

    # ---- chaos -------------------------------------------------------------------------------------------

    def _disconnect(self, rng: random.Random) -> None:
        nid = rng.choice(self.ids)
        url = self.api(nid)
        body = {**self._body(rng.randrange(len(QUESTIONS))), "stream": True}
        if rng.random() < 0.5:
            # Before the first byte: the whole request is sent, the socket closed before any answer.
            u = urlparse(url)
            raw = json.dumps(body).encode()
            req = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
            ).encode() + raw
            try:
                with socket.create_connection((u.hostname, u.port), timeout=2) as s:
                    s.sendall(req)
                    time.sleep(rng.uniform(0.0, 0.2))
            except OSError:
                return
        else:
            # After a few bytes of the answer.
            try:
                with httpx.stream(
                    "POST", url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, connect=2)
                ) as r:
                    if r.status_code >= 500:
                        r.read()
                        self.c.server_error(f"{nid} disconnect request: {r.status_code} {r.text[:200]}")
                    got = 0
                    for b in r.iter_bytes():
                        got += len(b)
                        if got >= rng.randint(1, 200):
                            break
            except httpx.HTTPError:
                return
        self.c.add(disconnects=1)

    def disconnector(self) -> None:
        rng = random.Random(self.seed + 7)
        while not self.load_over.wait(rng.uniform(1.0, 4.0)):
            self._disconnect(rng)

    def _pause(self, pid: int, seconds: float) -> None:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        try:
            self.stop.wait(seconds)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _flap(self, nid: str, down_s: float) -> float:
        """Pull the node's cable for `down_s`, then plug it back (also when the run is stopped meanwhile);
        returns when it was back."""
        assert self.lab is not None and isinstance(self.cluster, LabCluster)
        host = self.cluster.hosts[nid]
        self.c.add(link_flaps=1)
        down = time.monotonic()
        self.lab.link_down(host)
        try:
            self.stop.wait(down_s)
        finally:
            self.lab.link_up(host)
            self.flaps[nid].append((down, time.monotonic()))
        return time.monotonic()

    def _state_in(self, nid: str, timeout: float = 2.0) -> dict[str, Any] | None:
        """The node's /state asked from inside its own host (in a lab): heard whichever side of a cut it is
        on. Without a lab, from here."""
        if self.lab is None or not isinstance(self.cluster, LabCluster):
            r = _get(self.api(nid) + "/state", timeout)
        else:
            with self.api_lock:
                url = self.apis[nid]
            with self.lab.inside(self.cluster.hosts[nid]):
                r = _get(url + "/state", timeout)
        return r.json() if r is not None and r.status_code == 200 else None

    def _partition(self, rng: random.Random, entry: dict[str, Any]) -> None:
        """Cut the master and one other node off from the rest (the clients stay with the rest) for a hold
        of several leases; watch the majority elect; heal."""
        assert self.lab is not None and isinstance(self.cluster, LabCluster) and self.client_host is not None
        before = self.state()
        master, term = before.get("master"), int(before.get("term", 0))
        if master not in self.ids:
            raise RuntimeError(f"no master to cut off (the cluster says {master!r})")
        minority, majority = partition_sides(self.ids, master, rng)
        hold = rng.uniform(*PARTITION_HOLD_S)
        entry.update(node=master, term=term, minority=minority, majority=majority, clients_with="majority")
        entry["hold_s"] = round(hold, 2)
        hosts = self.cluster.hosts
        self.c.add(partitions=1)
        down = time.monotonic()
        self.partitions.append((down, None, frozenset(minority)))
        try:
            with self.lab.partitioned(
                [[*(hosts[n] for n in majority), self.client_host], [hosts[n] for n in minority]]
            ):
                while not self.stop.is_set() and time.monotonic() < down + hold:
                    if "new_master" not in entry:
                        for nid in majority:
                            s = self.state(nid)
                            if int(s.get("term", 0)) > term and s.get("master") in majority:
                                entry["new_master"], entry["new_term"] = s["master"], int(s["term"])
                                entry["elected_after_s"] = round(time.monotonic() - down, 1)
                                break
                    self.stop.wait(0.5)
                # What the cut-off side believes at the end of the hold: a master that lost its quorum for a
                # lease has stepped down (None), or follows its old term.
                views = {nid: self._state_in(nid) for nid in minority}
                entry["minority_views"] = {
                    nid: None if v is None else {"term": v.get("term"), "master": v.get("master")}
                    for nid, v in views.items()
                }
        finally:
            self.partitions[-1] = (down, time.monotonic(), frozenset(minority))

    def fault(self, rng: random.Random) -> None:
        kind = rng.choice([k for k in self.fault_kinds if k not in CONTINUOUS_FAULTS])
        nid = rng.choice(self.ids)
        n = self.cluster.nodes[nid]
        at = time.monotonic()
        up: float | None = None  # when a flapped link was back
        entry: dict[str, Any] = {"kind": kind, "node": nid}
        if kind == "runner_stop":
            pids = n.runner_pids()
            if not pids:
                kind = entry["kind"] = "node_stop"
            else:
                pause = rng.uniform(0.5, 2.0)
                entry["pause_s"] = round(pause, 2)
                self.c.add(stops=1)
                self._pause(rng.choice(pids), pause)
        if kind == "node_stop":
            pause = rng.uniform(0.5, 2.5)
            entry["pause_s"] = round(pause, 2)
            self.c.add(stops=1)
            self._pause(n.pid, pause)
        elif kind == "node_kill":
            self.kill_times[nid].append(time.monotonic())
            self.c.add(kills=1)
            n.kill(signal.SIGKILL)
            self.stop.wait(rng.uniform(1.0, 4.0))
            if self.stop.is_set():
                return
            n.start()
            self.restarts[nid].append(time.monotonic())
            url = self._read_api(n, 120)
            with self.api_lock:
                self.apis[nid] = url
        elif kind == "link_flap":
            down = rng.uniform(*LINK_DOWN_S)
            entry["down_s"] = round(down, 2)
            up = self._flap(nid, down)
        elif kind == "partition":
            self._partition(rng, entry)
            up = time.monotonic()
        entry["recovered"] = self.wait_healthy(self.recover_s)
        if up is not None:
            entry["ready_after_up_s"] = round(time.monotonic() - up, 1)
        entry["at_s"] = round(at - self.t0, 1)
        entry["recovery_s"] = round(time.monotonic() - at, 1)
        self.fault_log.append(entry)
        print(f"soak: {entry}", file=sys.stderr)

    def chaos(self) -> None:
        rng = random.Random(self.seed)
        # Gaps of 0.75-1.5x the interval: the controller's restart budget (3 in 120 s by default) holds
        # for faults a minute apart, and one fault may cost two restarts (a node stop: a leave and a rejoin).
        lo, hi = 0.75 * self.fault_interval_s, 1.5 * self.fault_interval_s
        end = self.t0 + self.seconds - 5.0  # no new fault in the last seconds: every fault gets its recovery
        if not [k for k in self.fault_kinds if k not in CONTINUOUS_FAULTS]:
            return
        while not self.load_over.wait(rng.uniform(lo, hi)):
            if time.monotonic() >= end:
                return
            try:
                self.fault(rng)
            except Exception as exc:  # a fault that could not be done is reported, not fatal
                self.fault_log.append({"kind": "error", "error": repr(exc)[:300]})

    # ---- sampling ----------------------------------------------------------------------------------------

    def _our_runners(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                runner = (
                    "shardline.runner" in cmd or "shardline runner" in cmd
                )  # not a node's --runner-settings
                if runner and p.environ().get(MARKER) == self.run_id:
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def _check_orphans(self) -> None:
        """A runner of this run whose parent is no live node of the cluster, for longer than the grace."""
        nodes = {n.proc.pid for n in self.cluster.nodes.values() if n.proc and n.proc.poll() is None}
        now = time.monotonic()
        for p in self._our_runners():
            try:
                if p.status() == psutil.STATUS_ZOMBIE or p.ppid() in nodes:
                    continue
                # Its node is gone: it has the grace to notice and exit.
                if now - self.orphaned_since.setdefault(p.pid, now) > ORPHAN_GRACE_S:
                    self.orphans.setdefault(p.pid, "its node gone, during the run")
            except psutil.Error:
                pass

    def sampler(self) -> None:
        k = 0
        while not self.stop.is_set():
            for nid in self.ids:  # the master and term each node follows (/state: open to any client)
                try:
                    h = self._state_in(nid)
                except OSError:  # its namespace gone: the lab is closing
                    h = None
                if h is not None:
                    self._note_state(h)
            if k % 3 == 0:
                now = time.monotonic()
                for nid, n in self.cluster.nodes.items():
                    if n.proc is None or n.proc.poll() is not None:
                        continue
                    # Apart: a node's runners move between nodes as stages are re-placed, so a node's total
                    # says where the stages are, not whether anything leaks.
                    try:
                        root = psutil.Process(n.proc.pid)
                        self.rss[nid].append((now, root.memory_info().rss))
                        self.daemon_pid[nid].append(root.pid)
                        for c in root.children(recursive=True):
                            self.runner_rss[(nid, c.pid)].append((now, c.memory_info().rss))
                    except psutil.Error:
                        continue
                self._check_orphans()
            k += 1
            self.stop.wait(1.0)

    def _note_state(self, h: dict[str, Any]) -> None:
        """One node's /state: the master it follows in its term, and any instance it says failed (with who
        said so, in which term, and when in the run it was first heard)."""
        if h.get("master") is not None:
            self.masters[int(h.get("term", 0))].add(h["master"])
        at = time.monotonic() - self.t0
        said = f"{h.get('node')} (term {h.get('term')}, master {h.get('master')}) at {at:.0f}s"
        for i in h.get("instances", []):
            if i.get("phase") == "failed":
                self.failed_instances.setdefault(str(i.get("instance")), f"{said}: {i.get('why', '')}")
        for e in h.get("events", []):
            if e.get("kind") == "failed":
                self.failed_instances.setdefault(str(e.get("instance")), f"{said}: {e.get('message', '')}")

    def rss_series(self) -> dict[str, list[float]]:
        """Each node daemon's RSS in MB, one sample a minute from the first: whether growth levels off."""
        out = {}
        for nid, samples in sorted(self.rss.items()):
            series, next_t = [], samples[0][0] if samples else 0.0
            for t, v in samples:
                if t >= next_t:
                    series.append(round(v / 2**20, 1))
                    next_t = t + 60.0
            out[nid] = series
        return out

    def runner_ratios(self, t_start: float, t_end: float) -> dict[str, float]:
        """Each runner process that lived through most of the run: the mean RSS of the last fifth of its
        samples over the first fifth (its first minute, warm-up and first allocations, left out)."""
        out = {}
        for (nid, pid), samples in sorted(self.runner_rss.items()):
            if not samples or samples[-1][0] - samples[0][0] < 0.6 * (t_end - t_start):
                continue
            steady = [
                (t, v)
                for t, v in samples
                if t - samples[0][0] >= min(RESTART_EXCLUDE_S, 0.2 * (t_end - t_start))
            ]
            fifth = max(1, len(steady) // 5)
            first, last = [v for _, v in steady[:fifth]], [v for _, v in steady[-fifth:]]
            if first and last:
                out[f"{nid}/{pid}"] = round(statistics.mean(last) / statistics.mean(first), 3)
        return out

    def daemon_rss_ratio(self, nid: str, t_start: float, t_end: float) -> float | None:
        """The growth of the node's daemon process: the mean RSS of the last fifth of its life in the run over
        the first fifth. A node the soak restarted runs a new process, which is measured over its own life
        (after its warm-up): the process before it was killed by the soak and cannot have leaked since, and
        comparing the two measures their different jobs (a restarted node copies its stage's weights back)."""
        pids = self.daemon_pid[nid]
        if not pids:
            return None
        last = pids[-1]
        restarted = any(p != last for p in pids)
        samples = [(t, v) for (t, v), p in zip(self.rss[nid], pids, strict=True) if p == last]
        if restarted:  # its warm-up, as after the run's start
            exclude = min(RESTART_EXCLUDE_S, (t_end - t_start) / 5)
            samples = [(t, v) for t, v in samples if t - samples[0][0] >= exclude]
        samples = [(t, v) for t, v in samples if t_start <= t <= t_end]
        if len(samples) < 2:
            return None
        t0, t1 = samples[0][0], samples[-1][0]
        fifth = (t1 - t0) / 5
        first = [v for t, v in samples if t <= t0 + fifth]
        tail = [v for t, v in samples if t >= t1 - fifth]
        return round(statistics.mean(tail) / statistics.mean(first), 3)

    def rss_ratio(self, nid: str, t_start: float, t_end: float) -> float | None:
        span = t_end - t_start
        exclude = min(RESTART_EXCLUDE_S, span / 5)
        restarts = self.restarts.get(nid, [])
        samples = [
            (t, v)
            for t, v in self.rss[nid]
            if t_start <= t <= t_end and not any(0 <= t - r < exclude for r in restarts)
        ]
        first = [v for t, v in samples if t <= t_start + span / 5]
        last = [v for t, v in samples if t >= t_end - span / 5]
        if not first or not last:
            return None
        return round(statistics.mean(last) / statistics.mean(first), 3)

    # ---- after the load ----------------------------------------------------------------------------------

    def pending(self) -> int | None:
        """Slots still held once idle: /health's `pending`, else /metrics' shardline_requests_pending."""
        total = 0
        for nid in self.ids:
            h = _get(self.api(nid) + "/health", 3.0)
            if h is not None and h.status_code == 200 and "pending" in h.json():
                total += int(h.json()["pending"])
                continue
            m = _get(self.api(nid) + "/metrics", 3.0)
            values = (
                re.findall(r"^shardline_requests_pending(?:\{[^}]*\})?\s+([0-9.eE+-]+)", m.text, re.M)
                if m is not None and m.status_code == 200
                else []
            )
            if not values:
                return None
            total += int(sum(float(v) for v in values))
        return total

    def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        threads = [
            threading.Thread(target=self.worker, args=(w,), daemon=True) for w in range(self.concurrency)
        ]
        threads += [
            threading.Thread(target=self.chaos, daemon=True),
            threading.Thread(target=self.disconnector, daemon=True),
        ]
        if self.abusive:
            threads.append(threading.Thread(target=self.abuser, daemon=True))
        sampler = threading.Thread(target=self.sampler, daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        try:
            self.stop.wait(self.seconds)
            t_end = time.monotonic()
            self.load_over.set()
            # Every request still out ends by its deadline; a fault in progress ends with its recovery.
            join_by = time.monotonic() + self.deadline_s + self.recover_s + 30
            for t in threads:
                t.join(max(0.1, join_by - time.monotonic()))
            self.wait_healthy(self.recover_s)
            leaked = None
            idle_by = time.monotonic() + 20
            while time.monotonic() < idle_by:
                leaked = self.pending()
                if not leaked:
                    break
                self.stop.wait(1.0)
            self._check_orphans()
        finally:
            self.stop.set()
            self.load_over.set()
            sampler.join(5)
        c = self.c
        ratios = {nid: self.daemon_rss_ratio(nid, self.t0, t_end) for nid in self.ids}
        across = {nid: self.rss_ratio(nid, self.t0, t_end) for nid in self.ids}
        return {
            "minutes": round(self.seconds / 60, 3),
            "nodes": len(self.ids),
            "model": self.model,
            "concurrency": self.concurrency,
            "fault_interval_s": round(self.fault_interval_s, 1),
            "netns": self.lab is not None,
            "fault_kinds": list(self.fault_kinds),
            "seed": self.seed,
            "requests_ok": c.ok,
            "requests_lost": c.lost,
            "wrong_answers": c.wrong,
            "timed_out": c.timed_out,
            "refused": c.refused,
            "unreachable": c.unreachable,
            "cut_by_node_kill": c.cut,
            "cut_by_partition": c.cut_by_partition,
            "clients_during_partition": "with the majority" if "partition" in self.fault_kinds else None,
            "stale_connection_after_flap": c.cut_by_flap,  # or after a partition
            "http_5xx": c.http_5xx,
            "leaked_slots": leaked,
            "rss_growth_ratio": ratios,
            "rss_growth_ratio_across_restarts": across,  # the node's last fifth over its first, any process
            "runner_rss_growth_ratio": self.runner_ratios(self.t0, t_end),
            "rss_mb_each_minute": self.rss_series(),
            "orphan_processes": len(self.orphans),
            "masters_per_term_max": max((len(v) for v in self.masters.values()), default=None),
            "terms_seen": sorted(self.masters),
            "masters_by_term": {str(t): sorted(m) for t, m in sorted(self.masters.items())},
            "instance_failures": len(self.failed_instances),
            "failed_instances": dict(self.failed_instances),
            "ttft_p50_s": _pct(c.ttft, 0.5),
            "ttft_p99_s": _pct(c.ttft, 0.99),
            "kills": c.kills,
            "stops": c.stops,
            "link_flaps": c.link_flaps,
            "partitions": c.partitions,
            "disconnects": c.disconnects,
            "abusive_client": (
                self.abuse.report(self.limits, {v: len(b) for v, b in self.abusive.items()}, self.seconds)
                if self.abusive
                else None
            ),
            "faults": self.fault_log,
            "instances_final": [
                {k: i.get(k) for k in ("instance", "phase", "generation", "recoveries")}
                for i in self.state().get("instances", [])
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


def use_netns(netns: bool | None) -> bool:
    """--netns: on, or an error that says why it cannot be; --no-netns: off; neither: on where it works."""
    if netns is False:
        return False
    why = netns_available()
    if netns and why is not None:
        raise RuntimeError(f"--netns: {why}")
    return why is None


def fault_kinds(faults: Sequence[str] | None, netns: bool, nodes: int | None = None) -> tuple[str, ...]:
    """The fault kinds to draw from: `faults` (in that order) or every kind this mode (and this many nodes:
    a partition needs 3, so that one side holds a majority) can do."""
    allowed = NETNS_FAULT_KINDS if netns else FAULT_KINDS
    few = nodes is not None and nodes < PARTITION_MIN_NODES
    if faults is None:
        return tuple(k for k in allowed if not (few and k == "partition"))
    kinds = tuple(dict.fromkeys(faults))
    bad = [k for k in kinds if k not in allowed]
    if bad or not kinds:
        need = [k for k in NETNS_ONLY if k in bad]
        hint = f" ({' and '.join(need)} {'needs' if len(need) == 1 else 'need'} --netns)" if need else ""
        raise ValueError(f"fault kinds {bad or '(none)'}: choose from {', '.join(allowed)}{hint}")
    if few and "partition" in kinds:
        raise ValueError(f"partition needs --nodes >= {PARTITION_MIN_NODES} (a majority on one side)")
    return kinds


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
    left = soak._our_runners()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)  # polling the process table, bounded by the deadline
        left = [p for p in left if _running(p)]
    for p in left:
        soak.orphans.setdefault(p.pid, "alive after the cluster shut down")
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
        )
        soak.run_id = run_id
        if threading.current_thread() is threading.main_thread():
            # SIGTERM ends the run like Ctrl-C: the cluster is shut down and every process it started is gone.
            restore = signal.signal(signal.SIGTERM, _interrupt)
        try:
            cluster.start()
            # Everything that speaks HTTP to the nodes from here on (this thread and every thread it starts)
            # does it from the client host; the block ends (back in our own namespace) before any cleanup.
            with soak.inside_lab():
                soak.setup()
                soak.reference()
                where = f"in network namespaces ({lab.name_prefix}-*)" if lab is not None else "on loopback"
                print(
                    f"soak: {nodes} nodes ready {where}, {len(QUESTIONS)} reference answers taken; "
                    f"load for {minutes:g} min",
                    file=sys.stderr,
                )
                result = soak.run()
        finally:
            soak.stop.set()
            soak.load_over.set()
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
    result["orphan_processes"] = len(soak.orphans)
    result["orphans"] = [f"{pid}: {why}" for pid, why in soak.orphans.items()]
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
