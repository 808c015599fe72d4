"""What the prefix cache looks like from outside: cached prompt tokens in the APIs' usage, the cache's figures
in /metrics and /state.

A real HTTP server, service, cluster client and front over real zenoh, and the official clients; only the
leader is a stand-in, answering every Submit with a few tokens and a Finished that says how many prompt
tokens its prefix cache held, and beating prefix-cache figures as a leader does.
"""

from __future__ import annotations

import shutil
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
from conftest import wait_for
from prometheus_client.parser import text_string_to_metric_families

from shardline.api.server import ApiServer
from shardline.api.service import ApiSettings, Service
from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterClient
from shardline.dataplane import messages as m
from shardline.dataplane.frame import encode
from shardline.dataplane.transport import DeadlineExceeded, Inbox, Keys, Outbox, open_session

MODEL = "smollm2-135m-instruct"
INSTANCE = "inst-prefix"
GENERATION = 1
CACHED = 5  # what the stand-in leader says its cache held, unless told otherwise
BLOCK_TOKENS = 64
REPLY = " Paris is the capital."
LONG_PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest."


class StandInLeader:
    """Answers every Submit with REPLY's tokens (up to max_tokens) and Finished(cached_tokens=...), then a
    beat counting the prompt as looked up and the cached part as found."""

    def __init__(self, session: object, keys: Keys, reply: list[int]) -> None:
        self.reply = reply
        self.cached: deque[int] = deque()  # the next requests' cached tokens, in arrival order
        self.prompts: list[int] = []  # prompt lengths seen, in arrival order
        self.queries = self.hits = 0
        self.control = Inbox(session, GENERATION, name="leader")  # type: ignore[arg-type]
        self.control.subscribe(keys.at(GENERATION).control, m.CONTROL, "control")
        self.events = Outbox(session, keys.at(GENERATION).events, GENERATION)  # type: ignore[arg-type]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stand-in-leader")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.control.get(timeout=0.2).message
            except DeadlineExceeded:
                continue
            if isinstance(msg, m.Submit):
                self._answer(msg)

    def _answer(self, submit: m.Submit) -> None:
        spec = submit.request
        cached = min(self.cached.popleft() if self.cached else CACHED, len(spec.prompt))
        self.prompts.append(len(spec.prompt))
        send = self.events.send
        send(m.Admitted(request_id=spec.request_id))
        tokens = self.reply[: spec.max_tokens]
        for i, t in enumerate(tokens):
            send(m.TokenEvent(request_id=spec.request_id, index=i, token=t, logprob=-0.5))
        reason = "length" if len(tokens) == spec.max_tokens else "stop"
        send(m.Finished(request_id=spec.request_id, reason=reason, tokens=len(tokens), cached_tokens=cached))
        self.queries += len(spec.prompt)
        self.hits += cached
        beat = m.LeaderBeat(
            seen={submit.front: submit.seq},
            requests=[],
            tokens=0,
            prefix_queries=self.queries,
            prefix_hits=self.hits,
            prefix_blocks=3,
            prefix_block_tokens=BLOCK_TOKENS,
        )
        send(beat)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.events.close()
        self.control.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, tokenizer) -> Iterator[SimpleNamespace]:
    # The API needs only the model's tokenizer and config: the stand-in leader computes nothing.
    root = tmp_path_factory.mktemp("models")
    (root / MODEL).mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, root / MODEL / name)
    namespace = f"prefix-{id(root)}"
    session = open_session(["tcp/127.0.0.1:0"], [])
    leader = StandInLeader(session, Keys(INSTANCE, 0, namespace), tokenizer.encode(REPLY))
    client = ClusterClient([], namespace, session=session)
    service = Service(client, root, ApiSettings(port=0), node_id="n1")
    server = ApiServer(service).start()
    try:
        record = cm.InstanceRecord(
            instance=INSTANCE,
            model=MODEL,
            generation=GENERATION,
            phase="ready",
            vocab_size=tokenizer.vocab_size,
            context_length=2048,
        )
        session.put(client.keys.view, encode(cm.ClusterView(term=1, master="n1", instances=[record])))
        client.wait(lambda v: bool(v.instances), 10, "the view")
        assert client.front(INSTANCE).serving.wait(10)
        yield SimpleNamespace(url=server.url, leader=leader)
    finally:
        server.close()
        service.close()
        client.close()
        leader.close()
        session.close()


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=30)


