"""Hugging Face repositories through the real huggingface_hub client, against a stand-in hub on loopback.

An mlx-lm repository, a GGUF repository with three quantizations (and a split one), revisions, a download
cut or killed midway that resumes to the hub's digests, a corrupted file refused, offline use of the cache,
a private repository and HF_TOKEN, and what a user reads when a reference matches nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from shardline.models.errors import CorruptModelError, ModelError, ModelNotFoundError
from shardline.models.hub import RepoRef, fetch, hub_cache, parse_repo_ref
from shardline.models.validate import validate_model_dir
from shardline.testing.fake_hub import FakeHub, gguf_repo_files, mlx_repo_files

pytestmark = pytest.mark.timeout(120)

MLX = "org/tiny-mlx"
GGUF = "org/tiny-gguf"
SPLIT = "org/tiny-split"
MLX_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def repos() -> dict[str, dict[str, bytes]]:
    return {
        MLX: mlx_repo_files("llama"),
        GGUF: gguf_repo_files(),
        SPLIT: gguf_repo_files(quants=("Q8_0",), split="Q4_0"),
    }


@pytest.fixture
def hub(
    repos: dict[str, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeHub]:
    """A fresh hub holding the repositories, HF_ENDPOINT at it and an empty HF home in tmp_path."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    # What huggingface_hub read at import: its cache, and a token file a logged-in user may have.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    # Loopback only: with telemetry on, huggingface_hub asks the endpoint it was imported with (the real
    # hub here) for its agent registry when it builds a user agent.
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    with FakeHub() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        for repo_id, files in repos.items():
            running.add_repo(repo_id, files)
        yield running


def get(text: str) -> object:
    ref = parse_repo_ref(text)
    assert ref is not None, text
    return fetch(ref, progress=False)


def one_line_error(kind: type[Exception], text: str) -> str:
    with pytest.raises(kind) as caught:
        get(text)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def blobs(tmp_path: Path, repo_id: str) -> list[str]:
    folder = tmp_path / "hf" / "hub" / f"models--{repo_id.replace('/', '--')}" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_references_parse_as_the_hub_names_them() -> None:
    assert parse_repo_ref("mlx-community/Qwen3-30B-A3B-4bit") == RepoRef("mlx-community/Qwen3-30B-A3B-4bit")
    assert parse_repo_ref("org/name@v1:q4_k_m") == RepoRef("org/name", "v1", "q4_k_m")
    assert parse_repo_ref("org/name@refs/pr/1") == RepoRef("org/name", "refs/pr/1", None)
    assert parse_repo_ref("hf.co/org/name:Q4_K_M") == RepoRef("org/name", None, "Q4_K_M")  # as Ollama
    assert parse_repo_ref("https://huggingface.co/org/name") == RepoRef("org/name")
    for text in (
        "smollm2-135m-instruct",
        "./org/name",
        "/abs/path",
        "org/na--me",
        "org/..",
        "a/b/c",
        "org/x@",
    ):
        assert parse_repo_ref(text) is None, text
    names = {
        "org/name": "org--name",
        "org/name:q8_0": "org--name--Q8_0",
        "org/name@v1:Q8_0": "org--name--v1--Q8_0",
        "org/name@refs/pr/1": "org--name--refs_pr_1",
    }
    for text, name in names.items():
        ref = parse_repo_ref(text)
        assert ref is not None and ref.model_name == name
    assert len({parse_repo_ref(t).model_name for t in names}) == len(names)  # type: ignore[union-attr]


def test_mlx_repository_is_fetched_verified_and_then_used_in_place(hub: FakeHub) -> None:
    model = get(MLX)
    assert model.kind == "mlx" and model.path.is_dir() and model.revision == hub.commit(MLX)
    assert {p.name for p in model.files} == MLX_FILES  # README.md and .gitattributes stay on the hub
    expected = hub.sha256s(MLX)
    assert model.digests == {name: expected[name] for name in MLX_FILES}
    for path in model.files:
        assert path.read_bytes() == hub.files(MLX)[path.name].data
    validate_model_dir(model.path)
    assert model.model_name == "org--tiny-mlx"

    before = hub.count()
    again = get(MLX)
    assert again == model
    assert hub.count() - before == 1 and hub.count("/resolve/") == len(MLX_FILES)  # the revision, no bytes


