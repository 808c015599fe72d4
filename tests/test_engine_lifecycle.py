"""Cancel, bad input and failed starts: clear errors, a usable instance, no processes left behind."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
from conftest import FAST, assert_no_runner_left, random_prompt

from shardline.engine.engine import (
    LOGS_KEPT,
    ContextLengthError,
    Engine,
    EngineConfig,
    EngineError,
    logs_to_drop,
)
from shardline.instance.spec import Fault
from shardline.testing.reference import Reference


def _next_request_is_correct(engine, ref) -> None:
    prompt = random_prompt(21, seed=5)
    assert engine.submit(prompt, max_tokens=8).tokens(timeout=60) == ref.greedy(prompt, 8)[0]


@pytest.mark.timeout(180)
def test_cancel_during_prefill_keeps_instance_usable(tiny_models, start_engine):
    ref = Reference(tiny_models["llama"])
    engine = start_engine(tiny_models["llama"], 2)
    handle = engine.submit(random_prompt(4000, seed=1), max_tokens=5)  # 500 chunks of 8
    handle.cancel()
    assert list(handle) == []
    assert handle.finish_reason == "cancelled"
    _next_request_is_correct(engine, ref)


@pytest.mark.timeout(180)
def test_cancel_during_decode_keeps_instance_usable(tiny_models, start_engine):
    ref = Reference(tiny_models["llama"])
    engine = start_engine(tiny_models["llama"], 3)
    handle = engine.submit(random_prompt(30, seed=2), max_tokens=3000)
    seen = 0
    for _ in handle:
        seen += 1
        if seen == 3:
            handle.cancel()
    assert handle.finish_reason == "cancelled"
    assert 3 <= seen < 3000
    _next_request_is_correct(engine, ref)


@pytest.mark.timeout(120)
def test_prompt_longer_than_context_is_refused(tiny_models, start_engine):
    ref = Reference(tiny_models["qwen2"])
    engine = start_engine(tiny_models["qwen2"], 2)
    with pytest.raises(ContextLengthError, match="context is 4096"):
        engine.submit(random_prompt(5000, seed=3), max_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 2, 10**6], max_tokens=4)
    _next_request_is_correct(engine, ref)


@pytest.mark.timeout(120)
def test_corrupt_model_dir_fails_start_cleanly(tiny_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    # The engine reads the weight files' headers to split the layers: an unreadable one fails at once,
    # before a session or a runner exists.
    with pytest.raises(EngineError, match="unreadable safetensors header"):
        Engine(EngineConfig(model_dir=bad, stages=2, load_timeout=60, log_dir=tmp_path / "logs"))
    # A header that reads but tensors that do not: the stages fail to load, and start says so cleanly.
    header = (tiny_models["llama"] / "model.safetensors").read_bytes()
    length = int.from_bytes(header[:8], "little")
    (bad / "model.safetensors").write_bytes(header[: 8 + length] + b"\x00" * 16)
    engine = Engine(EngineConfig(model_dir=bad, stages=2, load_timeout=60, log_dir=tmp_path / "logs"))
    with pytest.raises(EngineError, match="stage"):
        engine.start()
    assert_no_runner_left(engine.runner_pids())


@pytest.mark.timeout(60)
def test_unsupported_architecture_is_refused(tiny_models, tmp_path):
    bad = tmp_path / "not-an-arch"
    shutil.copytree(tiny_models["llama"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "not_an_arch"}))
    with pytest.raises(EngineError, match="'not_an_arch' is not an architecture of mlx-lm"):
        Engine(EngineConfig(model_dir=bad, stages=2))


@pytest.mark.timeout(120)
def test_bad_messages_from_peers_change_nothing(tiny_models, start_engine):
    """Garbage frames and a well-formed message naming a stage that does not exist are dropped."""
    from shardline.dataplane import messages as m
    from shardline.dataplane.transport import Outbox, open_session

    ref = Reference(tiny_models["qwen3"])
    engine = start_engine(tiny_models["qwen3"], 2)
    peer = open_session([], [engine.endpoint])
    try:
        for key in (engine.keys.status(0), engine.keys.events):
            out = Outbox(peer, key, engine.generation)
            out.wait_matched(10)  # the engine is subscribed: these frames reach it
            out.send_raw(b"\x00\x01garbage")
            out.send(m.Heartbeat(slot=99, steps=1, busy=False))
            out.send(m.TokenEvent(request_id="nobody", index=0, token=1, logprob=0.0))
        _next_request_is_correct(engine, ref)
        assert engine.failure is None and not engine.recoveries
    finally:
        peer.close()


@pytest.mark.timeout(180)
def test_only_a_failed_run_keeps_its_stage_logs_in_the_state_dir(tiny_models, tmp_path, monkeypatch) -> None:
    """Every Engine (each `shardline generate`) used to leave a shardline-* folder in the temp dir."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.delenv("SHARDLINE_LOG_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = tmp_path / "state" / "shardline" / "logs"

    def run(**kw: object) -> Engine:
        engine = Engine(EngineConfig(model_dir=tiny_models["llama"], stages=2, prefill_step=8, **FAST, **kw))
        try:
            engine.start()
            assert engine.log_dir.parent == root and engine.stage_log(0).exists()
            assert engine.submit(random_prompt(12, seed=7), max_tokens=3).tokens(timeout=60)
        finally:
            engine.shutdown()
        return engine

    clean = run()
    assert not clean.log_dir.exists()  # nothing failed: nothing to look into
    failed = run(faults={1: Fault(phase="load", action="raise")})  # recovered: its logs say what happened
    assert failed.recoveries and failed.stage_log(1).exists()
    assert [p for p in temp.iterdir() if p.name.startswith("shardline-")] == []


@pytest.mark.timeout(10)
def test_the_oldest_log_folders_go_beyond_the_bound() -> None:
    folders = [("engine-c", 3.0), ("engine-a", 1.0), ("engine-b", 2.0), ("engine-d", 4.0)]
    assert logs_to_drop(folders, 2) == ["engine-b", "engine-a"]
    assert logs_to_drop(folders, 9) == [] and len(logs_to_drop(folders, 0)) == 4
    assert LOGS_KEPT >= 1
