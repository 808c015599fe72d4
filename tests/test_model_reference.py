"""Every kind of model reference resolves through registry.resolve_model, under the name model_name gives:
a known or cached name, an mlx-lm directory, a local GGUF (imported once, by digest; split GGUFs too), and a
Hugging Face reference (an MLX snapshot linked in place, a GGUF imported); `shardline models list/show/rm`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from shardline.models import reference, registry
from shardline.models.errors import ModelError, ModelNotFoundError
from shardline.models.gguf_import import import_gguf
from shardline.models.registry import model_name, resolve_model
from shardline.models.store.manifest import import_record, local_models
from shardline.testing import arch_zoo
from shardline.testing.tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _no_import(*_args: object, **_kw: object) -> None:
    raise AssertionError("imported again")


def _no_hash(*_args: object, **_kw: object) -> None:
    raise AssertionError("hashed again")


@pytest.mark.timeout(120)
def test_local_gguf_imports_once_by_digest(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "My Model.Q8_0.gguf"
    write_tiny_gguf(src, layers=2)
    assert model_name(str(src)) == "My-Model.Q8_0"  # the stem, sanitized, before anything is imported
    path = resolve_model(str(src), progress=False)
    assert path == cache.resolve() / "My-Model.Q8_0" and path.name == model_name(str(src))
    origin = json.loads((path / "shardline_import.json").read_text())["origin"]
    assert origin["kind"] == "file" and origin["path"] == str(src.resolve()) and len(origin["digest"]) == 64
    record = import_record(path)
    assert record is not None and local_models(cache)["My-Model.Q8_0"].digest == record.digest()

    monkeypatch.setattr(reference, "import_gguf", _no_import)
    monkeypatch.setattr(reference, "_sha256", _no_hash)  # kept by (path, size, mtime): not read again
    assert resolve_model(str(src), progress=False) == path
    # The same bytes under another path: hashed once, the import found by its digest.
    monkeypatch.undo()
    monkeypatch.setenv(registry.CACHE_ENV, str(cache.parent))
    other = tmp_path / "elsewhere" / "renamed.gguf"
    other.parent.mkdir()
    other.write_bytes(src.read_bytes())
    monkeypatch.setattr(reference, "import_gguf", _no_import)
    assert resolve_model(str(other), progress=False) == path
    assert model_name(str(other)) == "My-Model.Q8_0"


@pytest.mark.timeout(120)
def test_a_taken_name_gets_a_short_digest(tmp_path: Path, cache: Path) -> None:
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for i, path in enumerate((first, second)):
        path.parent.mkdir()
        write_tiny_gguf(path, seed=i)
    assert resolve_model(str(first), progress=False).name == "m"
    expected = model_name(str(second))
    assert expected.startswith("m-") and len(expected) == len("m-") + 8
    assert resolve_model(str(second), progress=False).name == expected
    assert resolve_model(str(first), progress=False).name == "m"


@pytest.mark.timeout(120)
def test_split_gguf_equals_the_unsplit_import(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole.gguf", tmp_path / "parts" / "tiny.gguf"
    split.parent.mkdir()
    write_tiny_gguf(whole, layers=3, seed=7)
    write_tiny_gguf(split, layers=3, seed=7, split_max_tensors=8)
    parts = sorted(split.parent.iterdir())
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00004.gguf" for i in range(1, 5)]
    expected = load_file(import_gguf(whole, tmp_path / "w", progress=False) / "model.safetensors")
    path = resolve_model(str(parts[2]), progress=False)  # any part names the whole
    assert path.name == "tiny" and model_name(str(parts[0])) == "tiny"
    got = load_file(path / "model.safetensors")
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    origin = reference.origin_of(path)
    assert origin["files"] == [p.name for p in parts] and origin["path"] == str(parts[0].resolve())

    parts[1].unlink()
    with pytest.raises(ModelNotFoundError, match=r"lacks 1 of its 4 parts: tiny-00002-of-00004\.gguf"):
        reference.import_gguf_file(parts[0], progress=False)


@pytest.mark.timeout(120)
def test_directories_and_names(tmp_path: Path, cache: Path) -> None:
    mlx_dir = arch_zoo.write("llama", tmp_path / "mine")
    assert resolve_model(str(mlx_dir)) == mlx_dir.resolve() and model_name(str(mlx_dir)) == "mine"
    cached = arch_zoo.write("qwen3", cache / "cached-one")
    assert resolve_model("cached-one") == cached.resolve() and model_name("cached-one") == "cached-one"
    assert model_name(None) == registry.DEFAULT_MODEL == model_name(registry.DEFAULT_MODEL)


@pytest.mark.timeout(60)
def test_nothing_matches_in_one_line(tmp_path: Path) -> None:
    for ref in ("no-such-model", str(tmp_path / "absent.gguf")):
        with pytest.raises(ModelNotFoundError) as info:
            resolve_model(ref)
        message = str(info.value)
        assert "\n" not in message and ref in message
        for tried in ("directory or GGUF file", "known name", "not in the cache", "Hugging Face reference"):
            assert tried in message
        with pytest.raises(ModelNotFoundError):
            model_name(ref)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a model directory nor a GGUF file"):
        resolve_model(str(tmp_path / "notes.txt"))


def _fake_fetch(tmp_path: Path, calls: list[str]):  # type: ignore[no-untyped-def]
    """hub.fetch as if the hub had answered: an MLX snapshot directory, or a GGUF file."""
    from shardline.models.hub import HubModel

    def fetch(ref, progress=True):  # type: ignore[no-untyped-def]
        calls.append(str(ref))
        snapshot = tmp_path / "hf" / ref.repo_id.replace("/", "--") / "snapshots" / ("a" * 40)
        if ref.quant is None:
            if not snapshot.is_dir():
                arch_zoo.write("llama", snapshot)
            return HubModel("mlx", snapshot, [snapshot / "model.safetensors"], ref.repo_id, "a" * 40, {})
        gguf = snapshot / f"tiny-{ref.quant}.gguf"
        if not gguf.is_file():
            snapshot.mkdir(parents=True, exist_ok=True)
            write_tiny_gguf(gguf, seed=3)
        digest = reference._sha256(gguf, False)
        return HubModel("gguf", gguf, [gguf], ref.repo_id, "b" * 40, {gguf.name: digest}, quant=ref.quant)

    return fetch


@pytest.mark.timeout(120)
def test_hub_references(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardline.models import hub

    calls: list[str] = []
    monkeypatch.setattr(hub, "fetch", _fake_fetch(tmp_path, calls))
    path = resolve_model("org/tiny-mlx")
    repo = hub.parse_repo_ref("org/tiny-mlx")
    assert repo is not None and path.name == model_name("org/tiny-mlx") == repo.model_name
    snapshot = (tmp_path / "hf").resolve() / "org--tiny-mlx" / "snapshots" / ("a" * 40)
    assert path.is_symlink() and path.resolve() == snapshot
    listed = local_models(cache)[path.name]  # a node lists, hashes and serves the linked snapshot
    assert listed.full and listed.digest
    assert reference.origin_of(path)["repo"] == "org/tiny-mlx"
    assert resolve_model("org/tiny-mlx") == path and calls == ["org/tiny-mlx"]  # in the cache: no hub

    gguf = resolve_model("org/tiny-gguf:Q8_0", progress=False)
    assert gguf.name == model_name("org/tiny-gguf:Q8_0") and not gguf.is_symlink()
    origin = reference.origin_of(gguf)
    assert origin["kind"] == "hub" and origin["revision"] == "b" * 40 and origin["quant"] == "Q8_0"
    # The same GGUF bytes as a local file: the import is found by digest, not made again.
    monkeypatch.setattr(reference, "import_gguf", _no_import)
    local = tmp_path / "copy.gguf"
    local.write_bytes(next((tmp_path / "hf" / "org--tiny-gguf").rglob("*.gguf")).read_bytes())
    assert resolve_model(str(local), progress=False) == gguf

    from shardline.cli.main import main

    assert main(["models", "rm", path.name]) == 0  # the link goes, the HF cache's snapshot stays
    assert not path.is_symlink() and (snapshot / "config.json").is_file()
    assert resolve_model("org/tiny-mlx") == path and len(calls) == 3
    shutil.rmtree(snapshot)  # the HF cache was cleaned: the link dangles, and rm still removes it
    assert main(["models", "rm", path.name]) == 0 and not path.is_symlink()


def _cli(*args: str, cache_root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, registry.CACHE_ENV: str(cache_root)}
    return subprocess.run(
        [sys.executable, "-m", "shardline", "models", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.timeout(300)
def test_models_list_show_rm(tmp_path: Path, cache: Path) -> None:
    src = tmp_path / "mine.gguf"
    write_tiny_gguf(src, layers=2)
    pulled = _cli("pull", str(src), cache_root=cache.parent)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip() == str(cache.resolve() / "mine") and "Importing mine.gguf" in pulled.stderr
    arch_zoo.write("qwen3", cache / "plain")

    listed = _cli("list", cache_root=cache.parent)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("\t")[0]: line.split("\t") for line in listed.stdout.splitlines()}
    assert rows["NAME"] == ["NAME", "FORMAT", "SIZE", "SOURCE", "DIGEST"]
    digest = import_record(cache / "mine").digest()  # type: ignore[union-attr]
    assert rows["mine"][1] == "GGUF-imported float32" and rows["mine"][3] == f"file {src.resolve()}"
    assert rows["mine"][4] == digest[:12]
    assert rows["plain"][1] == "float32" and rows["plain"][4] == "-"  # not hashed until a node sees it
    assert rows[registry.DEFAULT_MODEL][1] == "not pulled"

    shown = _cli("show", "mine", cache_root=cache.parent)
    assert shown.returncode == 0, shown.stderr
    assert f"digest: {digest}" in shown.stdout and "config: llama, 2 layers, hidden 8" in shown.stdout
    assert "  model.safetensors\t" in shown.stdout

    removed = _cli("rm", "mine", cache_root=cache.parent)
    assert removed.returncode == 0, removed.stderr
    assert f"the GGUF it was imported from stays: {src.resolve()}" in removed.stdout
    assert src.is_file() and not (cache / "mine").exists()
    assert not list(cache.glob(".mine.*"))  # its digest record and lock went with it

    for bad in (("show", "mine"), ("rm", "nope"), ("show", "../x")):
        failed = _cli(*bad, cache_root=cache.parent)
        assert failed.returncode != 0 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr


@pytest.mark.timeout(300)
def test_hub_references_end_to_end(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through huggingface_hub against the local stand-in hub: an MLX repository used in place, a GGUF
    repository's quant imported, each resolved once (the second resolve asks the hub nothing)."""
    fake_hub = pytest.importorskip("shardline.testing.fake_hub")
    import gguf

    mlx_dir = arch_zoo.write("llama", tmp_path / "mlx")
    ggufs = {}
    for tag, qtype in (("Q8_0", gguf.GGMLQuantizationType.Q8_0), ("Q4_0", gguf.GGMLQuantizationType.Q4_0)):
        write_tiny_gguf(tmp_path / f"tiny-{tag}.gguf", hidden=32, ffn=64, qtype=qtype)
        ggufs[f"tiny-{tag}.gguf"] = (tmp_path / f"tiny-{tag}.gguf").read_bytes()
    write_tiny_gguf(tmp_path / "tiny-F32.gguf", hidden=32, ffn=64)
    ggufs["tiny-F32.gguf"] = (tmp_path / "tiny-F32.gguf").read_bytes()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with fake_hub.FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        commit = hub.add_repo("org/tiny-mlx", {p.name: p.read_bytes() for p in mlx_dir.iterdir()})
        gguf_commit = hub.add_repo("org/tiny-GGUF", ggufs)

        path = resolve_model("org/tiny-mlx", progress=False)
        assert path.name == model_name("org/tiny-mlx") and path.is_symlink()
        assert (tmp_path / "hf").resolve() in path.resolve().parents  # the snapshot, in place
        assert reference.origin_of(path)["revision"] == commit
        assert local_models(cache)[path.name].digest

        quant = resolve_model("org/tiny-GGUF:Q8_0", progress=False)
        assert quant.name == model_name("org/tiny-GGUF:Q8_0") and not quant.is_symlink()
        origin = reference.origin_of(quant)
        assert origin["revision"] == gguf_commit and origin["files"] == ["tiny-Q8_0.gguf"]
        assert "q8_0" in json.loads((quant / "shardline_import.json").read_text())["weight_format"]

        asked = len(hub.requests)
        assert resolve_model("org/tiny-mlx", progress=False) == path
        assert resolve_model("org/tiny-GGUF:Q8_0", progress=False) == quant
        assert len(hub.requests) == asked  # in the cache: the hub is not asked


