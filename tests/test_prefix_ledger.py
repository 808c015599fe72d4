"""The leader's KV bookkeeping and prefix-cache decisions (runner/prefix.py), without processes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.runner.prefix import UNBUDGETED_BLOCKS, PrefixLedger, chain_keys

B = 4  # positions per block
BB = 10  # bytes per block


def _ledger(budget: int = 0, enabled: bool = True) -> PrefixLedger:
    return PrefixLedger(B, BB, budget, enabled)


def _run_prompt(ledger: PrefixLedger, rid: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    """Admit (the caller checked it fits), attach, then seal each whole block computed: the leader's order."""
    ledger.start(rid, ledger.need(len(prompt) + max_tokens), prompt)
    attached = ledger.attach(rid, (len(prompt) - 1) // B, len(prompt))
    for index in range(len(attached), len(prompt) // B):
        ledger.seal(rid, index)
    return attached


@pytest.mark.timeout(10)
def test_chain_keys_name_a_block_by_everything_before_it():
    a = chain_keys(list(range(12)), B)
    assert len(a) == 3
    assert chain_keys([*list(range(8)), 99, 98], B) == a[:2]  # a partial block has no key
    changed = chain_keys([7, *list(range(1, 12))], B)
    assert all(x != y for x, y in zip(a, changed, strict=True))  # one token early changes every later key


@pytest.mark.timeout(10)
def test_a_later_request_starts_after_the_blocks_an_earlier_one_computed():
    ledger = _ledger()
    system = list(range(100, 112))  # three whole blocks
    assert _run_prompt(ledger, "a", [*system, 1, 2]) == []
    ids = _run_prompt(ledger, "b", [*system, 3, 4, 5])
    assert len(ids) == 3 and ledger.cached_tokens("b") == 12
    assert ledger.queries == 14 + 15 and ledger.hits == 12  # prompt tokens looked up, and found
    # Its own prompt is whole blocks only: the last block stays to be computed, since its step samples.
    assert len(_run_prompt(ledger, "c", system)) == 2


@pytest.mark.timeout(10)
def test_nothing_is_cached_when_the_cache_is_off():
    ledger = _ledger(enabled=False)
    _run_prompt(ledger, "a", list(range(12)))
    assert _run_prompt(ledger, "b", [*list(range(12)), 1]) == []
    assert not ledger.blocks and ledger.queries == 0


@pytest.mark.timeout(10)
def test_eviction_takes_the_least_recently_used_unheld_blocks_and_they_are_never_attached_again():
    ledger = _ledger(budget=10 * BB)
    old, new = list(range(8)), list(range(50, 58))
    _run_prompt(ledger, "old", [*old, 1])
    ledger.release("old")
    _run_prompt(ledger, "new", [*new, 1])
    ledger.release("new")
    assert len(ledger.blocks) == 4
    # A request of 8 blocks needs the room of 2 cached ones: the older prompt's go, deepest first.
    count, evicted = ledger.admit([8 * BB])
    assert count == 1 and len(evicted) == 2
    assert _run_prompt(ledger, "again", [*old, 2]) == []  # evicted: computed anew
    assert len(_run_prompt(ledger, "new2", [*new, 2])) == 2  # kept


@pytest.mark.timeout(10)
def test_a_held_block_is_never_evicted():
    ledger = _ledger(budget=6 * BB)
    _run_prompt(ledger, "a", [*list(range(8)), 1], max_tokens=3)  # 3 blocks reserved, 2 sealed and held
    count, evicted = ledger.admit([4 * BB])
    assert count == 0 and evicted == []


@pytest.mark.timeout(10)
def test_without_a_budget_the_unused_blocks_are_capped():
    ledger = _ledger()
    for i in range(UNBUDGETED_BLOCKS // 2 + 5):
        _run_prompt(ledger, f"r{i}", [i] * 8 + [1])
        ledger.release(f"r{i}")
    assert len(ledger.blocks) <= UNBUDGETED_BLOCKS


@pytest.mark.timeout(30)
@given(
    waiting=st.lists(st.integers(1, 100), max_size=12),
    reserved=st.integers(0, 200),
    budget=st.integers(0, 300),
)
def test_admission_is_strict_fifo_within_budget(waiting: list[int], reserved: int, budget: int) -> None:
    ledger = _ledger(budget=budget, enabled=False)
    ledger.start("running", reserved, [])
    n, _ = ledger.admit(waiting)
    if budget == 0:
        assert n == len(waiting)  # no budget, no limit
        return
    assert reserved + sum(waiting[:n]) <= budget or n == 0
    if n < len(waiting):  # the head that stays does not fit: nothing behind it overtakes
        assert reserved + sum(waiting[: n + 1]) > budget


PREFIXES = [[1] * 8, [2] * 8, [1] * 4 + [3] * 4]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(range(3)), st.integers(0, 9), st.integers(1, 8)),
        st.tuples(st.just("step"), st.integers(0, 30)),
        st.tuples(st.just("end"), st.integers(0, 30)),
    ),
    max_size=60,
)


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(ops=ops, budget_blocks=st.integers(6, 24))
def test_the_kv_budget_is_never_exceeded_and_the_cache_never_refuses_what_would_fit(ops, budget_blocks):
    """Requests sharing prefixes come, start (attach, then seal their blocks) and end in any order. The
    bytes counted never pass the budget; the bytes really held (each block once: cached ones, and what
    running requests computed themselves) never pass what is counted; a request waits only when no unused
    cached block is left to evict; and an evicted block is never attached again."""
    budget = budget_blocks * BB
    ledger = _ledger(budget=budget)
    waiting: list[tuple[str, list[int], int]] = []
    admitted: dict[str, tuple[list[int], int]] = {}  # not yet started
    running: dict[str, int] = {}  # request -> blocks it computed itself, beyond what it attached
    evicted: set[int] = set()
    n = 0

    def admit() -> None:
        count, gone = ledger.admit([ledger.need(len(p) + t) for _, p, t in waiting])
        evicted.update(gone)
        for _ in range(count):
            rid, prompt, tokens = waiting.pop(0)
            ledger.start(rid, ledger.need(len(prompt) + tokens), prompt)
            admitted[rid] = (prompt, tokens)
        if waiting:  # the head waits: only because nothing unused is left to evict
            assert ledger.evictable() == 0
            assert ledger.used() + ledger.need(len(waiting[0][1]) + waiting[0][2]) > budget

    for op in ops:
        if op[0] == "submit":
            _, which, extra, tokens = op
            prompt = PREFIXES[which] + list(range(10, 10 + extra))
            if ledger.need(len(prompt) + tokens) > budget:
                continue  # refused outright, cache or not
            waiting.append((f"r{n}", prompt, tokens))
            n += 1
            admit()
        elif op[0] == "step" and admitted:
            rid = sorted(admitted)[op[1] % len(admitted)]
            prompt, tokens = admitted.pop(rid)
            ids = ledger.attach(rid, (len(prompt) - 1) // B)
            assert not evicted & set(ids)
            for index in range(len(ids), len(prompt) // B):
                ledger.seal(rid, index)
            running[rid] = -(-(len(prompt) + tokens) // B) - len(ids)
        elif op[0] == "end" and running:
            rid = sorted(running)[op[1] % len(running)]
            del running[rid]
            evicted.update(ledger.release(rid))
            admit()
        assert ledger.used() <= budget
        owned = {b.key for b in ledger.blocks.values() if b.owner is not None}
        held = (len(ledger.blocks) - len(owned)) * BB + sum(running.values()) * BB
        assert held <= ledger.used()
