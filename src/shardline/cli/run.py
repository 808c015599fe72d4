"""`shardline run MODEL [PROMPT]`, as `ollama run` works: join the cluster whose node answers on this machine
(or start a one-node cluster for as long as the command runs), place the model, then answer PROMPT or chat
in the terminal (cli/chat_terminal.py). Everything goes through the node's HTTP API."""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardline.cli.cluster import add_credential_args, credentials
from shardline.cli.common import CliError, add_sampling_args

DEFAULT_API_PORT = 8000  # `shardline node` and the first node of `shardline up` serve HTTP here
NODE_START_S = 120.0  # a node measures its compute and hashes its models before it answers
PLACE_STALL_S = 300.0  # placing may go this long without a change of phase or progress (--timeout)
POLL_S = 0.5  # how often /state is read while waiting; a poll period, not a synchronisation


def cmd_run(args: argparse.Namespace) -> int:
    import httpx

    from shardline.cli.chat_terminal import ChatSampling, ChatStream, answer_once, chat

    if args.max_tokens is not None and args.max_tokens < 1:
        raise CliError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()  # `echo ... | shardline run MODEL`, as ollama reads a pipe
    creds = credentials(args)  # refused here, in one line, rather than by the node it would start
    with (
        _exit_on_signals(),
        _cluster(args, creds) as (url, target),
        httpx.Client(base_url=url, headers=api_headers(), timeout=httpx.Timeout(30.0, read=600.0)) as http,
    ):
        try:
            model = place(http, target, args.timeout)
        except httpx.HTTPError as exc:
            raise CliError(f"the node at {url}: {exc}") from exc
        sampling = ChatSampling(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
        stream = ChatStream(http, model, sampling)
        if prompt is not None:
            return answer_once(stream, prompt, args.system)
        return chat(stream, args.system)


def api_headers() -> dict[str, str]:
    """The node's API key, from $SHARDLINE_API_KEY (never a flag: it would show in the process list)."""
    key = os.environ.get("SHARDLINE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextmanager
def _exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (the terminal closed) end the command through its `finally`s, so a cluster it
    started is stopped whatever way it ends; SIGINT is Ctrl-C's KeyboardInterrupt."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C stops an answer, whatever the parent left: a shell's background job starts with SIGINT ignored,
    # and Python then installs no KeyboardInterrupt of its own.
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@dataclass(frozen=True)
class Target:
    """What to place: the name the cluster lists it under, and what the place request names (the name, or a
    hub repository that one node downloads for the cluster)."""

    name: str
    reference: str


@contextmanager
def _cluster(args: argparse.Namespace, creds: Any) -> Iterator[tuple[str, Target]]:
    """(the HTTP API of a node, what to place there): the node that answers on this machine (or at
    --cluster), else a one-node cluster started here and stopped when the block ends."""
    from shardline.cli.cluster import placed_name

    if args.cluster:
        url = args.cluster.rstrip("/")
        if _probe(url) != "shardline":
            raise CliError(f"no shardline node answers at {url}")
    else:
        url = f"http://127.0.0.1:{args.port}"
        found = _probe(url) if args.port else "nothing"
    if args.cluster or found == "shardline":
        name, source = placed_name(args.model)  # a GGUF file or a cached directory: imported here first
        print(f"shardline: joined the cluster at {url}", file=sys.stderr, flush=True)
        wait_reported(url)
        yield url, Target(name, source or name)
        return
    model_dir, target = _own_target(args.model)  # before any node starts: a bad reference costs nothing
    # Something else on the port: the cluster serves on any free one instead.
    node = OwnNode(model_dir, target, args.port if found == "nothing" else 0, args)
    try:
        url = node.start(creds)
        print(
            f"shardline: started a one-node cluster (HTTP API on {url}); it stops when this command ends",
            file=sys.stderr,
            flush=True,
        )
        yield url, target
    finally:
        node.stop()


def _own_target(model: str) -> tuple[Path | None, Target]:
    """For a cluster of this machine alone: a hub repository is the node's to download (into the cache, as
    any cluster does); anything else is resolved here, so a bad reference fails before a node starts."""
    from shardline.cluster.downloads import named
    from shardline.models.registry import resolve_model

    name, source = named(model) if not Path(model).expanduser().exists() else (model, "")
    if source:
        return None, Target(name, source)
    model_dir = resolve_model(model)
    return model_dir, Target(model_dir.name, model_dir.name)


def _probe(url: str) -> str:
    """What answers at url: "shardline" (a node's /health), "other", or "nothing" (no connection)."""
    import httpx

    try:
        r = httpx.get(url + "/health", timeout=3.0)
    except httpx.ConnectError:
        return "nothing"
    except httpx.HTTPError:
        return "other"
    try:
        return "shardline" if r.status_code == 200 and r.json().get("ok") is True else "other"
    except ValueError:
        return "other"


def wait_reported(url: str, listing: str | None = None, alive: Callable[[], bool] = lambda: True) -> None:
    """Until the cluster at url has a master and every live node has reported (a node that just started has
    not: placing then would find no model), and, with `listing`, a live node holds that model."""
    import httpx

    def ready() -> bool:
        try:
            state = httpx.get(url + "/state", headers=api_headers(), timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return False
        nodes = [n for n in state.get("nodes", []) if n.get("alive")]
        reported = bool(nodes) and all(n.get("resources") is not None for n in nodes)
        held = listing is None or any(listing in n.get("models", []) for n in nodes)
        return bool(state.get("master")) and reported and held

    deadline = time.monotonic() + NODE_START_S
    while not ready():
        if not alive():
            raise CliError("the node it started exited")
        if time.monotonic() > deadline:
            raise CliError(
                f"the cluster at {url} has no master with its nodes' reports after {NODE_START_S:.0f}s"
            )
        threading.Event().wait(POLL_S)


class OwnNode:
    """A `shardline node` child serving one model, on loopback with multicast scouting off (it announces
    nothing), in a state directory of its own that goes when it stops."""

    def __init__(
        self, model_dir: Path | None, target: Target, api_port: int, args: argparse.Namespace
    ) -> None:
        self.model_dir = model_dir
        self.target = target
        self.api_port = api_port
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.state_dir = Path(tempfile.mkdtemp(prefix="shardline-run-"))

    def argv(self) -> list[str]:
        from shardline.models.registry import cache_dir

        # The cache holds it (an import, a known model, a download to come): serve the cache; a model
        # directory elsewhere: its parent.
        models = cache_dir()
        if (
            self.model_dir is not None
            and self.model_dir.resolve() != (models / self.model_dir.name).resolve()
        ):
            models = self.model_dir.parent
        argv = [sys.executable, "-m", "shardline", "node", "--listen", "tcp/127.0.0.1:0", "--name", "run"]
        argv += ["--data-dir", str(self.state_dir), "--models-dir", str(models)]
        argv += ["--api-port", str(self.api_port)]
        if self.args.cluster_key_file is not None:
            argv += ["--cluster-key-file", str(self.args.cluster_key_file)]
        if self.args.tls is not None:
            argv += ["--tls", str(self.args.tls)]
        return argv

    @property
    def log(self) -> Path:
        return self.state_dir / "node.log"

    def start(self, creds: Any) -> str:
        """Start the node; its HTTP API once the node is master of itself and lists the model."""
        from shardline.node.daemon import API_URL_FILE

        env = {**os.environ, **creds.env()}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )  # fmt: skip
        url_file = self.state_dir / API_URL_FILE
        url = self._until(lambda: url_file.is_file() and url_file.read_text().strip(), "its HTTP API")
        listing = self.target.name if self.model_dir is not None else None  # a download: nobody holds it
        try:
            wait_reported(url, listing, alive=lambda: self.proc is not None and self.proc.poll() is None)
        except CliError as exc:
            raise CliError(f"{exc}: {self._last_line()}") from None
        return url

    def _until(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + NODE_START_S
        while True:
            if value := check():
                return value
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise CliError(f"the node it started exited ({self.proc.returncode}): {self._last_line()}")
            if time.monotonic() > deadline:
                raise CliError(f"the node it started showed no {what} within {NODE_START_S:.0f}s")
            threading.Event().wait(POLL_S)

    def _last_line(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        """SIGTERM (the node stops its runners), a grace period, then SIGKILL to what is left of its group."""
        from shardline.cli.local import stop_nodes

        try:
            if self.proc is not None:
                stop_nodes([self.proc], grace_s=15.0)
        finally:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def place(http: Any, target: Target, stall_s: float) -> str:
    """Place the model unless an instance serves it already; the model name requests use, once ready."""
    rec = next((r for r in _instances(http) if r["model"] == target.name and r["phase"] != "failed"), None)
    with Waiting(target.name, stall_s) as waiting:
        if rec is None:
            rec = _placed(http, target, waiting)
        while rec["phase"] != "ready":
            if rec["phase"] == "failed":
                raise CliError(
                    f"{target.name} could not be loaded: {rec.get('why') or 'the instance failed'}"
                )
            waiting.show(rec["phase"])
            threading.Event().wait(POLL_S)
            rec = next((r for r in _instances(http) if r["instance"] == rec["instance"]), None)
            if rec is None:
                raise CliError(f"the instance of {target.name} is gone from the cluster")
    return rec["model"]


def _placed(http: Any, target: Target, waiting: Waiting) -> dict[str, Any]:
    """POST /instances, which answers once the model is placed: after the download, when one node fetches
    it for the cluster. Meanwhile /state's download progress is shown."""
    import httpx

    answer: list[Any] = []

    def post() -> None:
        try:
            answer.append(
                http.post(
                    "/instances", json={"model": target.reference}, timeout=httpx.Timeout(30.0, read=None)
                )
            )
        except Exception as exc:
            answer.append(exc)

    poster = threading.Thread(target=post, daemon=True, name="place")
    poster.start()
    while not answer:
        waiting.show(download_text(_get(http, "/state"), target.name) or "placing")
        poster.join(POLL_S)
    r = answer[0]
    if isinstance(r, Exception):
        raise CliError(f"placing {target.name}: {r}")
    if r.status_code != 201:
        raise CliError(error_message(r))
    return r.json()


def download_text(state: dict[str, Any], name: str) -> str:
    """What /state says of a node downloading the model for the cluster; "" when none does."""
    for node in state.get("nodes", []):
        p = (node.get("downloads") or {}).get(name)
        if not p:
            continue
        who = node.get("name") or node["node_id"]
        if p.get("phase") == "failed":
            raise CliError(f"node {who} could not download {name}: {p.get('error')}")
        done, total = p.get("done_bytes", 0), p.get("total_bytes", 0)
        size = f"{done / total:.0%} of {total / 1e9:.2f} GB" if total else f"{done / 1e6:.0f} MB"
        return f"node {who} {p.get('phase', 'downloading')} {p.get('source')}: {size}"
    return ""


class Waiting:
    """A spinner line on a terminal's stderr, saying what placing is doing. It gives up once the text has not
    changed for stall_s: a download that moves takes the minutes it needs, a hang does not."""

    FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, name: str, stall_s: float) -> None:
        self.name = name
        self.stall_s = stall_s
        self.tty = sys.stderr.isatty()
        self.frames = itertools.cycle(self.FRAMES)
        self.started = time.monotonic()
        self.last = ""
        self.deadline = self.started + stall_s

    def __enter__(self) -> Waiting:
        return self

    def show(self, text: str) -> None:
        now = time.monotonic()
        if text != self.last:
            self.last, self.deadline = text, now + self.stall_s
        elif now > self.deadline:
            raise CliError(f"{self.name}: nothing changed in {self.stall_s:.0f}s ({text})")
        if self.tty:
            line = f"{next(self.frames)} {self.name}: {text} ({now - self.started:.0f}s)"
            sys.stderr.write("\r\x1b[K" + line)
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.tty and self.last:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _instances(http: Any) -> list[dict[str, Any]]:
    return _get(http, "/state").get("instances", [])


def _get(http: Any, path: str) -> dict[str, Any]:
    r = http.get(path)
    if r.status_code != 200:
        raise CliError(error_message(r))
    return r.json()


def error_message(r: Any) -> str:
    """The message of an error answer, in the OpenAI shape the node uses (else its status)."""
    try:
        r.read()
        body = r.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = None
    return str(message or f"the node answered {r.status_code}")


def add_run(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="chat with a model in the terminal, or answer one prompt: on the cluster of this machine, or on "
        "a one-node cluster started for the command",
    )
    run.add_argument(
        "model", help="the model: a known or cached name, a model directory, or a reference the cluster takes"
    )
    run.add_argument(
        "prompt", nargs="?", default=None, help="answer this and exit (default: chat; a pipe is read as one)"
    )
    run.add_argument(
        "--cluster",
        metavar="URL",
        default=None,
        help="HTTP API of a node of the cluster to use (default: the node answering on --port, if any)",
    )
    run.add_argument(
        "--port",
        type=int,
        default=DEFAULT_API_PORT,
        help="HTTP port of this machine's node; a one-node cluster is started there when none answers "
        "(0: always start one, on any free port)",
    )
    run.add_argument("--system", default=None, help="a system prompt that opens the conversation")
    # Ollama's defaults, a little cooler: at the node's (1.0, the whole distribution) a small model drifts.
    add_sampling_args(run, temperature=0.6, top_p=0.9, top_k=40, repetition_penalty=1.1)
    run.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens per answer (default: until the model stops)"
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=PLACE_STALL_S,
        help="seconds placing the model may go without progress before giving up",
    )
    add_credential_args(run)
    run.set_defaults(func=cmd_run)
