"""`shardline bench cluster`: how long the cluster takes to notice and repair, on real daemons on loopback.

One run, the default model, node ids chosen so the master is known: `a0` (master, holds no stage), `b1` and
`b2` (the instance's two stages), then `b3` joining. Measured:
- join_to_placeable_s: `b3` starts -> a dry-run placement of the master places a stage on it;
- master_kill_to_master_s: `a0` SIGKILLed mid-stream -> the view names a new master (runners untouched);
- node_kill_to_next_token_s: the node holding the last stage SIGKILLed mid-stream -> the client's next token;
- survivor_reuse_speedup: that pause with every stage restarted over the pause with the surviving stage
  keeping its process and weights (two clusters, one after the other, in the same run);
- requests_lost: requests that did not end with the fault-free tokens.

With --tls every link (nodes, runners, the bench's client) runs over zenoh TLS with mutual authentication
(a fresh cluster CA), and the node kill is also run on a plain cluster in the same run: tls_pause_ratio is
the TLS pause over the plain one.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shardline.bench.machine import describe
from shardline.cluster.client import ClusterClient
from shardline.cluster.placement import PlacementRequest
from shardline.models.registry import resolve_model
from shardline.testing.cluster import MODEL_RUNNERS, LocalCluster
from shardline.trust import ca

TOKENS = 64
QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how the tides work, step by step."]


def _prompts(model_dir: Path) -> list[list[int]]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model_dir)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _stream_with_fault(
    client: ClusterClient, instance: str, prompt: list[int], fault: Callable[[], None], after: int = 8
) -> tuple[list[int], float]:
    """Tokens of one request with `fault()` run after `after` tokens, and the seconds from the fault to the
    token that ended the longest pause after it (the stream resumed by the rebuilt instance)."""
    handle = client.front(instance).submit(prompt, max_tokens=TOKENS)
    tokens: list[int] = []
    times: list[float] = []
    struck = 0.0
    for tok in handle.stream(timeout=300):
        tokens.append(tok.token)
        times.append(time.monotonic())
        if len(tokens) == after:
            fault()
            struck = time.monotonic()
    after_fault = [struck, *(t for t in times if t > struck)]
    gaps = [(b - a, b) for a, b in itertools.pairwise(after_fault)]
    return tokens, (max(gaps)[1] - struck) if gaps else 0.0


def _cluster(root: Path, model_dir: Path, reuse: bool, tls: bool = False) -> LocalCluster:
    runners = dict(MODEL_RUNNERS)
    tls_root = None
    if tls:
        tls_root = root / "tls"
        ca.init(tls_root, ["a0", "b1", "b2", "b3"])
    return LocalCluster(
        root,
        ["a0", "b1", "b2"],
        model_dir.parent,
        # Declared equal speeds: the same split over any two nodes, so a survivor's layers can stay put.
        extra=["--prefill-step", "128", "--compute-score", "50"],
        node_extra={"a0": ["--no-stages"]},
        runners={**runners, "reuse_survivors": reuse},
        tls_root=tls_root,
    ).start()


def _serving(cluster: LocalCluster, model_dir: Path, prompts: list[list[int]]) -> tuple:  # type: ignore[type-arg]
    client = cluster.client("b1")
    three_up = lambda v: sum(n.alive for n in v.nodes) == 3 and v.master == "a0"  # noqa: E731
    client.wait(three_up, 60, "3 nodes, a0 master")
    request = PlacementRequest(sequences=2, reserve_tokens=1024, hop_cost_fraction=0.0, max_stages=2)
    reply = client.place(model_dir.name, request)
    assert reply.instance is not None
    instance = client.wait_ready(reply.instance.instance, 300).instance
    expected = [client.front(instance).submit(p, max_tokens=TOKENS).tokens(timeout=300) for p in prompts]
    return client, instance, request, expected


def _node_kill(cluster: LocalCluster, client: ClusterClient, instance: str, prompt: list[int]) -> tuple:  # type: ignore[type-arg]
    """SIGKILL the node of the last stage mid-stream (a spare node is there to take its place)."""
    rec = client.wait_ready(instance, 60)
    victim = rec.stages[-1].node_id
    got, gap = _stream_with_fault(
        client, instance, prompt, lambda: cluster.nodes[victim].kill(signal.SIGKILL)
    )
    client.wait(
        lambda v: (r := client.instance(instance)) is not None and r.recoveries > rec.recoveries,
        60,
        "recovery",
    )
    after = client.wait_ready(instance, 120)
    kept = rec.stages[0].pid is not None and after.stages[0].pid == rec.stages[0].pid
    return got, gap, kept


def _reuse_pause(root: Path, model_dir: Path, prompts: list[list[int]], tls: bool) -> tuple[float, bool, int]:
    """The node loss with survivors reused (the default): the pause, whether the survivor kept its process,
    and requests lost."""
    cluster = _cluster(root, model_dir, reuse=True, tls=tls)
    try:
        client, instance, _, expected = _serving(cluster, model_dir, prompts)
        cluster.add("b3")
        client.wait(lambda v: sum(n.alive for n in v.nodes) == 4, 60, "b3")
        got, pause, kept = _node_kill(cluster, client, instance, prompts[1])
        return pause, kept, int(got != expected[1])
    finally:
        cluster.close()


def run(model: str | None, json_path: Path | None, tls: bool = False) -> dict:
    model_dir = resolve_model(model, progress=True)
    prompts = _prompts(model_dir)
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-cluster-"))
    results: dict = {"machine": describe(), "model": model_dir.name, "tls": tls}
    lost = 0
    # Full restart of every stage after a node loss (survivors not reused): join, master kill, node kill.
    cluster = _cluster(root / "restart", model_dir, reuse=False, tls=tls)
    try:
        client, instance, request, expected = _serving(cluster, model_dir, prompts)
        started = time.monotonic()
        cluster.add("b3")
        three = request.model_copy(update={"max_stages": 3})
        while True:
            if time.monotonic() - started > 60:
                raise RuntimeError("b3 never became placeable")
            try:
                preview = client.place(model_dir.name, three, dry_run=True).placement
            except Exception:
                preview = None
            if preview is not None and "b3" in {a.node_id for a in preview.stages}:
                break
            client.wait(lambda v: True, 1.0, "a view")
        results["join_to_placeable_s"] = round(time.monotonic() - started, 2)

        term = client.view.term if client.view else 0
        killed: list[float] = []

        def kill_master() -> None:
            killed.append(time.monotonic())
            cluster.nodes["a0"].kill(signal.SIGKILL)

        got, _ = _stream_with_fault(client, instance, prompts[0], kill_master)
        client.wait(lambda v: v.master != "a0" and v.term > term, 30, "a new master")
        results["master_kill_to_master_s"] = round(_first_master_change(client, term, killed[0]), 2)
        lost += got != expected[0]
        got, full_pause, _ = _node_kill(cluster, client, instance, prompts[1])
        lost += got != expected[1]
    finally:
        cluster.close()
    reuse_pause, kept, n_lost = _reuse_pause(root / "reuse", model_dir, prompts, tls)
    lost += n_lost
    if tls:  # the baseline: the same node loss on a plain cluster, in the same run
        plain_pause, _, n_lost = _reuse_pause(root / "plain", model_dir, prompts, False)
        lost += n_lost
        results["node_kill_to_next_token_plain_s"] = round(plain_pause, 2)
        results["tls_pause_ratio"] = round(reuse_pause / plain_pause, 2) if plain_pause else None
    results["node_kill_to_next_token_s"] = round(reuse_pause, 2)
    results["node_kill_to_next_token_full_restart_s"] = round(full_pause, 2)
    results["survivor_kept_its_process"] = kept
    results["survivor_reuse_speedup"] = round(full_pause / reuse_pause, 2) if reuse_pause else None
    results["requests_lost"] = lost
    print(json.dumps(results, indent=1))
    targets = {
        "join_to_placeable_s": "<= 5",
        "master_kill_to_master_s": "<= 3",
        "node_kill_to_next_token_s": "<= 8",
    }
    print(
        f"\nbench cluster on {results['machine']['cpu']}, {results['machine']['cores']} cores",
        file=sys.stderr,
    )
    more = {"survivor_reuse_speedup": ">= 1.3", "requests_lost": "0"}
    if tls:
        more["tls_pause_ratio"] = "<= 1.2"
    for key, target in {**targets, **more}.items():
        print(f"  {key:28s} {results.get(key)!s:>8}   target {target}", file=sys.stderr)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
    return results


def _first_master_change(client: ClusterClient, term: int, killed_at: float) -> float:
    """Seconds from the kill to the first view of a higher term (the client stamps views on arrival)."""
    at = client.view_arrivals.get(term + 1) or next(
        (t for k, t in sorted(client.view_arrivals.items()) if k > term), time.monotonic()
    )
    return at - killed_at