@pytest.mark.timeout(120)
def test_materialize_into_a_node_models_directory(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node downloading for its cluster: the model lands in its --models-dir, under the name the master
    asked for, never in the cache."""
    from shardline.models import hub

    calls: list[str] = []
    monkeypatch.setattr(hub, "fetch", _fake_fetch(tmp_path, calls))
    root, phases, sizes = tmp_path / "node-models", [], []
    name = model_name("org/tiny-gguf:Q8_0")
    path = registry.materialize(
        "org/tiny-gguf:Q8_0", root, name, on_bytes=lambda d, t: sizes.append((d, t)), on_phase=phases.append
    )
    assert path == root.resolve() / name and phases == ["downloading", "importing"]
    assert sizes[-1][0] == sizes[-1][1] > 0 and local_models(root)[name].digest
    assert not cache.exists() and registry.cache_dir() == cache  # the root was this call's only
    with pytest.raises(ModelError, match="lives under the name"):
        registry.materialize("org/tiny-gguf:Q8_0", root, "other-name")


@pytest.mark.timeout(60)
def test_models_list_says_which_nodes_hold_each(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardline.cli.main import main
    from shardline.cluster import client
    from shardline.cluster import messages as cm

    arch_zoo.write("llama", cache / "held")
    nodes = [
        cm.NodeSummary(node_id="a", name="node-a", endpoint="", alive=True, models=["held"]),
        cm.NodeSummary(node_id="b", name="node-b", endpoint="", alive=False, models=["held"]),
    ]

    class FakeClient:
        def __init__(self, connect: list[str], *_args: object) -> None:
            assert connect == ["tcp/127.0.0.1:9"]

        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *_exc: object) -> None:
            pass

        def wait(self, *_args: object) -> cm.ClusterView:
            return cm.ClusterView(term=1, master="a", nodes=nodes)

    monkeypatch.setattr(client, "ClusterClient", FakeClient)
    assert main(["models", "list", "--cluster", "tcp/127.0.0.1:9"]) == 0
    rows = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert rows["NAME"][-1] == "NODES" and rows["held"][-1] == "node-a"  # node-b is not alive
    assert main(["models", "show", "held", "--cluster", "tcp/127.0.0.1:9"]) == 0
    assert "nodes: node-a" in capsys.readouterr().out
