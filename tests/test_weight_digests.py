"""Weights checked against a source of truth: the digests recorded at import, the model digest nodes report,
which one the master expects, which holders a node tries, and the checks of local copies. Pure parts and
files on disk only (no network); fetches and real nodes are in test_weights.py and test_cluster.py."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from shardline.cluster import facts, layouts
from shardline.cluster import master_state as ms
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.placement import PlacementRequest
from shardline.cluster.weights.peer import check_manifest
from shardline.cluster.weights.sources import fetch_order
from shardline.models.footprint import ModelFootprint
from shardline.models.store.errors import WeightsError
from shardline.models.store.manifest import (
    FileEntry,
    Manifest,
    SourceInfo,
    StageSpan,
    TensorEntry,
    derive_layout,
    digest_of,
    import_record,
    local_models,
    model_manifest,
    record_import,
    record_imports,
    record_path,
    set_aside,
)
from shardline.models.store.verify import check_full_copy, check_stage_copy
from shardline.testing.tiny import make_tiny_model

D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64


def _flip(path: Path, offset: int) -> None:
    """Bit rot: one byte changed, size and mtime as they were (no stamp can tell)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _manifest(tensors: dict[str, TensorEntry], **kw: object) -> Manifest:
    files = {"config.json": FileEntry(size=2, sha256="c" * 64)}
    return Manifest(model="m", num_layers=1, tied=False, files=files, tensors=tensors, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ digests


@pytest.mark.timeout(10)
def test_the_model_digest_is_over_sorted_per_file_digests_and_ignores_where_bytes_lie() -> None:
    a = TensorEntry(dtype="F32", shape=[2], file="model.safetensors", offset=100, bytes=8, sha256="a" * 64)
    b = TensorEntry(dtype="F32", shape=[2], file="model.safetensors", offset=108, bytes=8, sha256="b" * 64)
    m = _manifest({"model.layers.0.a": a, "model.layers.0.b": b})
    files = m.file_digests()
    assert sorted(files) == ["config.json", "model.safetensors"] and files["config.json"] == "c" * 64
    assert m.digest() == digest_of(files) == digest_of(dict(reversed(files.items())))
    # Another layout of the same tensors (a fetched stage's file, a re-save) is the same content ...
    moved = _manifest({"model.layers.0.a": a.model_copy(update={"offset": 900}), "model.layers.0.b": b})
    assert moved.digest() == m.digest()
    # ... other bytes, another shape or a tensor moved to another file are not.
    for changed in (
        a.model_copy(update={"sha256": "f" * 64}),
        a.model_copy(update={"shape": [1, 2]}),
        a.model_copy(update={"file": "model-2.safetensors"}),
    ):
        assert _manifest({"model.layers.0.a": changed, "model.layers.0.b": b}).digest() != m.digest()
    # A stage's manifest stands for the whole model it was checked against, not for its own file.
    stage = m.model_copy(
        update={"layers": StageSpan(start=0, end=1, total=2), "source": SourceInfo(node="n", digest=D1)}
    )
    assert stage.model_digest() == D1 and m.model_digest() == m.digest()


@pytest.mark.timeout(30)
def test_digests_are_recorded_once_at_import_and_never_rebuilt_from_changed_files(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "root" / "tiny", "llama")
    assert import_record(model) is None and local_models(model.parent)["tiny"].digest == ""
    assert record_imports(model.parent) == ["tiny"] and record_imports(model.parent) == []
    record = import_record(model)
    assert record is not None and record.recorded_at > 0
    assert (
        record_path(model) == model.parent / ".tiny.digests.json"
    )  # beside it: the directory stays as imported
    presence = local_models(model.parent)["tiny"]
    assert presence.digest == record.digest() and presence.imported_at == record.recorded_at
    # A changed file (even with a fresh mtime) is a mismatch against the record, never its new truth.
    entry = record.tensors["model.layers.2.mlp.up_proj.weight"]
    _flip(model / "model.safetensors", entry.offset)
    os.utime(model / "model.safetensors")
    assert model_manifest(model) == record and record_import(model) == record
    assert local_models(model.parent)["tiny"].digest == record.digest()
    # Only a new import replaces it.
    again = record_import(model, replace=True)
    assert again.digest() != record.digest() and again.recorded_at >= record.recorded_at


@pytest.mark.timeout(30)
def test_a_file_still_being_copied_is_not_recorded(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", "llama")
    weights = model / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    with pytest.raises(WeightsError, match="shorter than its header says"):
        record_import(model)
    assert record_imports(tmp_path) == [] and import_record(model) is None


@pytest.mark.timeout(10)
def test_layout_claims_come_from_config_and_tensor_names() -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.w", "model.layers.3.w"]
    assert derive_layout({"num_hidden_layers": 6, "tie_word_embeddings": False}, names) == (6, False)
    assert derive_layout({}, names) == (4, True)  # no lm_head: the head is the embedding
    assert derive_layout({}, [*names, "lm_head.weight"]) == (4, False)


@pytest.mark.timeout(10)
def test_unknown_dtypes_fail_closed() -> None:
    ok = TensorEntry(dtype="BF16", shape=[2, 3], file="model.safetensors", offset=0, bytes=12, sha256="a")
    check_manifest(_manifest({"model.layers.0.w": ok}), "src")
    odd = ok.model_copy(update={"dtype": "F4"})
    with pytest.raises(WeightsError, match=r"dtype 'F4', which this node does not know.*cannot be checked"):
        check_manifest(_manifest({"model.layers.0.w": odd}), "src")
    with pytest.raises(WeightsError, match="cannot be 13 bytes"):
        check_manifest(_manifest({"model.layers.0.w": ok.model_copy(update={"bytes": 13})}), "src")


# ---------------------------------------------------------------------------------------------- local copies


@pytest.mark.timeout(30)
def test_a_whole_local_copy_is_checked_against_its_record_and_the_expected_digest(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", "llama")
    digest = record_import(model).digest()
    assert check_full_copy(model, digest, 0, 6) == []
    assert "another version" in check_full_copy(model, D1, 0, 6)[0]
    record = import_record(model)
    assert record is not None
    _flip(model / "model.safetensors", record.tensors["model.layers.4.self_attn.k_proj.weight"].offset + 3)
    assert check_full_copy(model, digest, 0, 3) == []  # only the stage's own tensors are hashed ...
    assert check_full_copy(model, digest, 3, 6) == [
        "model.layers.4.self_attn.k_proj.weight changed since its import"
    ]
    # ... but every header and every weights file counts: the loader reads them all.
    shutil.copyfile(model / "model.safetensors", model / "model-extra.safetensors")
    assert check_full_copy(model, digest, 0, 3) == ["model-extra.safetensors changed since its import"]
    (model / "model-extra.safetensors").unlink()
    (model / "config.json").write_text(
        json.dumps({**json.loads((model / "config.json").read_text()), "x": 1})
    )
    assert check_full_copy(model, digest, 0, 3) == ["config.json changed since its import"]
    record_path(model).unlink()
    assert "no digests were recorded" in check_full_copy(model, digest, 0, 3)[0]


@pytest.mark.timeout(30)
def test_a_rejected_copy_is_moved_aside_with_its_record_never_deleted(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", "llama")
    record_import(model)
    aside = set_aside(model)
    assert (
        not model.exists()
        and (aside / "model.safetensors").is_file()
        and aside.name.startswith(".tiny.rejected-")
    )
    assert not record_path(model).exists() and import_record(aside) is not None
    assert local_models(tmp_path) == {}  # hidden: never listed, served or loaded


@pytest.mark.timeout(10)
def test_a_stage_copy_is_checked_against_the_digest_it_was_fetched_as(tmp_path: Path) -> None:
    assert "unreadable shard manifest" in check_stage_copy(tmp_path, D1)[0]
    stage = tmp_path / "stage"
    stage.mkdir()
    m = _manifest({}, layers=StageSpan(start=0, end=1, total=2), source=SourceInfo(node="n", digest=D1))
    (stage / "shardline_shard.json").write_text(m.model_dump_json())
    assert "copied from another version" in check_stage_copy(stage, D2)[0]
    assert check_stage_copy(stage, D1) == ["config.json"]  # the right version, but a file is missing


# ------------------------------------------------------------------------------------------------ cluster


FP = ModelFootprint(
    name="m",
    layers=4,
    layer_bytes=[10**6] * 4,
    embed_bytes=10**6,
    head_bytes=10**5,
    tied=False,
    kv_bytes_per_token_per_layer=256,
    context_length=1024,
    hidden_size=64,
    vocab_size=512,
)
RES = cm.Resources(memory_total=8 << 30, memory_available=1 << 30, compute_score=50.0, device="cpu", cpus=2)


def _report(
    node: str, model: cm.LocalModel | None, notices: list[cm.ClusterEvent] | None = None
) -> cm.NodeReport:
    return cm.NodeReport(
        node_id=node,
        name=node,
        endpoint="tcp/127.0.0.1:7447",
        started_at=0.0,
        resources=RES,
        models={"m": model} if model else {},
        notices=notices or [],
    )


def _holder(digest: str, at: float, full: bool = True) -> cm.LocalModel:
    return cm.LocalModel(full=full, end=4, footprint=FP if full else None, digest=digest, imported_at=at)


def _cluster(reports: dict[str, cm.NodeReport], alive: set[str] | None = None) -> cs.ClusterState:
    s = cs.ClusterState(me="a")
    for n, r in reports.items():
        s, _ = cs.apply(s, cs.Alive(n))
        s, _ = cs.apply(s, cs.ReportIn(r, at=0.0))
    for n in set(reports) - (alive if alive is not None else set(reports)) - {"a"}:
        s, _ = cs.apply(s, cs.Gone(n))
        s, _ = cs.apply(s, cs.Tick(100.0))
    return s


@pytest.mark.timeout(10)
def test_the_expected_digest_is_the_masters_own_or_the_one_holders_agree_on() -> None:
    s = _cluster(
        {
            "a": _report("a", _holder(D2, 30.0)),  # this node (the master) holds a whole copy: its digest
            "b": _report("b", _holder(D1, 20.0)),
            "c": _report("c", _holder(D1, 25.0)),
            "d": _report("d", _holder(D2, 40.0, full=False)),  # a stage copy: never a source, never the truth
            "e": _report("e", _holder("", 1.0)),  # still being hashed
            "f": _report("f", _holder(D3, 5.0)),  # gone
        },
        alive={"a", "b", "c", "d", "e"},
    )
    assert facts.expected_digest(s, "m") == D2 and facts.expected_digest(s, "other") is None
    assert facts.sources(s, "m", D1) == ["b", "c"] and facts.sources(s, "m", D2) == ["a"]
    assert facts.sources(s, "m") == ["a", "b", "c", "e"]
    # Without a copy of its own, the master takes the version every holder agrees on, and none otherwise.
    agree = _cluster(
        {"a": _report("a", None), "b": _report("b", _holder(D1, 7.0)), "c": _report("c", _holder(D1, 9.0))}
    )
    assert facts.expected_digest(agree, "m") == D1
    split = _cluster(
        {"a": _report("a", None), "b": _report("b", _holder(D2, 7.0)), "c": _report("c", _holder(D1, 9.0))}
    )
    assert facts.expected_digest(split, "m") is None
    refusal = facts.digest_refusal(split, "m")
    assert "different versions" in refusal and "b: 222222222222" in refusal
    assert facts.expected_digest(_cluster({"a": _report("a", _holder("", 1.0))}), "m") is None
    assert "being hashed" in facts.digest_refusal(_cluster({"a": _report("a", _holder("", 1.0))}), "m")


@pytest.mark.timeout(10)
def test_a_peer_claiming_the_earliest_import_of_another_version_changes_no_pin() -> None:
    # A key holder reports imported_at=0 for another version: the master's own copy stays the truth ...
    honest = {
        "a": _report("a", _holder(D1, 1_700_000_000.0)),
        "b": _report("b", _holder(D1, 1_700_000_100.0)),
    }
    liar = _report("z", _holder(D2, 0.0))
    assert facts.expected_digest(_cluster({**honest, "z": liar}), "m") == D1
    # ... and a master without a copy places nothing on the liar's word (the old rule took D2).
    s = _cluster({"a": _report("a", None), "b": honest["b"], "z": liar})
    assert facts.expected_digest(s, "m") is None and facts.sources(s, "m", D1) == ["b"]


@pytest.mark.timeout(10)
def test_placing_needs_a_recorded_digest_and_every_launch_names_it() -> None:
    config = ms.MasterConfig(me="a", report_s=0.5, threads=1)
    req = PlacementRequest(sequences=1, reserve_tokens=64, hop_cost_fraction=0.0, max_stages=2)
    place = ms.QueryIn(1, cm.Place(model="m", request=req), salt="s", at=1.0)

    hashing = _cluster({"a": _report("a", _holder("", 0.0)), "b": _report("b", _holder("", 0.0))})
    s = ms.initial(config, 1, ms.snapshot(hashing, 0.0, 1000.0))
    s, out = ms.apply(s, place)
    [reply] = [c.reply for c in out if isinstance(c, ms.Reply)]
    assert not reply.ok and "no recorded digests" in reply.error and s.records == {}

    # b holds another version: it is no source, even for the stage placed on it.
    versions = _cluster({"a": _report("a", _holder(D1, 1.0)), "b": _report("b", _holder(D2, 2.0))})
    s = ms.initial(config, 1, ms.snapshot(versions, 0.0, 1000.0))
    s, out = ms.apply(s, place)
    [reply] = [c.reply for c in out if isinstance(c, ms.Reply)]
    assert reply.ok and reply.instance is not None and reply.instance.digest == D1
    stages, launches, _ = layouts.layout(s, reply.instance.instance, 0, keep={}, avoid=set())
    assert launches and all(x.digest == D1 and x.sources == ["a"] for _, x in launches)
    # The record keeps its digest through the layout (views carry it to the next master) ...
    s, _ = ms.apply(s, ms.Laid(reply.instance.instance, 0, stages, D1))
    assert s.records[reply.instance.instance].digest == D1
    # ... and a record from before digests gets the expected one at its next layout.
    old = s.records[reply.instance.instance].model_copy(update={"digest": ""})
    s2 = ms.initial(config, 1, ms.snapshot(versions, 0.0, 1000.0))
    s2 = replace(s2, records={old.instance: old})
    _, launches, _ = layouts.layout(s2, old.instance, 1, keep={}, avoid=set())
    assert all(x.digest == D1 for _, x in launches)
    # A new master rebuilds it from the view (every node keeps one and reports its records), and keeps it
    # though a holder of another version with an earlier record has joined since.
    view = ms.view(replace(s, seq=1))
    later = _cluster({"a": _report("a", _holder(D1, 1.0)), "b": _report("b", _holder(D2, 0.5))})
    later, _ = cs.apply(later, cs.ViewIn(view))
    assert facts.expected_digest(later, "m") == D1  # an earlier claim moves nothing
    new = ms.initial(config, 2, ms.snapshot(later, 0.0, 1000.0))
    assert new.records[old.instance].digest == D1
    _, launches, _ = layouts.layout(new, old.instance, 1, keep={}, avoid=set())
    assert all(x.digest == D1 and x.sources == ["a"] for _, x in launches)
    # The only holder of the expected version gone: no layout (never a copy of another version).
    gone = _cluster({"a": _report("a", None), "b": _report("b", _holder(D2, 2.0))})
    s3 = ms.initial(config, 1, ms.snapshot(gone, 0.0, 1000.0))
    s3 = replace(s3, records=s.records)
    with pytest.raises(layouts.LayoutError, match="with the expected digest"):
        layouts.layout(s3, old.instance, 1, keep={}, avoid=set())


@pytest.mark.timeout(10)
def test_which_sources_a_node_tries_and_in_which_order() -> None:
    assert fetch_order(["a", "b", "c"], "b", {}, now=100.0) == ["a", "c"]
    assert fetch_order(["a", "a", "c"], "x", {}, now=100.0) == ["a", "c"]  # each once
    assert fetch_order([], "x", {}, now=100.0) == [] and fetch_order(["x"], "x", {}, now=100.0) == []
    # Refused lately: last, the longest ago first; never dropped (every byte is checked anyway).
    refused = {"a": 90.0, "b": 80.0, "z": 95.0}
    assert fetch_order(["a", "b", "c", "d"], "x", refused, now=100.0) == ["c", "d", "b", "a"]
    # A refusal long ago no longer counts.
    assert fetch_order(["a", "b", "c"], "x", refused, now=100.0 + 600.0) == ["a", "b", "c"]
    assert fetch_order(["a", "b"], "x", {"a": 0.0}, now=10.0, hold_s=5.0) == ["a", "b"]


@pytest.mark.timeout(10)
def test_a_nodes_notices_become_events_once_however_often_it_reports_them() -> None:
    n1 = cm.ClusterEvent(at=10.0, kind="weights", node="b", instance="i", message="node b refused")
    n2 = cm.ClusterEvent(at=11.0, kind="weights", node="c", instance="i", message="node c refused")
    s = _cluster({"a": _report("a", None)})
    s, _ = cs.apply(s, cs.Alive("b"))

    def fold(report: cm.NodeReport, at: float) -> list[cm.ClusterEvent]:
        nonlocal s
        s, effects = cs.apply(s, cs.ReportIn(report, at=at))
        return cs.happened(effects)

    assert fold(_report("b", None, [n1]), 1.0) == [n1]
    assert fold(_report("b", None, [n1]), 2.0) == []
    assert fold(_report("b", None, [n2, n1]), 3.0) == [n2]
    assert [e for e in s.events if e.kind == "weights"] == [n1, n2]
    # A node heard of by its report alone joins (its token's event may have been lost) and its notices count
    # once; the last report of a node that is leaving is not folded at all.
    joined = fold(_report("d", None, [n1]), 3.0)
    assert [e.kind for e in joined] == ["join", "weights"]
    leaving = _report("ghost", None, [n1]).model_copy(update={"leaving": True})
    assert fold(leaving, 3.0) == []
