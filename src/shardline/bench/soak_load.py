"""A soak's load: client threads sending chat completions to every node in turn, each answer checked against
the first clean one; the abusive client (the largest bodies the API takes, and one past each cap); clients
that hang up early. What became of each request is counted, judged against the faults done (FaultRecord)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from shardline.bench.chaos import (
    ABUSIVE_EXPECTED,
    ABUSIVE_PLAN,
    ApiLimits,
    abusive_body,
    abusive_outcome,
    api_limits,
)
from shardline.bench.soak_cluster import SoakCluster
from shardline.bench.soak_faults import FaultRecord

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
ABUSIVE_INTERVAL_S = 1.0
ABUSIVE_IN_FLIGHT = 4  # a tick that finds this many still out is skipped (counted), not queued


@dataclass
class Counts:
    """What became of the load's requests (the faults done are in FaultRecord)."""

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


class Load:
    """The client threads: `worker` (K of them), `abuser` (with the abusive client on) and `disconnector`."""

    def __init__(
        self,
        nodes: SoakCluster,
        faults: FaultRecord,
        seed: int,
        max_tokens: int,
        deadline_s: float,
        abusive: bool = False,
        vocab: int | None = None,
    ) -> None:
        self.nodes = nodes
        self.faults = faults
        self.seed = seed
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.c = Counts()
        self.abuse = Abuse()
        self.expected: dict[int, str] = {}
        self.limits: ApiLimits | None = None
        self.abusive: dict[str, bytes] = {}  # variant -> its body, serialised once
        self.abusive_n: dict[str, int] = {}  # variant -> the choices a 200 must hold
        if abusive:
            if vocab is None:
                raise ValueError("the abusive client needs the model's vocabulary size")
            self.limits = api_limits(vocab)
            for variant in ABUSIVE_EXPECTED:
                body = abusive_body(variant, self.limits, nodes.model, max_tokens, seed)
                self.abusive[variant] = json.dumps(body).encode()
                self.abusive_n[variant] = int(body["n"])

    # ---- requests ----------------------------------------------------------------------------------------

    def _body(self, i: int) -> dict[str, Any]:
        return {
            "model": self.nodes.model,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "seed": self.seed,
        }

    def reference(self) -> None:
        """The first clean answer to every prompt, before any fault (non-streamed, through the first node)."""
        import openai

        url = self.nodes.api(self.nodes.ids[0])
        oai = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=2, timeout=300)
        for i in range(len(QUESTIONS)):
            r = oai.chat.completions.create(**self._body(i))
            self.expected[i] = r.choices[0].message.content or ""

    def one(self, clients: dict[str, Any], rng: random.Random, start_node: int) -> None:
        """One logical request: tried on the nodes in turn while they refuse the connection."""
        import openai

        faults, t0 = self.faults, self.nodes.t0
        i = rng.randrange(len(QUESTIONS))
        stream = rng.random() < 0.5
        for k in range(len(self.nodes.ids)):
            nid = self.nodes.ids[(start_node + k) % len(self.nodes.ids)]
            url = self.nodes.api(nid)
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
                if faults.killed_during(nid, sent):
                    self.c.add(cut=1)
                elif faults.refused_after_flap(nid, sent, cause) or faults.stale_after_cut(nid, sent, cause):
                    self.c.add(cut_by_flap=1)
                    continue  # never received: the next node takes it
                elif not isinstance(exc, openai.APITimeoutError) and faults.partitioned_during(nid, sent):
                    self.c.partition_cut(f"{nid} {type(exc).__name__}: {cause!r}")
                elif isinstance(exc, openai.APITimeoutError):
                    self.c.lose(
                        f"{nid} sent at {sent - t0:.1f}s: timeout after {time.monotonic() - sent:.1f}s",
                        timed_out=1,
                    )
                else:
                    self.c.lose(f"{nid} sent at {sent - t0:.1f}s: {type(exc).__name__}: {exc!r} {cause!r}")
                return
            except openai.APIStatusError as exc:
                code = exc.status_code
                if code != 400 and faults.partitioned_during(nid, sent):
                    self.c.partition_cut(f"{nid} HTTP {code}: {str(exc)[:200]}")
                    return
                self.c.add(refused=int(code in (429, 503)))
                if code >= 500:
                    self.c.server_error(f"{nid} HTTP {code}: {str(exc)[:200]}")
                if code not in (429, 503):
                    self.c.lose(f"{nid} sent at {sent - t0:.1f}s: HTTP {code}: {str(exc)[:200]}")
                else:
                    self.nodes.stop.wait(0.5)
                return
            except Exception as exc:  # an error event or a broken stream mid-answer
                if faults.killed_during(nid, sent):
                    self.c.add(cut=1)
                elif faults.partitioned_during(nid, sent):
                    self.c.partition_cut(f"{nid} {type(exc).__name__}: {str(exc)[:200]}")
                else:
                    self.c.lose(f"{nid} sent at {sent - t0:.1f}s: {type(exc).__name__}: {str(exc)[:200]}")
                return
            if text == self.expected[i]:
                self.c.add(ok=1)
            else:
                self.c.lose(
                    f"{nid} sent at {sent - t0:.1f}s: wrong ({'stream' if stream else 'whole'}) q{i}: "
                    f"{text[:80]!r} != {self.expected[i][:80]!r}",
                    wrong=1,
                )
            return
        self.nodes.stop.wait(0.5)  # every node refused the connection: a moment before the next request

    def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        clients: dict[str, Any] = {}
        n = 0
        while not self.nodes.load_over.is_set():
            try:
                self.one(clients, rng, (w + n) % len(self.nodes.ids))
            except Exception as exc:  # the bench's own bug: said, counted as lost, never a dead worker
                self.c.lose(f"client error {type(exc).__name__}: {exc}")
            n += 1
        for c in clients.values():
            c.close()

    # ---- the abusive client ------------------------------------------------------------------------------

    def abuse_one(self, variant: str, start_node: int) -> None:
        """One abusive request, tried on the nodes in turn while they refuse the connection."""
        faults, t0 = self.faults, self.nodes.t0
        body = self.abusive[variant]
        timeout = httpx.Timeout(self.deadline_s, connect=3.0)
        headers = {"Content-Type": "application/json"}
        for k in range(len(self.nodes.ids)):
            nid = self.nodes.ids[(start_node + k) % len(self.nodes.ids)]
            url = self.nodes.api(nid) + "/v1/chat/completions"
            sent = time.monotonic()
            try:
                r = httpx.post(url, content=body, headers=headers, timeout=timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self.abuse.add(unreachable=1)
                continue
            except httpx.HTTPError as exc:
                if faults.killed_during(nid, sent):
                    self.abuse.record(variant, "cut_by_node_kill", None)
                elif faults.refused_after_flap(nid, sent, exc) or faults.stale_after_cut(nid, sent, exc):
                    self.abuse.add(stale_after_cut=1)
                    continue
                elif not isinstance(exc, httpx.TimeoutException) and faults.partitioned_during(nid, sent):
                    self.abuse.record(variant, "cut_by_partition", None)
                else:
                    took, at = time.monotonic() - sent, sent - t0
                    why = f"{nid} sent at {at:.1f}s: {type(exc).__name__} after {took:.1f}s"
                    self.abuse.record(variant, "failure", None, why)
                return
            code = r.status_code
            outcome = abusive_outcome(code)
            why = f"{nid} sent at {sent - t0:.1f}s: HTTP {code}: {r.text[:200]}"
            if outcome == "failure" and faults.partitioned_during(nid, sent):
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
        while not self.nodes.load_over.is_set():
            if slots.acquire(blocking=False):
                variant = ABUSIVE_PLAN[k % len(ABUSIVE_PLAN)]
                t = threading.Thread(target=one, args=(variant, k % len(self.nodes.ids)), daemon=True)
                t.start()  # born in this thread's namespace: the client host's
                out.append(t)
                k += 1
            else:
                self.abuse.add(skipped_ticks=1)
            tick += ABUSIVE_INTERVAL_S
            self.nodes.load_over.wait(max(0.0, tick - time.monotonic()))
            out = [t for t in out if t.is_alive()]
        for t in out:
            t.join(self.deadline_s + 10)

    def _disconnect(self, rng: random.Random) -> None:
        nid = rng.choice(self.nodes.ids)
        url = self.nodes.api(nid)
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
        while not self.nodes.load_over.wait(rng.uniform(1.0, 4.0)):
            self._disconnect(rng)