def test_a_snapshot_huggingface_hub_downloaded_is_used_in_place(hub: FakeHub) -> None:
    from huggingface_hub import snapshot_download

    snapshot = snapshot_download(
        MLX, endpoint=hub.url, allow_patterns=sorted(MLX_FILES), cache_dir=hub_cache()
    )
    downloads = hub.count("/resolve/")
    model = get(MLX)
    assert str(model.path) == snapshot and hub.count("/resolve/") == downloads
    assert model.digests == {name: hub.sha256s(MLX)[name] for name in MLX_FILES}


def test_gguf_quantization_is_chosen_as_llama_cpp_does(hub: FakeHub) -> None:
    chosen = get(f"{GGUF}:q8_0")
    assert (
        chosen.kind == "gguf"
        and chosen.quant == "Q8_0"
        and [p.name for p in chosen.files] == ["Tiny-Q8_0.gguf"]
    )
    assert chosen.path.read_bytes() == hub.files(GGUF)["Tiny-Q8_0.gguf"].data
    assert chosen.digests == {"Tiny-Q8_0.gguf": hub.sha256s(GGUF)["Tiny-Q8_0.gguf"]}
    assert chosen.model_name == "org--tiny-gguf--Q8_0"
    assert hub.count("Tiny-Q4_0") == 0 and hub.count("Tiny-F32") == 0  # only the quant asked for

    default = get(GGUF)  # no Q4_K_M in the repository: the first GGUF
    assert default.quant == "F32" and default.path.name == "Tiny-F32.gguf"
    hub.add_repo(
        "org/with-default", {"m-Q8_0.gguf": b"eight", "m-Q4_K_M.gguf": b"four", "mmproj-F16.gguf": b"v"}
    )
    assert get("org/with-default").path.name == "m-Q4_K_M.gguf"

    message = one_line_error(ModelNotFoundError, f"{GGUF}:Q5_K_S")
    assert "Q5_K_S" in message and "available: F32, Q4_0, Q8_0" in message

    split = get(f"{SPLIT}:Q4_0")
    names = [p.name for p in split.files]
    assert names == [f"Tiny-Q4_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)] and split.path == split.files[0]
    assert split.digests == {n: hub.sha256s(SPLIT)[n] for n in names}


def test_a_revision_is_its_own_commit_and_content(hub: FakeHub, repos: dict[str, dict[str, bytes]]) -> None:
    old = {**repos[MLX], "config.json": repos[MLX]["config.json"].replace(b"{", b'{"revision_mark": 1, ', 1)}
    v1 = hub.add_repo(MLX, old, revision_name="v1")
    tagged, main = get(f"{MLX}@v1"), get(MLX)
    assert tagged.revision == v1 != main.revision == hub.commit(MLX)
    assert b"revision_mark" in (tagged.path / "config.json").read_bytes()
    assert b"revision_mark" not in (main.path / "config.json").read_bytes()
    assert tagged.digests["config.json"] != main.digests["config.json"]
    assert tagged.digests["model.safetensors"] == main.digests["model.safetensors"]
    assert tagged.model_name == "org--tiny-mlx--v1" != main.model_name
    assert get(f"{MLX}@{v1}").revision == v1  # a commit sha is a revision too
    one_line_error(ModelNotFoundError, f"{MLX}@v9")


def test_a_cut_connection_resumes_with_a_range_request(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)  # bytes reach the disk before the cut
    hub.cut_after(MLX, "model.safetensors", 200_000)
    model = get(MLX)
    assert model.digests["model.safetensors"] == hub.sha256s(MLX)["model.safetensors"]
    ranges = [r.range for r in hub.requests if r.path.endswith("model.safetensors") and r.range]
    assert ranges and int(ranges[0].removeprefix("bytes=").rstrip("-")) >= 16384


def test_a_killed_download_resumes_and_ends_with_the_hubs_digests(hub: FakeHub, tmp_path: Path) -> None:
    weights = hub.files(MLX)["model.safetensors"]
    reached = hub.hold_after(MLX, "model.safetensors", 400_000)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, MLX],
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert reached.wait(60), "the child never reached the middle of the download"
        partial = tmp_path / "hf" / "hub" / "models--org--tiny-mlx" / "blobs" / f"{weights.sha256}.incomplete"
        wait_for(lambda: partial.is_file() and partial.stat().st_size >= 300_000, 30, "the partial blob")
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(30)
        hub.release(MLX, "model.safetensors")
    have = partial.stat().st_size

    model = get(MLX)
    assert model.digests == {name: hub.sha256s(MLX)[name] for name in MLX_FILES}
    assert (model.path / "model.safetensors").read_bytes() == weights.data
    assert any(r.range == f"bytes={have}-" for r in hub.requests), "no range request from the partial blob"
    assert not partial.exists()


