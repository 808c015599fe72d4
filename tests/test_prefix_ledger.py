"""The leader's KV bookkeeping and prefix-cache decisions (runner/prefix.py), without processes."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field

import pytest
from hypothesis import example, given, settings
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


# Prompts that share their first block, or their first two, so requests attach and seal each other's.
PREFIXES = [[1] * 8, [1] * 4 + [3] * 4, [1] * 12, [2] * 8]
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"), st.sampled_from(range(len(PREFIXES))), st.integers(0, 9), st.integers(1, 8)
        ),
        st.tuples(st.just("step"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 30)),
        st.tuples(st.just("end"), st.integers(0, 30)),
    ),
    max_size=80,
)


@dataclass
class _Run:
    """A started request as the leader drives it: attached on its first step, then one chunk per step."""

    prompt: list[int]
    tokens: int
    attached: list[int] | None = None  # None: no step yet
    next_block: int = 0
    sealed: list[int] = dataclass_field(default_factory=list)


# Found by random search (about 1 run in 300 fails on the ledger that counted by key), shrunk, and kept so
# that every run tries them: a request ends after another sealed blocks past its attached ones; the block
# it computed goes with an evicted parent, is cached anew by a third request, and the first one's release
# took the third's count to 0 while it ran (then -1 at its end: never evictable again).
_COUNTED_BY_KEY = [
    ("submit", 0, 0, 1), ("submit", 2, 8, 1), ("end", 0), ("submit", 0, 0, 1), ("submit", 0, 0, 1),
    ("step", 0), ("end", 1), ("step", 1), ("end", 1), ("step", 0), ("step", 0), ("submit", 2, 6, 7),
    ("step", 1), ("step", 1),
]  # fmt: skip
# An admission that evicted a running request's own block (behind an evicted parent) counted it as freed,
# though that request's reservation still pays for it: admitted past the budget.
_FREED_TWICE = [
    ("submit", 2, 7, 2), ("step", 0), ("submit", 0, 0, 1), ("submit", 0, 0, 1), ("step", 1), ("end", 1),
    ("submit", 0, 3, 6), ("end", 1), ("step", 0), ("step", 0), ("submit", 0, 0, 1), ("submit", 0, 0, 1),
]  # fmt: skip


@pytest.mark.timeout(120)
@settings(max_examples=400, deadline=None)
@given(ops=ops, budget_blocks=st.integers(6, 24))
@example(ops=_COUNTED_BY_KEY, budget_blocks=13)
@example(ops=_FREED_TWICE, budget_blocks=16)
def test_the_kv_budget_is_never_exceeded_and_the_cache_never_refuses_what_would_fit(ops, budget_blocks):
    """Requests sharing prefixes come, start and end in any order, each computing its prompt one chunk per
    step, interleaved with the others (so one seals a block after another request already sealed its
    parent, and may end mid-prompt). Reference counts never fall below 0 and a running request's blocks
    stay counted; the bytes counted never pass the budget; the bytes really held (each block once: cached
    ones, and what running requests computed themselves) never pass what is counted; a request waits only
    when no unused cached block is left to evict; an evicted block is never attached again; and when every
    request has ended, every cached block can be evicted and the whole budget is free again."""
    budget = budget_blocks * BB
    ledger = _ledger(budget=budget)
    waiting: list[tuple[str, list[int], int]] = []
    runs: dict[str, _Run] = {}  # started: admitted, perhaps not stepped yet
    evicted: set[int] = set()
    n = 0

    def admit() -> None:
        count, gone = ledger.admit([ledger.need(len(p) + t) for _, p, t in waiting])
        evicted.update(gone)
        for _ in range(count):
            rid, prompt, tokens = waiting.pop(0)
            ledger.start(rid, ledger.need(len(prompt) + tokens), prompt)
            runs[rid] = _Run(prompt, tokens)
        if waiting:  # the head waits: only because nothing unused is left to evict
            assert ledger.evictable() == 0
            assert ledger.used() + ledger.need(len(waiting[0][1]) + waiting[0][2]) > budget

    def check() -> None:
        by_id = {b.id: b for b in ledger.blocks.values()}
        assert all(b.refs >= 0 for b in by_id.values()), "a reference count below 0"
        for rid, run in runs.items():
            for i in run.attached or []:
                # Another request's block this one started from: never evicted while it runs.
                assert i in by_id and by_id[i].refs >= 1, f"{rid} runs on block {i}, unheld"
            for i in run.sealed:  # its own may go with an evicted parent, but while cached, it is held
                assert i not in by_id or by_id[i].refs >= 1, f"{rid} runs on block {i}, count 0"
        assert ledger.used() <= budget
        owned = {b.key for b in ledger.blocks.values() if b.owner is not None}
        computed = sum(
            -(-(len(r.prompt) + r.tokens) // B) - len(r.attached)
            for r in runs.values()
            if r.attached is not None
        )
        held = (len(ledger.blocks) - len(owned)) * BB + computed * BB
        assert held <= ledger.used()

    for op in ops:
        if op[0] == "submit":
            _, which, extra, tokens = op
            prompt = PREFIXES[which] + list(range(10, 10 + extra))
            if ledger.need(len(prompt) + tokens) > budget:
                continue  # refused outright, cache or not
            waiting.append((f"r{n}", prompt, tokens))
            n += 1
            admit()
        elif op[0] == "step" and runs:
            rid = sorted(runs)[op[1] % len(runs)]
            run = runs[rid]
            if run.attached is None:  # its first step starts after the cached blocks it finds
                run.attached = ledger.attach(rid, (len(run.prompt) - 1) // B, len(run.prompt))
                assert not evicted & set(run.attached)
                run.next_block = len(run.attached)
            if run.next_block < len(run.prompt) // B:  # one whole chunk of its prompt a step, then decode
                if (sealed := ledger.seal(rid, run.next_block)) is not None:
                    run.sealed.append(sealed)
                run.next_block += 1
        elif op[0] == "end" and runs:
            rid = sorted(runs)[op[1] % len(runs)]
            del runs[rid]
            evicted.update(ledger.release(rid))
            admit()
        check()

    while runs:  # everything ends (and what waited runs, then ends): nothing may stay counted
        rid = min(runs)
        del runs[rid]
        evicted.update(ledger.release(rid))
        admit()
        check()
    assert not ledger.held and not waiting
    assert all(b.refs == 0 and b.owner is None for b in ledger.blocks.values())
    assert ledger.used() == len(ledger.blocks) * BB
    count, _ = ledger.admit([budget])  # the whole budget, by evicting every cached block
    assert count == 1


@pytest.mark.timeout(10)
def test_a_block_evicted_while_its_computer_runs_is_not_released_by_it_once_cached_again():
    """The review's case: "a" seals block 1 after "x" sealed block 0; "x" ends and block 0 is evicted with
    block 1 after it; "c" computes both anew. When "a" ends, "c"'s block keeps its count."""
    ledger = _ledger(budget=8 * BB)
    prompt = [*list(range(8)), 1]
    ledger.start("x", ledger.need(9), prompt)
    ledger.start("a", ledger.need(9), prompt)
    assert ledger.attach("x", 2) == [] and ledger.attach("a", 2) == []
    ledger.seal("x", 0)
    assert ledger.seal("a", 0) is None  # cached already
    ledger.seal("a", 1)
    ledger.release("x")
    count, evicted = ledger.admit([5 * BB])  # block 0 goes, and block 1 behind it
    assert count == 1 and len(evicted) == 2 and not ledger.blocks
    assert ledger.used() == ledger.held["a"].reserved  # "a"'s own block is still paid by "a" alone
    ledger.start("c", ledger.need(9), prompt)
    assert ledger.attach("c", 2) == []
    ledger.seal("c", 0)
    ledger.seal("c", 1)
    ledger.release("a")
    assert [b.refs for b in ledger.blocks.values()] == [1, 1]
    ledger.release("c")
    assert [b.refs for b in ledger.blocks.values()] == [0, 0]
    assert ledger.evictable() == 2
