"""LRU and ARC eviction policies: exact victim order, skipping unevictable keys, ARC adaptation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.offload.policies import create_policy
from kvserve.kv.offload.policies.arc import ARCPolicy
from kvserve.kv.offload.policies.lru import LRUPolicy


def always(_k) -> bool:
    return True


def drain(policy, n, evictable=always) -> list:
    out = []
    for _ in range(n):
        v = policy.choose_victim(evictable)
        if v is None:
            break
        policy.evict(v)
        out.append(v)
    return out


def test_create_policy_by_name() -> None:
    assert isinstance(create_policy("lru", 4), LRUPolicy)
    assert isinstance(create_policy("arc", 4), ARCPolicy)
    with pytest.raises(ValueError, match="unknown kv_offload_policy"):
        create_policy("fifo", 4)


def test_lru_order_touch_and_skip() -> None:
    p = LRUPolicy(8)
    for k in "abcde":
        p.insert(k)
    p.touch("b")
    p.touch("a")
    p.touch("zz")  # unknown: ignored
    assert p.keys() == ["c", "d", "e", "b", "a"]
    # Unevictable keys are skipped, not reordered.
    assert p.choose_victim(lambda k: k not in {"c", "d"}) == "e"
    assert drain(p, 3, lambda k: k != "d") == ["c", "e", "b"]
    p.remove("a")
    assert p.keys() == ["d"] and len(p) == 1 and "d" in p and "a" not in p
    assert p.choose_victim(lambda k: False) is None


def test_arc_recency_vs_frequency() -> None:
    p = ARCPolicy(4)
    for k in "abcd":
        p.insert(k)
    p.touch("a")  # a moves to T2 (seen twice)
    assert list(p.t1) == ["b", "c", "d"] and list(p.t2) == ["a"]
    # target 0: T1 is over target, so its LRU goes first; a frequent key survives scans.
    assert drain(p, 3) == ["b", "c", "d"]
    assert list(p.b1) == ["b", "c", "d"]
    assert drain(p, 1) == ["a"] and list(p.b2) == ["a"]
    assert len(p) == 0


def test_arc_ghost_hits_move_the_target() -> None:
    p = ARCPolicy(4)
    for k in "abcd":
        p.insert(k)
    assert drain(p, 2) == ["a", "b"]  # -> B1
    assert p.target == 0
    p.insert("a")  # ghost hit in B1: T1 was too small
    assert p.target == 1.0 and "a" in p.t2 and "a" not in p.b1
    p.insert("b")  # again: |B2|/|B1| = 0 -> +1
    assert p.target == 2.0
    # T1 = {c, d} is not over target 2 -> evict from T2 (a, then b) into B2.
    assert drain(p, 1) == ["a"] and list(p.b2) == ["a"]
    p.insert("a")  # ghost hit in B2: frequency list was too small -> target shrinks
    assert p.target == 1.0
    # T1 (c, d) now exceeds the target of 1 -> T1's LRU is the victim.
    assert p.choose_victim(always) == "c"


def test_arc_falls_back_when_preferred_list_is_pinned() -> None:
    p = ARCPolicy(4)
    for k in "abc":
        p.insert(k)
    p.touch("c")
    # T1 = [a, b] preferred, both pinned -> fall back to T2.
    assert p.choose_victim(lambda k: k not in {"a", "b"}) == "c"
    assert p.choose_victim(lambda k: False) is None


def test_arc_ghost_lists_are_bounded() -> None:
    c = 8
    p = ARCPolicy(c)
    for i in range(200):
        if len(p) == c:
            drain(p, 1)
        p.insert(i)
        if i % 3 == 0:
            p.touch(i)
        assert len(p.t1) + len(p.b1) <= c
        assert len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 2 * c
        assert 0 <= p.target <= c


@pytest.mark.parametrize("name", ["lru", "arc"])
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("itve"), st.integers(0, 12), st.integers(0, 6))))
def test_bulk_insert_and_evict_equal_one_at_a_time(name: str, ops) -> None:
    """insert_many / evict_many (one call per step's stores and evictions) leave the same
    order and pick the same victims as insert / choose_victim + evict one key at a time."""
    bulk, single = create_policy(name, 8), create_policy(name, 8)
    held: set[int] = set()
    for op, key, n in ops:
        if op == "i":  # a run of new keys
            keys = [k for k in range(key, key + n) if k not in held]
            bulk.insert_many(keys)
            for k in keys:
                single.insert(k)
            held.update(keys)
        elif op == "t" and key in held:
            bulk.touch(key)
            single.touch(key)
        elif op in "ve":  # evict up to n, skipping odd keys for "v"
            ok = (lambda k: k % 2 == 0) if op == "v" else always
            got = bulk.evict_many(n, ok)
            assert got == drain(single, n, ok)
            held.difference_update(got)
        assert len(bulk) == len(single) == len(held)
    assert bulk.evict_many(100, always) == drain(single, 100)