CHAT = [{"role": "user", "content": LONG_PROMPT}]


@pytest.mark.timeout(60)
def test_openai_chat_reports_the_cached_prompt_tokens_whole_and_streamed(served, oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert r.usage.prompt_tokens == served.leader.prompts[-1] > CACHED
    assert r.usage.prompt_tokens_details.cached_tokens == CACHED
    served.leader.cached.append(7)
    stream = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    last = list(stream)[-1]
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens == 7


@pytest.mark.timeout(60)
def test_openai_completions_report_the_cached_prompt_tokens_whole_and_streamed(served, oai):
    r = oai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3)
    assert r.usage.prompt_tokens_details.cached_tokens == CACHED
    served.leader.cached.append(2)
    stream = oai.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == 2
    # Never more than the prompt: a leader's count of a prompt that folded in generated tokens is cut.
    served.leader.cached.append(10_000)
    short = oai.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
    assert short.usage.prompt_tokens == 3 and short.usage.prompt_tokens_details.cached_tokens == 3


@pytest.mark.timeout(60)
def test_n_choices_count_the_prompt_and_its_cached_tokens_once(served, oai):
    served.leader.cached.extend([0, 6, 4])  # the first choice prefilled what the others then found
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=3)
    assert len(r.choices) == 3 and r.usage.prompt_tokens == served.leader.prompts[-1]
    assert r.usage.prompt_tokens_details.cached_tokens == 6


@pytest.mark.timeout(60)
def test_anthropic_counts_cache_reads_apart_from_input_tokens(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=30)
    msg = client.messages.create(model=MODEL, max_tokens=4, messages=CHAT)
    prompt = served.leader.prompts[-1]
    assert msg.usage.cache_read_input_tokens == CACHED
    assert msg.usage.input_tokens == prompt - CACHED  # as Anthropic counts: the prompt is their sum
    served.leader.cached.append(8)
    with client.messages.stream(model=MODEL, max_tokens=4, messages=CHAT) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens == 8 and final.usage.input_tokens == prompt - 8


@pytest.mark.timeout(60)
def test_metrics_and_state_show_the_prefix_cache_from_the_leaders_beats(served, oai):
    oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    leader = served.leader

    def families() -> dict[str, object]:
        text = httpx.get(served.url + "/metrics", timeout=10).text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def caught_up() -> dict[str, object] | None:
        fams = families()
        hits = fams.get("shardline_prefix_cache_hits")
        ok = hits is not None and [s.value for s in hits.samples] == [leader.hits]  # type: ignore[attr-defined]
        return fams if ok else None

    fams = wait_for(caught_up, 10, "the leader's last beat in /metrics")
    for name, kind, value in (
        ("shardline_prefix_cache_queries", "counter", leader.queries),
        ("shardline_prefix_cache_hits", "counter", leader.hits),
        ("shardline_prefix_cache_blocks", "gauge", 3),
    ):
        family = fams[name]
        assert family.type == kind, name  # type: ignore[attr-defined]
        samples = [s for s in family.samples if not s.name.endswith("_created")]  # type: ignore[attr-defined]
        assert [(s.labels, s.value) for s in samples] == [({"instance": INSTANCE}, value)], name
    live = httpx.get(served.url + "/state", timeout=10).json()["instances"][0]["live"]
    assert live["prefix_queries"] == leader.queries and live["prefix_hits"] == leader.hits
    assert live["prefix_hit_rate"] == round(leader.hits / leader.queries, 4)
    assert live["prefix_blocks"] == 3 and live["prefix_block_tokens"] == BLOCK_TOKENS
