"""`shardline run MODEL [PROMPT]`: the chat in a pseudo-terminal on the one-node cluster it starts (a streamed
answer, Ctrl-C mid-answer, a second answer, Ctrl-D, nothing left running), one prompt through a cluster it
joins, and a bad model reference in one line. The chat loop's own rules against a stand-in stream."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pexpect
import psutil
import pytest
from conftest import assert_no_runner_left, serving_cluster, wait_for

from shardline.cli.chat_terminal import Answer, chat, read_message

MODEL = "smollm2-135m-instruct"
RUN = [sys.executable, "-m", "shardline", "run"]
GREEDY = ["--temperature", "0", "--repetition-penalty", "1"]  # the texts the tests expect


def _running(api: str) -> int:
    """Requests the node's instance runs or holds, as its /state says."""
    state = httpx.get(api + "/state", timeout=10).json()
    return sum(
        (r["live"] or {}).get("running", 0) + (r["live"] or {}).get("queued", 0) for r in state["instances"]
    )


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_chat_in_a_terminal_streams_stops_on_ctrl_c_and_leaves_nothing_running(model_dir):
    child = pexpect.spawn(
        RUN[0],
        [*RUN[1:], "--port", "0", *GREEDY, "--max-tokens", "3000", MODEL],
        encoding="utf-8",
        timeout=240,
        dimensions=(50, 200),
    )
    pids: list[int] = []
    state_dir: Path | None = None
    try:
        child.expect(r"started a one-node cluster \(HTTP API on (http://127\.0\.0\.1:\d+)\)")
        api = child.match.group(1)
        child.expect_exact(">>> ")  # the model is placed and ready
        # The node it started, and the node's runners.
        node = next(p for p in psutil.Process(child.pid).children() if "node" in p.cmdline())
        argv = node.cmdline()
        state_dir = Path(argv[argv.index("--data-dir") + 1])
        pids = [node.pid, *(p.pid for p in node.children(recursive=True))]
        assert len(pids) > 1, "no runner under the node"

        child.sendline("Name the capital of France.")
        child.expect("Paris")
        child.expect(r"\d+ tokens, [\d.]+ tokens/s")
        child.expect_exact(">>> ")

        # Ctrl-C once the answer is under way: the answer stops, the node cancels it, the prompt comes back.
        long_prompt = "Write a long story about a dragon who learns to fly."  # greedy: past 3000 tokens
        child.sendline(long_prompt)
        child.expect_exact(long_prompt)  # the terminal's echo
        child.expect(r"\w+ \w+ \w+ \w+")  # the first words of the answer
        child.sendintr()
        child.expect(r"\d+ tokens.*\(stopped\)")
        child.expect_exact(">>> ")
        wait_for(lambda: _running(api) == 0, 30, "the stopped request cancelled on the node")

        child.sendline("What is 2 + 2?")
        child.expect(r"\d+ tokens, [\d.]+ tokens/s")
        child.expect_exact(">>> ")
        child.sendintr()  # at an empty prompt: how to leave, and nothing else
        child.expect_exact("Use Ctrl + d or /bye to exit.")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=60)
        child.wait()
        assert child.exitstatus == 0, child.before
    finally:
        if child.isalive():
            child.terminate(force=True)
    assert_no_runner_left(pids, within_s=30)
    assert state_dir is not None and not state_dir.exists(), "the node's state directory is left behind"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_stops_the_cluster_it_started():
    child = pexpect.spawn(RUN[0], [*RUN[1:], "--port", "0", MODEL], encoding="utf-8", timeout=180)
    try:
        child.expect_exact(">>> ")
        node = next(p for p in psutil.Process(child.pid).children() if "node" in p.cmdline())
        pids = [node.pid, *(p.pid for p in node.children(recursive=True))]
        child.kill(signal.SIGTERM)
        child.expect(pexpect.EOF, timeout=60)
        child.wait()
        assert child.signalstatus is None and child.exitstatus == 128 + signal.SIGTERM
    finally:
        if child.isalive():
            child.terminate(force=True)
    assert_no_runner_left(pids, within_s=30)


