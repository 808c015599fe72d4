"""Weight distribution: a node fetches exactly its stage's tensors from a peer over zenoh, resumable, checked.

Two zenoh sessions in one process (peer mode, loopback only, multicast scouting off): one serves its models,
the other fetches. Fetched stages must load and compute bit for bit like the same stage of the full model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
import zenoh
from tampering_node import flip_first_byte

from shardline.cluster.weights.fetch import FetchStats, fetch_shard
from shardline.cluster.weights.protocol import ChunkRequest, ErrorReply
from shardline.cluster.weights.server import Tamper, WeightServer
from shardline.cluster.weights.stage import StageWeights, versions_dir
from shardline.compute.shard import LayerRange, load_shard, split_layers
from shardline.dataplane.transport import open_session
from shardline.models.errors import CorruptModelError
from shardline.models.store.errors import (
    ModelNotOnSourceError,
    SourceRefusedError,
    SourceUnavailableError,
    WeightsError,
)
from shardline.models.store.files import SHARD_MANIFEST, WEIGHTS_FILE
from shardline.models.store.manifest import (
    FileEntry,
    Manifest,
    ModelPresence,
    SourceInfo,
    StageSpan,
    TensorEntry,
    import_record,
    local_models,
    model_manifest,
    read_shard_manifest,
    record_import,
    tensors_for,
)
from shardline.models.store.verify import verify_shard
from shardline.testing.tiny import make_tiny_model

NS = "test-weights"
SMALL_CHUNK = 4096  # tiny tensors are tens of KB: several chunks each, and a short last chunk
BLOCK = 16  # KV positions per cache block: small, so that a request's cache spans several


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sessions() -> Iterator[tuple[zenoh.Session, zenoh.Session]]:
    endpoint = f"tcp/127.0.0.1:{_free_port()}"
    server = open_session([endpoint], [])
    client = open_session([], [endpoint])
    yield server, client
    client.close()
    server.close()


@pytest.fixture
def serve(sessions: tuple[zenoh.Session, zenoh.Session]) -> Iterator:
    servers: list[WeightServer] = []

    def start(models_root: Path, node: str = "src", tamper: Tamper | None = None) -> WeightServer:
        servers.append(WeightServer(sessions[0], NS, node, models_root, tamper=tamper))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def client(sessions: tuple[zenoh.Session, zenoh.Session]) -> zenoh.Session:
    return sessions[1]


class Interrupted(Exception):
    pass


class Progress:
    """Records (done, total) calls; optionally fails after `fail_after` calls (an interrupted fetch)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.fail_after = fail_after

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise Interrupted(f"interrupted by the test at {done} of {total} bytes")

    def assert_monotonic(self) -> None:
        assert self.calls
        for (d0, t0), (d1, t1) in zip(self.calls, self.calls[1:], strict=False):
            assert d0 <= d1 and t0 <= t1, self.calls
        assert all(0 <= d <= t for d, t in self.calls)


def _tensor_names(model_dir: Path) -> list[str]:
    return list(model_manifest(model_dir).tensors)


def _stage_input(shard, layers: LayerRange, n: int = 5) -> mx.array:
    key = mx.random.key(layers.start + 7)
    if layers.is_first:
        return mx.random.randint(0, int(shard.config["vocab_size"]), (1, n), key=key)
    return mx.random.normal((1, n, shard.hidden_size), key=key)


def _assert_same_outputs(fetched: Path, full: Path, layers: LayerRange) -> None:
    a, b = load_shard(fetched, layers), load_shard(full, layers)
    x = _stage_input(b, layers)
    out_a, out_b = a.forward(x, a.make_cache(BLOCK)), b.forward(x, b.make_cache(BLOCK))
    assert out_a.dtype == out_b.dtype and out_a.shape == out_b.shape
    assert mx.array_equal(out_a, out_b).item(), f"stage {layers} differs from the full model's"


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ pure parts


