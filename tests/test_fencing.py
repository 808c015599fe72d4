"""A node agent never overwrites a live runner: a repeated or older StartRunner is refused and counted."""

from __future__ import annotations

import pytest
from conftest import random_prompt, wait_for

from shardline.dataplane import messages as m
from shardline.dataplane.transport import Outbox
from shardline.instance.generation import GENERATION_BITS, generation_term, next_generation
from shardline.testing.reference import Reference


@pytest.mark.timeout(10)
def test_generation_ids_carry_their_term_and_only_grow():
    assert next_generation(-1, 0) == 0 and next_generation(4, 0) == 5  # a lone engine counts as before
    first = next_generation(5, 3)
    assert first == 3 << GENERATION_BITS and generation_term(first) == 3
    assert next_generation(first, 3) == first + 1 and generation_term(first + 1) == 3
    assert next_generation(first + 1, 2) == first + 2  # a deposed master's id never goes back
    # Two masters of two terms, starting from one generation, never pick the same id.
    assert next_generation(7, 4) != next_generation(7, 5)


@pytest.mark.timeout(180)
def test_repeated_and_older_start_runner_are_refused_and_nothing_is_orphaned(tiny_models, start_engine):
    engine = start_engine(tiny_models["llama"], 1)
    gen, pids = engine.generation, engine.agent.all_pids()
    spec, threads = engine._spec_for(gen, 0, 0, engine.layers)
    to_agent = Outbox(engine.session, engine.agent_key)
    to_agent.wait_matched(5.0)
    to_agent.send(m.StartRunner(spec=spec, threads=threads))  # the stage that runs: a resend
    older, _ = engine._spec_for(gen - 1, 0, 0, engine.layers)
    to_agent.send(m.StartRunner(spec=older, threads=threads))  # a deposed master's older generation
    wait_for(lambda: engine.agent.fenced == 2, 30, "both commands refused")
    assert engine.agent.all_pids() == pids  # no second process, the first one still owned
    to_agent.close()
    prompt = random_prompt(12, seed=4)
    ref = Reference(tiny_models["llama"])
    assert engine.submit(prompt, max_tokens=6).tokens(timeout=60) == ref.greedy(prompt, 6)[0]


@pytest.mark.timeout(30)
def test_a_full_inbox_drops_and_counts_instead_of_stalling_the_sender():
    from shardline.dataplane.transport import DeadlineExceeded, Inbox, open_session

    session = open_session(["tcp/127.0.0.1:0"], [])
    try:
        inbox = Inbox(session, name="slow reader", capacity=3)
        inbox.subscribe("test/inbox", m.AGENT, "x")
        out = Outbox(session, "test/inbox")
        out.wait_matched(5.0)
        stops = [m.StopGeneration(instance=f"i{n}", keep=-1) for n in range(10)]
        for stop in stops:
            out.send(stop)  # nobody reads: without a bound this queue grows, and a blocking one stalls here
        wait_for(lambda: inbox.dropped == 7, 10, "7 messages dropped")
        assert [inbox.get(timeout=1).message.instance for _ in range(3)] == ["i0", "i1", "i2"]
        with pytest.raises(DeadlineExceeded):
            inbox.get(timeout=0.2)
        out.close()
        inbox.close()
    finally:
        session.close()


@pytest.mark.timeout(60)
def test_only_a_stop_of_the_highest_term_shuts_a_ring_down(tmp_path):
    """A ring's Shutdown comes from its leader's agent, which obeys only the highest master term: a deposed
    master's stop reaches no runner (it used to send its own, unfenced Shutdown on the control key)."""
    import subprocess
    import sys
    import threading

    from shardline.dataplane.transport import DeadlineExceeded, Inbox, Keys, open_session
    from shardline.instance.spec import RunnerSpec
    from shardline.node import agent as agent_mod
    from shardline.node.agent import NodeAgent
    from shardline.node.logs import RotatingLog

    ns = "test-fenced-shutdown"
    spec = RunnerSpec(
        instance="inst", generation=1, slot=0, stages=1, model_dir="unused", layer_start=0, layer_end=4,
        layer_total=4, connect=[], namespace=ns, runner_id="r1",
    )  # fmt: skip
    session = open_session([], [])
    control = Inbox(session, name="control")
    control.subscribe(Keys("inst", 1, ns).control, m.CONTROL, "control")
    agent = NodeAgent(session, f"{ns}/agent/n1", tmp_path, obey=lambda term: term >= 2).start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    pump = threading.Thread(target=lambda: None)
    agent._runners[("inst", 1, 0)] = agent_mod._Runner(spec, proc, RotatingLog(tmp_path / "r.log"), pump)
    to_agent = Outbox(session, f"{ns}/agent/n1")
    try:
        to_agent.wait_matched(10)
        to_agent.send(m.StopGeneration(instance="inst", grace_s=1.0, term=1))  # a deposed master's
        with pytest.raises(DeadlineExceeded):
            control.get(timeout=2.0)
        assert proc.poll() is None
        to_agent.send(m.StopGeneration(instance="inst", grace_s=1.0, term=2))
        assert isinstance(control.get(timeout=10).message, m.Shutdown)
        wait_for(lambda: proc.poll() is not None, 15, "the runner stopped")
    finally:
        to_agent.close()
        agent.close()
        proc.kill()
        proc.wait(timeout=10)
        control.close()
        session.close()