KILLED_CHILD = """
import sys
from huggingface_hub import constants
constants.DOWNLOAD_CHUNK_SIZE = 16384  # each chunk reaches the disk as it arrives
from shardline.models.hub import fetch, parse_repo_ref
fetch(parse_repo_ref(sys.argv[1]), progress=False)
"""


def test_a_file_corrupted_on_the_endpoint_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    expected = hub.sha256s(MLX)["model.safetensors"]
    hub.corrupt(MLX, "model.safetensors")
    message = one_line_error(CorruptModelError, MLX)
    assert f"{MLX}/model.safetensors" in message and expected[:12] in message and "sha256" in message
    assert expected not in blobs(tmp_path, MLX) and not any(
        b.endswith(".incomplete") for b in blobs(tmp_path, MLX)
    )

    hub.restore(MLX, "model.safetensors")
    hub.corrupt(MLX, "tokenizer.json")  # a small file (not fetched yet): its git blob sha1
    message = one_line_error(CorruptModelError, MLX)
    assert "tokenizer.json" in message and "git sha1" in message
    hub.restore(MLX, "tokenizer.json")
    assert get(MLX).digests["model.safetensors"] == expected


def test_offline_uses_the_cache_without_a_request_and_names_what_is_absent(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    online, quant = get(MLX), get(f"{GGUF}:Q4_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = hub.count()
    assert get(MLX) == online
    assert get(f"{GGUF}:Q4_0") == quant
    assert hub.count() == before
    message = one_line_error(ModelNotFoundError, "org/absent")
    assert "offline" in message and "org/absent" in message
    message = one_line_error(ModelNotFoundError, f"{GGUF}:Q8_0")
    assert "offline" in message and "Q8_0" in message and "Q4_0" in message  # what the cache has
    assert hub.count() == before


def test_an_unreachable_hub_falls_back_to_the_cache(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    online = get(MLX)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    assert get(MLX) == online
    message = one_line_error(ModelNotFoundError, GGUF)
    assert "cannot reach http://127.0.0.1:9" in message and GGUF in message


def test_a_private_repository_needs_hf_token(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_repo("org/private", {"Secret-Q8_0.gguf": b"weights"}, token="hf_secret")
    message = one_line_error(ModelNotFoundError, "org/private")
    assert "org/private" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert get("org/private").path.read_bytes() == b"weights"
    sent = [r for r in hub.requests if "private" in r.path]
    assert any(r.authorization == "Bearer hf_secret" for r in sent)
    assert all(r.authorization is None for r in sent if r.path.startswith("/_cdn/"))  # not off the hub


def test_a_repository_with_no_model_says_what_it_holds(hub: FakeHub) -> None:
    hub.add_repo("org/torch", {"pytorch_model.bin": b"x", "README.md": b"y", "config.json": b"{}"})
    message = one_line_error(ModelNotFoundError, "org/torch")
    assert "pytorch_model.bin" in message and "neither" in message
    message = one_line_error(ModelNotFoundError, "org/torch:Q4_0")
    assert "no .gguf" in message
    assert isinstance(ModelNotFoundError("x"), ModelError)


def test_the_stand_in_hub_runs_as_a_process_and_reports_its_requests(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a multi-node test uses it: `python -m shardline.testing.fake_hub`, its counts over HTTP."""
    import json
    import urllib.request

    command = [sys.executable, "-m", "shardline.testing.fake_hub", "--gguf", "org/served"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().split()
        assert line[:1] == ["FAKE_HUB"], server.stderr.read() if server.stderr else line
        monkeypatch.setenv("HF_ENDPOINT", line[1])
        model = get("org/served:Q4_0")
        assert model.path.name == "Tiny-Q4_0.gguf"
        with urllib.request.urlopen(f"{line[1]}/_fake/requests", timeout=10) as answer:
            counts = json.load(answer)
        assert counts["total"] == 3  # model info, resolve, the CDN's bytes
        assert all(agent.startswith("shardline/") for agent in counts["by_user_agent"])
    finally:
        server.terminate()
        assert server.wait(30) == 0


def test_a_gated_repository_says_so_in_one_line(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_repo("org/gated", {"Gated-Q8_0.gguf": b"weights"})
    hub.gate("org/gated", "hf_accepted")
    message = one_line_error(ModelError, "org/gated")
    assert "org/gated is gated" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", "hf_accepted")
    assert get("org/gated").path.read_bytes() == b"weights"