@pytest.mark.timeout(10)
def test_tensors_for_picks_layers_embedding_and_head() -> None:
    names = [
        "model.embed_tokens.weight",
        *(f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)),
        "model.layers.1.self_attn.q_proj.scales",
        "model.norm.weight",
        "lm_head.weight",
        "model.rotary_emb.inv_freq",
    ]
    assert tensors_for(names, 0, 2, 4, tied=False) == [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.scales",
    ]
    assert tensors_for(names, 2, 4, 4, tied=False) == [
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    # Tied: the last stage computes logits with the embedding.
    assert "model.embed_tokens.weight" in tensors_for(names, 2, 4, 4, tied=True)
    assert tensors_for(names, 1, 2, 4, tied=True) == [
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.scales",
    ]
    assert len(tensors_for(names, 0, 4, 4, tied=False)) == len(names) - 1  # all but the unknown buffer
    with pytest.raises(ValueError):
        tensors_for(names, 2, 2, 4, tied=False)


@pytest.mark.timeout(10)
def test_wire_models_round_trip() -> None:
    tensor = TensorEntry(dtype="F32", shape=[2, 3], file=WEIGHTS_FILE, offset=64, bytes=24, sha256="ab")
    values = [
        Manifest(
            model="m",
            num_layers=2,
            tied=True,
            metadata={"format": "mlx"},
            files={"config.json": FileEntry(size=3, sha256="cd")},
            tensors={"model.layers.0.w": tensor},
            layers=StageSpan(start=0, end=1, total=2),
            source=SourceInfo(node="n1", digest="ef"),
            stamps={WEIGHTS_FILE: (88, 123)},
        ),
        ChunkRequest(name="model.layers.0.w", offset=8, length=16, digest="ef"),
        ErrorReply(code="no_model", message="node n1 has no model 'x'"),
        ModelPresence(full=False, start=0, end=1, total=2, bytes=24),
    ]
    for value in values:
        assert type(value).model_validate_json(value.model_dump_json()) == value


# ------------------------------------------------------------------------------------------------ fetching


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # an untied and a tied head
def test_fetched_stages_hold_their_tensors_and_compute_like_the_full_model(
    arch: str, tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    full = tiny_models[arch]
    serve(full.parent)
    names = _tensor_names(full)
    tied = arch != "llama"
    total = int(json.loads((full / "config.json").read_text())["num_hidden_layers"])
    for stages in (2, 3):
        for i, layers in enumerate(split_layers(total, stages)):
            progress = Progress()
            dest = fetch_shard(
                client, NS, "src", arch, layers.start, layers.end, tmp_path / f"{stages}-{i}",
                progress=progress, chunk_bytes=SMALL_CHUNK,
            )  # fmt: skip
            want = tensors_for(names, layers.start, layers.end, total, tied)
            manifest = read_shard_manifest(dest)
            assert sorted(manifest.tensors) == sorted(want)
            assert manifest.layers == StageSpan(start=layers.start, end=layers.end, total=total)
            # The file itself holds exactly those tensors, nothing else.
            assert sorted(mx.load(str(dest / WEIGHTS_FILE))) == sorted(want)
            assert verify_shard(dest) == []
            progress.assert_monotonic()
            done, size = progress.calls[-1]
            assert done == size >= sum(manifest.tensors[n].bytes for n in want)
            _assert_same_outputs(dest, full, layers)
            presence = local_models(dest.parent)[arch]
            assert (presence.full, presence.start, presence.end) == (False, layers.start, layers.end)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama-q4g64", "qwen3-q4g128", "qwen3-q8g64-bf16"])
def test_fetched_stages_of_a_quantized_model_carry_scales_and_biases(
    name: str, tiny_quantized_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    """Packed uint32 weights travel with their scales and biases (float32 or bfloat16), as stored, and the
    stage computes bit for bit what the same stage of the whole model does."""
    full = tiny_quantized_models[name]
    serve(full.parent)
    names = _tensor_names(full)
    config = json.loads((full / "config.json").read_text())
    total, tied = int(config["num_hidden_layers"]), bool(config["tie_word_embeddings"])
    for i, layers in enumerate(split_layers(total, 3)):
        dest = fetch_shard(
            client, NS, "src", name, layers.start, layers.end, tmp_path / str(i), chunk_bytes=SMALL_CHUNK
        )
        manifest = read_shard_manifest(dest)
        want = tensors_for(names, layers.start, layers.end, total, tied)
        assert sorted(manifest.tensors) == sorted(want)
        packed = [n for n, e in manifest.tensors.items() if e.dtype == "U32"]
        assert packed and all(n.endswith(".weight") for n in packed)
        for n in packed:  # every packed weight came with its scales and biases
            stem = n.removesuffix(".weight")
            assert {f"{stem}.scales", f"{stem}.biases"} <= manifest.tensors.keys(), n
        assert verify_shard(dest) == []
        _assert_same_outputs(dest, full, layers)


@pytest.mark.timeout(30)
def test_a_partial_directory_never_loads_another_range(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    serve(tiny_models["llama"].parent)
    dest = fetch_shard(client, NS, "src", "llama", 2, 4, tmp_path, chunk_bytes=SMALL_CHUNK)
    with pytest.raises(CorruptModelError, match=r"model\.layers\.1\."):
        load_shard(dest, LayerRange(1, 4, 6))  # layer 1 is not there: an error, never random weights


@pytest.mark.timeout(30)
def test_interrupted_fetch_resumes_where_it_stopped(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    full = tiny_models["llama"]
    serve(full.parent)
    interrupted = Progress(fail_after=30)
    with pytest.raises(Interrupted):
        fetch_shard(
            client, NS, "src", "llama", 0, 3, tmp_path, progress=interrupted, chunk_bytes=SMALL_CHUNK,
            parallel=2,
        )  # fmt: skip
    assert not (tmp_path / "llama").exists()  # nothing half-done in place of the stage
    done_before, whole = interrupted.calls[-1]
    assert 0 < done_before < whole

    progress, stats = Progress(), FetchStats()
    dest = fetch_shard(
        client, NS, "src", "llama", 0, 3, tmp_path, progress=progress, chunk_bytes=SMALL_CHUNK, stats=stats
    )
    progress.assert_monotonic()
    assert progress.calls[0][0] >= stats.bytes_resumed > 0  # starts from what was already in
    tensor_bytes = sum(e.bytes for e in read_shard_manifest(dest).tensors.values())
    assert 0 < stats.bytes_received < tensor_bytes
    assert stats.bytes_received + stats.bytes_resumed + stats.bytes_reused >= tensor_bytes
    assert verify_shard(dest) == []
    _assert_same_outputs(dest, full, LayerRange(0, 3, 6))
    assert not list(tmp_path.glob(".llama.fetch*/*"))  # no working files left behind


@pytest.mark.timeout(30)
def test_corruption_is_found_and_only_that_tensor_fetched_again(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    full = tiny_models["qwen3"]
    serve(full.parent)
    dest = fetch_shard(client, NS, "src", "qwen3", 3, 6, tmp_path, chunk_bytes=SMALL_CHUNK)
    weights = dest / WEIGHTS_FILE
    clean = _file_sha(weights)
    victim = "model.layers.4.mlp.down_proj.weight"
    entry = read_shard_manifest(dest).tensors[victim]
    with weights.open("r+b") as f:
        f.seek(entry.offset + entry.bytes // 2)
        byte = f.read(1)
        f.seek(entry.offset + entry.bytes // 2)
        f.write(bytes([byte[0] ^ 0x5A]))
    assert verify_shard(dest) == [victim]

    stats = FetchStats()
    again = fetch_shard(client, NS, "src", "qwen3", 3, 6, tmp_path, chunk_bytes=SMALL_CHUNK, stats=stats)
    assert again == dest
    assert stats.bytes_received == entry.bytes  # the rest came from the local copy
    assert verify_shard(dest) == []
    assert _file_sha(weights) == clean
    _assert_same_outputs(dest, full, LayerRange(3, 6, 6))

    # A damaged header makes the file unloadable though every tensor is intact: repaired without the network.
    with weights.open("r+b") as f:
        f.seek(9)
        f.write(b"#")
    assert WEIGHTS_FILE in verify_shard(dest)
    stats = FetchStats()
    fetch_shard(client, NS, "src", "qwen3", 3, 6, tmp_path, chunk_bytes=SMALL_CHUNK, stats=stats)
    assert stats.bytes_received == 0 and verify_shard(dest) == [] and _file_sha(weights) == clean

    # Intact: nothing travels, nothing is rewritten.
    stats = FetchStats()
    fetch_shard(client, NS, "src", "qwen3", 3, 6, tmp_path, stats=stats)
    assert stats.bytes_received == stats.bytes_reused == 0


@pytest.mark.timeout(30)
def test_a_corrupt_source_is_a_clear_error(serve, client: zenoh.Session, tmp_path: Path) -> None:
    root = tmp_path / "models"
    model = make_tiny_model(root / "bad", "llama")
    model_manifest(model)  # hashed while intact, cached beside the directory
    weights = model / "model.safetensors"
    entry = model_manifest(model).tensors["model.layers.0.self_attn.q_proj.weight"]
    st = weights.stat()
    with weights.open("r+b") as f:  # bit rot: same size, same mtime
        f.seek(entry.offset)
        f.write(b"\xff\xff\xff\xff")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    serve(root)
    with pytest.raises(WeightsError, match=r"q_proj\.weight.*does not match its sha256"):
        fetch_shard(client, NS, "src", "bad", 0, 2, tmp_path / "dest", chunk_bytes=SMALL_CHUNK, retries=1)
    assert not (tmp_path / "dest" / "bad").exists()


@pytest.mark.timeout(30)
def test_sources_without_the_model_are_clear_errors(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    serve(tiny_models["llama"].parent)
    with pytest.raises(ModelNotOnSourceError, match=r"node src has no model 'no-such-model'"):
        fetch_shard(client, NS, "src", "no-such-model", 0, 1, tmp_path)

    t0 = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="node ghost does not answer"):
        fetch_shard(client, NS, "ghost", "llama", 0, 1, tmp_path, discover_s=0.5)
    assert time.monotonic() - t0 < 10

    with pytest.raises(ValueError, match="bad layer range"):
        fetch_shard(client, NS, "src", "llama", 4, 9, tmp_path)

    # A node holding one stage serves it, but only layers it has.
    stage_root = tmp_path / "stage-node"
    fetch_shard(client, NS, "src", "llama", 2, 6, stage_root, chunk_bytes=SMALL_CHUNK)
    serve(stage_root, node="stage")
    with pytest.raises(ModelNotOnSourceError, match=r"holds layers \[2, 6\) of llama, not \[0, 3\)"):
        fetch_shard(client, NS, "stage", "llama", 0, 3, tmp_path / "other")
    dest = fetch_shard(client, NS, "stage", "llama", 4, 6, tmp_path / "other", chunk_bytes=SMALL_CHUNK)
    _assert_same_outputs(dest, tiny_models["llama"], LayerRange(4, 6, 6))
    assert read_shard_manifest(dest).source.node == "stage"


@pytest.mark.timeout(30)
def test_fetch_never_overwrites_a_model_it_did_not_fetch(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    serve(tiny_models["llama"].parent)
    shutil.copytree(tiny_models["llama"], tmp_path / "llama")
    with pytest.raises(WeightsError, match="not fetched as a stage"):
        fetch_shard(client, NS, "src", "llama", 0, 3, tmp_path)
    assert local_models(tmp_path)["llama"].full
    assert not (tmp_path / "llama" / SHARD_MANIFEST).exists()


# ------------------------------------------------------------------------------------------------ trust


def _flip_layer(layer: int) -> Tamper:
    """Alters the bytes of one layer's tensors only: what comes before it from the same source is right."""
    flip = flip_first_byte("llama")
    return lambda model, kind, name, offset, data: (
        flip(model, kind, name, offset, data) if f".layers.{layer}." in name else data
    )


@pytest.mark.timeout(60)
def test_a_lying_source_is_refused_and_the_next_holder_resumes_what_was_checked(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    full = tiny_models["llama"]
    expected = model_manifest(full).digest()
    serve(
        full.parent, node="liar", tamper=_flip_layer(2)
    )  # its manifest and digest are honest, its bytes not
    serve(full.parent, node="honest")
    with pytest.raises(SourceRefusedError, match=r"layers\.2\..*does not match its sha256") as refused:
        fetch_shard(
            client,
            NS,
            "liar",
            "llama",
            0,
            6,
            tmp_path,
            chunk_bytes=SMALL_CHUNK,
            parallel=1,
            expected=expected,
        )
    assert (refused.value.node, refused.value.model) == ("liar", "llama")
    assert not (tmp_path / "llama").exists()

    stats = FetchStats()
    dest = fetch_shard(
        client, NS, "honest", "llama", 0, 6, tmp_path, chunk_bytes=SMALL_CHUNK, stats=stats, expected=expected
    )
    tensor_bytes = sum(e.bytes for e in read_shard_manifest(dest).tensors.values())
    assert (
        stats.bytes_resumed > 0 and 0 < stats.bytes_received < tensor_bytes
    )  # layers 0-1 were checked already
    assert verify_shard(dest) == [] and read_shard_manifest(dest).model_digest() == expected
    _assert_same_outputs(dest, full, LayerRange(0, 6, 6))


@pytest.mark.timeout(60)
def test_another_version_or_a_stage_holder_is_refused_before_any_byte(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    full = tiny_models["llama"]
    expected = model_manifest(full).digest()
    other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)  # same name, other weights
    serve(other.parent, node="stale")
    stats = FetchStats()
    with pytest.raises(SourceRefusedError, match=r"has digest \w+, not the expected"):
        fetch_shard(client, NS, "stale", "llama", 0, 3, tmp_path / "a", stats=stats, expected=expected)
    assert stats.bytes_received == 0 and not (tmp_path / "a" / "llama").exists()
    # Without an expected digest the copy only agrees with its own source: that is what `expected` is for.
    fetch_shard(client, NS, "stale", "llama", 0, 3, tmp_path / "b")

    # A stage holder lists only its tensors: the model digest cannot be recomputed, so it proves nothing.
    serve(full.parent, node="src")
    fetch_shard(
        client, NS, "src", "llama", 0, 6, tmp_path / "stage", chunk_bytes=SMALL_CHUNK, expected=expected
    )
    serve(tmp_path / "stage", node="stage")
    with pytest.raises(SourceRefusedError, match="holds one stage only"):
        fetch_shard(client, NS, "stage", "llama", 0, 3, tmp_path / "c", expected=expected)


@pytest.mark.timeout(60)
def test_a_node_never_loads_an_unchecked_copy_of_a_stage(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    holders = tmp_path / "holders"
    shutil.copytree(tiny_models["llama"], holders / "llama")
    expected = record_import(holders / "llama").digest()
    mine = tmp_path / "mine"
    shutil.copytree(holders / "llama", mine / "llama")
    record = record_import(mine / "llama")
    assert record.digest() == expected
    entry = record.tensors["model.layers.1.mlp.gate_proj.weight"]
    weights = mine / "llama" / "model.safetensors"
    st = weights.stat()
    with weights.open("r+b") as f:  # altered after its import, size and mtime kept
        f.seek(entry.offset + 5)
        f.write(b"\x00\x01\x02\x03")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    serve(holders, node="liar", tamper=flip_first_byte("llama"))
    serve(holders, node="honest")

    notices: list[tuple[str, str]] = []
    rescans: list[int] = []
    weights_of = StageWeights(client, NS, "me", mine, changed=lambda: rescans.append(1))
    sources = ["liar", "me", "honest"]
    notify = lambda node, message: notices.append((node, message))  # noqa: E731
    progress = Progress()
    beat = lambda done, total, source: progress(done, total)  # noqa: E731
    dest = weights_of.get("llama", 0, 3, expected, sources, beat, notify)
    assert dest == mine / "llama" and read_shard_manifest(dest).source.node == "honest"
    assert [n for n, _ in notices] == ["me", "liar"]
    assert "does not match the expected digest" in notices[0][1] and "gate_proj" in notices[0][1]
    assert "refused as a source of llama" in notices[1][1] and "checked by node me" in notices[1][1]
    [aside] = list(mine.glob(".llama.rejected-*"))
    assert aside.is_dir() and rescans  # moved aside, never deleted; the node rescans its models
    _assert_same_outputs(dest, tiny_models["llama"], LayerRange(0, 3, 6))

    # Checked again before every load: intact, it is used as it is; another version never is.
    assert weights_of.get("llama", 0, 3, expected, [], beat, notify) == dest and len(notices) == 2
    with pytest.raises(WeightsError, match="on no other node"):
        weights_of.get("llama", 0, 3, "0" * 64, ["me"], beat, notify)
    assert (
        notices[-1][0] == "me"
        and "stage copy of model llama" in notices[-1][1]
        and "another version" in notices[-1][1]
    )
    with pytest.raises(WeightsError, match="no expected digest"):
        weights_of.get("llama", 0, 3, "", sources, beat, notify)


@pytest.mark.timeout(120)
def test_a_legitimate_copy_of_another_version_is_kept_and_the_expected_stage_fetched_beside_it(
    tiny_models: dict[str, Path], serve, client: zenoh.Session, tmp_path: Path
) -> None:
    holders = tmp_path / "holders"
    shutil.copytree(tiny_models["llama"], holders / "llama")
    expected = record_import(holders / "llama").digest()
    mine = tmp_path / "mine"
    shutil.copytree(holders / "llama", mine / "llama")
    entry = record_import(holders / "llama").tensors["model.layers.1.mlp.gate_proj.weight"]
    with (mine / "llama" / "model.safetensors").open("r+b") as f:  # another version, then imported as such
        f.seek(entry.offset + 5)
        f.write(b"\x00\x01\x02\x03")
    own = record_import(mine / "llama").digest()
    assert own != expected
    serve(holders, node="honest")
    notices: list[tuple[str, str]] = []
    weights_of = StageWeights(client, NS, "me", mine)
    notify = lambda node, message: notices.append((node, message))  # noqa: E731
    beat = lambda done, total, source: None  # noqa: E731
    dest = weights_of.get("llama", 0, 3, expected, ["honest"], beat, notify)
    # The master's word moved nothing: the node's copy is where it was, as it was, and still serves as itself.
    assert dest.parent.name == versions_dir(expected) and dest.name == "llama"
    assert not list(mine.glob(".llama.rejected-*")) and import_record(mine / "llama").digest() == own
    assert [n for n, _ in notices] == ["me"] and "kept as it is" in notices[0][1]
    _assert_same_outputs(dest, tiny_models["llama"], LayerRange(0, 3, 6))
    assert weights_of.get("llama", 0, 3, own, [], beat, notify) == mine / "llama"
    assert weights_of.get("llama", 0, 3, expected, [], beat, notify) == dest  # checked, not fetched again
    assert local_models(mine)["llama"].digest == own  # the stage beside is never listed, never served


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_default_model_stage_fetch(serve, client: zenoh.Session, tmp_path: Path) -> None:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(None, progress=False)
    root = tmp_path / "models"
    root.mkdir()
    (root / model_dir.name).symlink_to(model_dir)  # the manifest cache lands beside the link, in tmp_path
    serve(root)
    total = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
    layers = split_layers(total, 2)[1]  # the last stage: its layers, the norm and the tied embedding
    t0 = time.monotonic()
    source_manifest = model_manifest(root / model_dir.name)  # what the server hashes on first use
    hashing = time.monotonic() - t0
    progress, stats = Progress(), FetchStats()
    t0 = time.monotonic()
    dest = fetch_shard(
        client, NS, "src", model_dir.name, layers.start, layers.end, tmp_path / "dest", progress=progress,
        stats=stats,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    rate = stats.bytes_received / seconds / 1e6
    print(f"default model {layers}: {stats.bytes_received} B, {seconds:.2f}s ({rate:.0f} MB/s)")
    print(f"source hashing (first use only): {hashing:.2f}s")
    progress.assert_monotonic()
    manifest = read_shard_manifest(dest)
    want = tensors_for(source_manifest.tensors, layers.start, layers.end, total, True)
    assert sorted(manifest.tensors) == sorted(want)
    assert stats.bytes_received >= sum(e.bytes for e in manifest.tensors.values())
    assert (dest / "tokenizer.json").is_file() and not (dest / "shardline_import.json").exists()
    _assert_same_outputs(dest, model_dir, layers)