@pytest.fixture(scope="module")
def joined(tmp_path_factory, model_dir) -> Iterator[Any]:
    with serving_cluster(tmp_path_factory.mktemp("run"), ["r1"], model_dir) as c:
        yield c


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_prompt_through_a_running_cluster_leaves_it_running(joined):
    api = joined.nodes["r1"].api
    wait_for(lambda: httpx.get(api + "/health", timeout=5).status_code == 200, 60, "the node's API")
    cmd = [
        *RUN,
        "--cluster",
        api,
        *GREEDY,
        "--max-tokens",
        "24",
        MODEL,
        "Name the capital of France.",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"joined the cluster at {api}" in done.stderr
    assert "Paris" in done.stdout
    # Already placed: a second prompt waits for nothing, and the cluster it joined still serves.
    done = subprocess.run([*cmd[:-1], "Say hi."], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert joined.nodes["r1"].proc.poll() is None

    bad = subprocess.run(
        [*RUN, "--cluster", api, "no-such-model", "hi"], capture_output=True, text=True, timeout=60
    )
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("shardline: error:")]
    assert bad.returncode != 0 and len(errors) == 1 and "no-such-model" in errors[0], bad.stderr
    assert not bad.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hub_repository_is_downloaded_by_the_node_it_starts(tmp_path):
    """A hub reference no node holds: the one-node cluster's node downloads it (from a stand-in hub) into
    its cache and serves it; run itself fetches nothing."""
    from shardline.testing.fake_hub import FakeHub, mlx_repo_files

    env = {
        **os.environ,
        "SHARDLINE_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with FakeHub() as hub:
        hub.add_repo("testorg/tiny", mlx_repo_files())
        env["HF_ENDPOINT"] = hub.url
        done = subprocess.run(
            [*RUN, "--port", "0", "--max-tokens", "4", "testorg/tiny", "hello"],
            capture_output=True,
            text=True,
            timeout=200,
            env=env,
        )
        resolved = hub.count("/resolve/")
    assert done.returncode == 0, done.stderr
    assert "started a one-node cluster" in done.stderr and done.stdout.strip()
    assert resolved > 0
    assert any((tmp_path / "cache" / "models").iterdir()), "nothing downloaded into the node's cache"


@pytest.mark.timeout(60)
def test_a_bad_model_reference_is_one_line_and_starts_no_cluster(tmp_path):
    bad = subprocess.run(
        [*RUN, "--port", "0", str(tmp_path / "no-such-model"), "hi"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert bad.returncode != 0
    assert len(bad.stderr.strip().splitlines()) == 1 and bad.stderr.startswith("shardline: error:"), (
        bad.stderr
    )
    assert "one-node cluster" not in bad.stderr and not bad.stdout


class _Stream:
    """Answers every turn with its number, and keeps what each request carried."""

    model = "stand-in"

    def __init__(self) -> None:
        self.sent: list[list[dict[str, str]]] = []

    def answer(self, messages: list[dict[str, str]], write: Any) -> Answer:
        self.sent.append([dict(m) for m in messages])
        text = f"answer {len(self.sent)}"
        write(text)
        return Answer(text, 2, 0.5, 4.0)


def _typed(lines: list[str]) -> Callable[[str], str]:
    """input() for these lines, then Ctrl-D."""
    it = iter(lines)

    def read(_prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


@pytest.mark.timeout(30)
def test_the_conversation_goes_with_every_turn_and_clear_forgets_it(capsys):
    typed = _typed(
        ["Hi", '"""first line', "second line", 'third"""', "/clear", "Again", "/nope", "/bye", "x"]
    )
    stream = _Stream()
    assert chat(stream, "Be brief.", read=typed) == 0  # type: ignore[arg-type]
    system = {"role": "system", "content": "Be brief."}
    assert stream.sent[0] == [system, {"role": "user", "content": "Hi"}]
    assert stream.sent[1] == [
        system,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "first line\nsecond line\nthird"},
    ]
    assert stream.sent[2] == [system, {"role": "user", "content": "Again"}]  # /clear forgot the rest
    assert len(stream.sent) == 3  # /bye left before "x"
    out = capsys.readouterr().out
    assert "Cleared session context" in out and "Unknown command '/nope'" in out
    assert re.search(r"2 tokens, 4\.0 tokens/s", out)


@pytest.mark.timeout(30)
def test_a_block_on_one_line_and_ctrl_d_leaving():
    assert read_message(_typed(['"""one line"""'])) == "one line"
    assert chat(_Stream(), None, read=_typed([])) == 0  # type: ignore[arg-type]
