"""KV index for hybrid models (KV cache groups): events of full-attention and sliding-window
groups, on the wire as kvserve's publisher and vLLM send them, through the real subscriber
into the index and the precise prefix scorer.

A prefix of L blocks is a hit when every full-attention group holds blocks [0, L) and every
sliding group holds the ``window_blocks(W, block_size)`` blocks before L. The engine here is
scripted: it stores each prompt's blocks in every group and frees a sliding group's blocks
once they leave the window, as a hybrid engine (kvserve's or vLLM's) publishes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvserve.cluster.config import SchedulerConfig, ScorerSpec
from kvserve.cluster.endpoints import Endpoint, EndpointSpec
from kvserve.cluster.event_subscriber import EventSubscriber
from kvserve.cluster.history import RoutingHistory, SessionTable
from kvserve.cluster.kv_groups import window_blocks
from kvserve.cluster.kv_index import DEFAULT_TIER_WEIGHTS, KVIndex
from kvserve.cluster.prompt_keys import prompt_block_keys
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scheduler import Scheduler
from kvserve.cluster.scorers import PrecisePrefixScorer
from kvserve.kv.event_publisher import ZmqEventPublisher, pack_seq
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 16
WINDOW = 32  # tokens: the position after a hit attends to 31 tokens before it = 2 blocks
NEED = window_blocks(WINDOW, BS)
TIER = "fs:/mnt/kv"
BOUND_S = 30.0  # a loaded 2-core CI box applies a batch within milliseconds; be generous

PROMPT = [(7 * i + 3) % 1000 for i in range(8 * BS)] + [5]  # 8 cacheable blocks
LONG = PROMPT[: 8 * BS] + [(11 * i) % 1000 for i in range(4 * BS)] + [5]  # 12, same first 8


def group_blocks(
    tokens: list[int],
    h: list[int],
    start: int = 0,
    end: int | None = None,
    *,
    group_idx: int = 0,
    window: int | None = None,
    medium: str = "GPU",
    **kw,
) -> BlockStored:
    """Blocks [start, end) of a prompt whose engine hashes are ``h``, stored in one group
    (sliding when ``window`` is given), chained to block ``start - 1`` as engines do."""
    end = len(h) if end is None else end
    return BlockStored(
        block_hashes=h[start:end],
        parent_block_hash=h[start - 1] if start else None,
        token_ids=tokens[start * BS : end * BS],
        block_size=BS,
        medium=medium,
        group_idx=group_idx,
        kv_cache_spec_kind="sliding_window" if window else "full_attention",
        kv_cache_spec_sliding_window=window,
        **kw,
    )


def full_group(
    tokens: list[int], h: list[int], start: int = 0, end: int | None = None, **kw
) -> BlockStored:
    return group_blocks(tokens, h, start, end, **kw)


def sliding_group(
    tokens: list[int],
    h: list[int],
    start: int = 0,
    end: int | None = None,
    group_idx: int = 1,
    window: int = WINDOW,
    **kw,
) -> BlockStored:
    return group_blocks(tokens, h, start, end, group_idx=group_idx, window=window, **kw)


def removed(hashes: list[int], group_idx: int, medium: str = "GPU", **kw) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx, **kw)


def hybrid_prefill(hashes: list[int], tokens: list[int] = PROMPT) -> list:
    """What a hybrid engine publishes after prefilling ``tokens``: every block in the full
    group, every block in the sliding group, then the sliding blocks left behind freed."""
    n = len(hashes)
    return [
        full_group(tokens, hashes),
        sliding_group(tokens, hashes),
        removed(hashes[: n - NEED], group_idx=1),
    ]


def vllm_stored(ev: BlockStored) -> dict:
    """``ev`` as vLLM encodes it: every field present, in vLLM's order (see the capture in
    tests/fixtures), the window only on sliding-window groups."""
    out = {
        "type": "BlockStored",
        "block_hashes": ev.block_hashes,
        "parent_block_hash": ev.parent_block_hash,
        "token_ids": ev.token_ids,
        "block_size": ev.block_size,
        "lora_id": None,
        "medium": ev.medium,
        "lora_name": None,
        "extra_keys": [None] * len(ev.block_hashes),
        "group_idx": ev.group_idx,
        "kv_cache_spec_kind": ev.kv_cache_spec_kind,
    }
    if ev.kv_cache_spec_sliding_window is not None:
        out["kv_cache_spec_sliding_window"] = ev.kv_cache_spec_sliding_window
    return out


def vllm_event(ev) -> dict:
    if isinstance(ev, BlockStored):
        return vllm_stored(ev)
    if isinstance(ev, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": ev.block_hashes,
            "medium": ev.medium,
            "group_idx": ev.group_idx,
        }
    return {"type": "AllBlocksCleared"}


class VllmPublisher:
    """A PUB socket sending ``[topic, seq, payload]`` with payloads msgpack-encoded as vLLM
    does (plain maps, no replay socket)."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.next_seq = 0

    def send_raw(self, events: list[dict]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events])
        self.sock.send_multipart([b"kv@vllm@m", pack_seq(self.next_seq), payload])
        self.next_seq += 1

    def close(self) -> None:
        self.sock.close()


class Cluster:
    """One real subscriber and its index; endpoints publish through real ZMQ sockets."""

    def __init__(self) -> None:
        self.index = KVIndex()
        self.sub = EventSubscriber(self.index, replay_timeout=5.0).start()
        self.kvserve: dict[str, ZmqEventPublisher] = {}
        self.vllm: dict[str, VllmPublisher] = {}

    def add_kvserve(self, name: str) -> None:
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=f"kv@{name}@m")
        self.kvserve[name] = pub
        self.sub.add_endpoint(name, pub.endpoint, pub.replay_endpoint)
        # Until the subscription reaches the PUB socket, batches are dropped there (and only
        # the next one reveals the hole): publish no-ops until one arrives live.
        deadline = time.monotonic() + BOUND_S
        while True:
            pub.publish([AllBlocksCleared()])
            assert pub.flush(BOUND_S)
            if self.sub.wait_for_seq(name, pub.next_seq - 1, timeout=0.05):
                st = self.sub.stats(name)
                if st.batches > st.replayed_batches:
                    return
            assert time.monotonic() < deadline, "the subscriber never received a live batch"

    def add_vllm(self, name: str) -> None:
        pub = self.vllm[name] = VllmPublisher()
        self.sub.add_endpoint(name, pub.endpoint, None)
        # No replay socket: send empty batches until one gets through the subscription.
        deadline = time.monotonic() + BOUND_S
        while not self.sub.wait_for_seq(name, 0, timeout=0.05):
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            pub.send_raw([])

    def publish(self, name: str, events: list) -> None:
        """Publish one batch and wait until the subscriber has applied it."""
        if name in self.kvserve:
            pub = self.kvserve[name]
            pub.publish(events)
            assert pub.flush(BOUND_S)
        else:
            pub = self.vllm[name]
            pub.send_raw([vllm_event(e) for e in events])
        assert self.sub.wait_for_seq(name, pub.next_seq - 1, timeout=BOUND_S)

    def close(self) -> None:
        self.sub.close()
        for pub in self.kvserve.values():
            pub.close()
        for pub in self.vllm.values():
            pub.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def endpoint(name: str) -> Endpoint:
    spec = EndpointSpec(url=f"http://{name}:1", name=name, model="m", kv_events="tcp://x:1")
    return Endpoint(spec, models=("m",), healthy=True)


def score(index: KVIndex, names: list[str], prompt: list[int] = PROMPT) -> dict:
    """Precise prefix scorer: name -> (score, held tokens)."""
    req = RoutingRequest(token_ids=prompt)
    scorer = PrecisePrefixScorer(index, default_block_size=BS, speculative_ttl_s=0)
    scores = scorer.score(req, [endpoint(n) for n in names])
    return {n: (s, req.held_tokens.get(n, 0)) for n, s in zip(names, scores, strict=True)}


def hashes(base: int, n: int = 8) -> list[int]:
    return list(range(base, base + n))


def test_window_blocks_follow_the_attention_span() -> None:
    # The token at position p attends to p - W + 1 .. p: W - 1 tokens before it.
    spans = {1: 0, 2: 1, 16: 1, 17: 1, 18: 2, 32: 2, 33: 2, 34: 3}
    assert {w: window_blocks(w, 16) for w in spans} == spans
    assert NEED == 2


def test_full_hit_needs_only_the_window_of_the_sliding_group(cluster: Cluster) -> None:
    cluster.add_kvserve("a")
    cluster.add_vllm("v")
    cluster.publish("a", hybrid_prefill(hashes(100)))
    cluster.publish("v", hybrid_prefill(hashes(900)))
    got = score(cluster.index, ["a", "v"])
    assert got == {"a": (1.0, 8 * BS), "v": (1.0, 8 * BS)}
    assert cluster.index.endpoint_layout("a") == {0: 0, 1: WINDOW}
    assert cluster.index.endpoint_layout("v") == {0: 0, 1: WINDOW}
    keys = prompt_block_keys(PROMPT, BS)
    assert cluster.index.media("a", keys[0], group=0) == {"GPU"}
    assert cluster.index.media("a", keys[0], group=1) == set()  # left the window: freed
    assert cluster.index.media("a", keys[7], group=1) == {"GPU"}
    # One entry per block, whatever the number of groups.
    assert cluster.index.endpoint_num_blocks("a") == 8


def test_missing_window_blocks_shorten_the_hit(cluster: Cluster) -> None:
    cluster.add_kvserve("a")
    cluster.add_vllm("v")
    # a: the sliding group lost block 6 (evicted): L=8 needs {6, 7}; L=6 needs {4, 5}.
    cluster.publish("a", [full_group(PROMPT, hashes(100)), sliding_group(PROMPT, hashes(100))])
    cluster.publish("a", [removed(hashes(100)[:4] + [106], group_idx=1)])
    # v: its sliding group stored only blocks 0-4 (L=8, 7, 6 fail; L=5 needs {3, 4}).
    cluster.publish(
        "v", [full_group(PROMPT, hashes(900)), sliding_group(PROMPT, hashes(900), 0, 5)]
    )
    got = score(cluster.index, ["a", "v"])
    assert got["a"] == (pytest.approx(6 / 8), 6 * BS)
    assert got["v"] == (pytest.approx(5 / 8), 5 * BS)
    # The full-attention groups still bound the hit: a prompt longer than them stops at 8.
    assert score(cluster.index, ["a"], LONG)["a"][1] == 6 * BS
    cluster.publish("v", [sliding_group(PROMPT, hashes(900), 5)])
    assert score(cluster.index, ["v"], LONG)["v"] == (pytest.approx(8 / 12), 8 * BS)


def test_all_sliding_model_needs_only_the_window_before_the_hit(cluster: Cluster) -> None:
    cluster.add_kvserve("m")
    cluster.add_vllm("v")
    for name, base in (("m", 100), ("v", 900)):
        # Mistral-style: one group, sliding everywhere; blocks 0-5 left the window.
        h = hashes(base)
        cluster.publish(name, [sliding_group(PROMPT, h, group_idx=0), removed(h[:6], 0)])
    got = score(cluster.index, ["m", "v"])
    assert got == {"m": (1.0, 8 * BS), "v": (1.0, 8 * BS)}
    # A longer prompt: scanned from its end down to the longest L whose window is held.
    assert score(cluster.index, ["m", "v"], LONG)["m"] == (pytest.approx(8 / 12), 8 * BS)
    # A prompt diverging at block 7 needs {5, 6} at L=7: block 5 is gone, nothing earlier has
    # a window either.
    other = PROMPT[: 7 * BS] + [999] * BS + [5]
    assert score(cluster.index, ["m", "v"], other) == {"m": (0.0, 0), "v": (0.0, 0)}
    assert cluster.index.endpoint_layout("m") == {0: WINDOW}


def test_group_removal_and_clear(cluster: Cluster) -> None:
    cluster.add_kvserve("a")
    h = hashes(100)
    cluster.publish("a", hybrid_prefill(h))
    keys = prompt_block_keys(PROMPT, BS)
    # Removing block 7 from the sliding group leaves the full group's copy: L=7 needs {5, 6},
    # 5 is gone too, so the hit falls to the last L with a window (none: 0-5 were freed).
    cluster.publish("a", [removed([h[7]], group_idx=1)])
    assert cluster.index.media("a", keys[7], group=0) == {"GPU"}
    assert cluster.index.media("a", keys[7], group=1) == set()
    assert score(cluster.index, ["a"])["a"] == (0.0, 0)
    # The sliding group stores it again (recomputed): a full hit again.
    cluster.publish("a", [sliding_group(PROMPT, h, 7)])
    assert score(cluster.index, ["a"])["a"] == (1.0, 8 * BS)
    # Removing the full group's block 3 cuts the run there, whatever the sliding group holds.
    cluster.publish("a", [removed([h[3]], group_idx=0)])
    assert cluster.index.media("a", keys[3], group=0) == set()
    assert score(cluster.index, ["a"])["a"] == (0.0, 0)  # L=3 needs {1, 2}: freed
    cluster.publish("a", [sliding_group(PROMPT, h, 0, 3)])
    assert score(cluster.index, ["a"])["a"] == (pytest.approx(3 / 8), 3 * BS)
    # AllBlocksCleared drops every group's presence.
    cluster.publish("a", [AllBlocksCleared()])
    assert cluster.index.endpoint_num_blocks("a") == 0
    assert score(cluster.index, ["a"])["a"] == (0.0, 0)


def test_mixed_legacy_and_hybrid_endpoints_share_one_scheduling_core(cluster: Cluster) -> None:
    cluster.add_kvserve("hybrid")  # holds the prefix but its sliding window lost block 7
    cluster.add_vllm("vllm")  # a non-hybrid vLLM: group 0, full attention, 6 blocks
    cluster.add_kvserve("legacy")  # an older publisher: no group fields at all, 4 blocks
    h = hashes(100)
    cluster.publish("hybrid", [*hybrid_prefill(h), removed([h[7]], group_idx=1)])
    cluster.publish("vllm", [full_group(PROMPT, hashes(900), 0, 6)])
    legacy = BlockStored(
        block_hashes=hashes(500, 4),
        parent_block_hash=None,
        token_ids=PROMPT[: 4 * BS],
        block_size=BS,
    )
    assert "group_idx" not in msgspec.msgpack.decode(msgspec.msgpack.encode(legacy))
    cluster.publish("legacy", [legacy])
    names = ["hybrid", "vllm", "legacy"]
    got = score(cluster.index, names)
    assert got == {"hybrid": (0.0, 0), "vllm": (6 / 8, 6 * BS), "legacy": (4 / 8, 4 * BS)}
    assert cluster.index.endpoint_layout("legacy") == {0: 0}
    # The sliding group recovers its window: the hybrid endpoint now holds the whole prefix.
    cluster.publish("hybrid", [sliding_group(PROMPT, h, 6)])
    # The router's and the EPP's scheduling core (Scheduler over the same index) picks it,
    # and the P/D path's single-endpoint match agrees.
    ctx = _Ctx(cluster.index)
    sched = Scheduler.from_config(SchedulerConfig(scorers=[ScorerSpec("precise_prefix", 1.0)]), ctx)
    decision = sched.schedule(
        RoutingRequest(model="m", token_ids=PROMPT), [endpoint(n) for n in names]
    )
    assert decision.ranked[0].name == "hybrid" and decision.reason == "precise_prefix"
    assert cluster.index.match("hybrid", prompt_block_keys(PROMPT, BS)) == (8, 8.0)


def test_tier_weights_apply_per_group_and_shared_tiers_count_for_members(
    cluster: Cluster,
) -> None:
    cpu_w, fs_w = DEFAULT_TIER_WEIGHTS["CPU"], DEFAULT_TIER_WEIGHTS["FS"]
    cluster.add_kvserve("a")
    cluster.add_kvserve("b")
    cluster.add_vllm("c")
    h = hashes(100)
    # a: the full group on GPU, its sliding window only in host memory (offloaded): the two
    # window blocks cost the CPU tier's load.
    cluster.publish("a", [full_group(PROMPT, h), sliding_group(PROMPT, h, 6, medium="CPU")])
    got = score(cluster.index, ["a"])["a"]
    assert got == (pytest.approx((8 - 2 * (1 - cpu_w)) / 8), 8 * BS)
    # a also writes both groups to a shared file-system tier (the sliding group: its window).
    shared = {"tier": TIER, "shared": True, "locality": "LOCAL"}
    cluster.publish(
        "a",
        [
            full_group(PROMPT, h, medium="STORAGE", **shared),
            sliding_group(PROMPT, h, 4, medium="STORAGE", **shared),
        ],
    )
    # b has used the tier too (a block of its own there): every block a wrote counts for b.
    cluster.publish(
        "b",
        [
            full_group([9] * BS, [77], medium="STORAGE", **shared),
            sliding_group([9] * BS, [77], medium="STORAGE", **shared),
        ],
    )
    got = score(cluster.index, ["a", "b", "c"])
    assert got["b"] == (pytest.approx(fs_w), 8 * BS)
    assert got["c"] == (0.0, 0)  # not a member
    # The tier loses the sliding group's block 7: L=7 needs {5, 6}, still in the tier.
    cluster.publish("b", [removed([h[7]], 1, medium="STORAGE", **shared)])
    assert score(cluster.index, ["b"])["b"] == (pytest.approx(7 * fs_w / 8), 7 * BS)
    # a still holds its own sliding window (CPU): its hit does not change.
    assert score(cluster.index, ["a"])["a"][1] == 8 * BS


class _Ctx:
    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.history = RoutingHistory(ttl_s=60)
        self.sessions = SessionTable()
        self.history_block_size = BS


def test_layout_change_clears_and_unknown_kinds_are_skipped() -> None:
    idx = KVIndex()
    h = hashes(100)
    idx.apply_events("a", hybrid_prefill(h))
    assert idx.endpoint_num_blocks("a") == 8
    # Another model behind the same address: group 1 is now full attention.
    idx.apply_events("a", [full_group(PROMPT, h, 0, 2, group_idx=1)])
    assert idx.stats.layout_changes == 1 and idx.endpoint_num_blocks("a") == 2
    skipped = idx.stats.skipped_events
    mamba = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=PROMPT[:BS],
        block_size=BS,
        group_idx=2,
        kv_cache_spec_kind="mamba",
    )
    no_window = BlockStored(
        block_hashes=[2],
        parent_block_hash=None,
        token_ids=PROMPT[:BS],
        block_size=BS,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
    )
    bad_group = full_group(PROMPT, [3], group_idx=-1)
    idx.apply_events("a", [mamba, no_window, bad_group, removed([4], group_idx=99)])
    assert idx.stats.skipped_events == skipped + 4
    assert idx.endpoint_layout("a") == {0: 0, 1: 0}


def _rule(held: dict, layout: dict[int, int], n: int, w: dict[str, float]) -> tuple[int, float]:
    """The hybrid rule, by brute force: the largest L whose full groups hold [0, L) and whose
    sliding groups hold their window before L; each block weighs its worst needed group's best
    medium. ``held[g][i]``: media on which group g holds block i."""
    for hit in range(n, 0, -1):
        need = {
            g: range(0, hit) if not win else range(max(0, hit - window_blocks(win, BS)), hit)
            for g, win in layout.items()
        }
        if all(held[g][i] for g, r in need.items() for i in r):
            weight = sum(
                # A block no group needs (before every window) is not loaded: free.
                min((max(w[m] for m in held[g][i]) for g, r in need.items() if i in r), default=1)
                for i in range(hit)
            )
            return hit, weight
    return 0, 0.0


@pytest.mark.parametrize(
    ("shared_tier", "n", "cases", "p_full", "p_sliding"),
    [(False, 8, 160, 0.75, 0.75), (True, 8, 160, 0.75, 0.75), (False, 120, 40, 0.97, 0.45),
     (True, 120, 40, 0.97, 0.45)],
)  # fmt: skip
def test_random_group_states_match_the_rule_by_brute_force(
    shared_tier: bool, n: int, cases: int, p_full: float, p_sliding: float
) -> None:
    """Groups in any order (sliding first), several full and sliding groups, blocks on GPU
    and CPU or in a shared tier: the index's hit and weight equal the rule's. Long prompts
    with sparse sliding groups make the hit walk down far (the jumps to held blocks)."""
    import random

    weights = {"GPU": 1.0, "CPU": DEFAULT_TIER_WEIGHTS["CPU"], "FS": DEFAULT_TIER_WEIGHTS["FS"]}
    layouts = [{0: WINDOW}, {0: 48, 1: 0}, {0: WINDOW, 1: 0, 2: 0, 3: 64}, {0: 0, 1: 20}]
    rng = random.Random(15 + n)
    tokens = [rng.randrange(1000) for _ in range(n * BS)] + [5]
    keys = prompt_block_keys(tokens, BS)
    h = hashes(100, n)
    tier = {"tier": TIER, "shared": True}
    for case in range(cases):
        layout = layouts[case % len(layouts)]
        idx = KVIndex()
        media = ["GPU", "CPU", "FS"] if shared_tier else ["GPU", "CPU"]
        # Each (group, block) on a random subset of media.
        held = {
            g: [{m for m in media if rng.random() < (p_sliding if win else p_full)}
                for _ in range(n)]
            for g, win in layout.items()
        }  # fmt: skip
        for g, win in layout.items():  # a sliding group that lost a long stretch (or every
            if win and n > 64 and rng.random() < 0.6:  # other block of it: no window held)
                start, every = rng.randrange(n // 2), rng.choice([1, 2])
                for i in range(start, min(n, start + rng.randrange(40, 100)), every):
                    held[g][i] = set()
        if shared_tier:  # "a" uses the tier; "b" writes the prompt's blocks there
            idx.apply_events(
                "a",
                [group_blocks([9] * BS, [77], window=layout[0] or None, medium="STORAGE", **tier)],
            )
        for g, win in layout.items():
            for m in media:
                src, kw = ("b", tier) if m == "FS" else ("a", {})
                medium = "STORAGE" if m == "FS" else m
                ev = group_blocks(tokens, h, group_idx=g, window=win or None, medium=medium, **kw)
                gone = [h[i] for i in range(n) if m not in held[g][i]]
                idx.apply_events(src, [ev, removed(gone, g, medium=medium, **kw)])
        want = _rule(held, layout, n, weights)
        got = idx.match("a", keys)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (layout, held)
        assert idx.match_endpoints(["a"], lambda bs: keys)["a"][:2] == got


def test_endpoint_picker_sees_the_hybrid_rule() -> None:
    """The EPP (ext_proc front end) asks the same scheduling core: the endpoint whose hybrid
    hit is longer gets the request, not the one whose full-attention group alone is."""
    import asyncio

    from kvserve.cluster.config import EndpointSpec as RouterEndpointSpec
    from kvserve.cluster.config import RouterConfig
    from kvserve.cluster.epp.processor import ExtProcStream
    from kvserve.cluster.epp.server import EndpointPicker
    from kvserve.cluster.gateway import Router
    from tests.cluster.test_epp_processor import _body, _destination, _handle, _headers

    addresses = {"a": "127.0.0.1:18011", "b": "127.0.0.1:18012"}
    cfg = RouterConfig(
        endpoints=[RouterEndpointSpec(url=f"http://{a}", model="m", name=n)
                   for n, a in addresses.items()]
    )  # fmt: skip
    epp = EndpointPicker(Router(cfg), port=0)
    epp.core.pool.load()
    for ep in epp.core.pool.endpoints.values():
        ep.healthy = True
    h = hashes(100)
    # a: the full group holds all 8 blocks, the sliding group only 0-4: a hit of 5.
    epp.core.index.apply_events("a", [full_group(PROMPT, h), sliding_group(PROMPT, h, 0, 5)])
    # b: a non-hybrid engine holding 6 blocks.
    epp.core.index.apply_events("b", [full_group(PROMPT, hashes(900), 0, 6)])
    body = msgspec.json.encode({"model": "m", "prompt": PROMPT, "max_tokens": 1})

    async def pick() -> str:
        s = ExtProcStream(epp)
        assert await _handle(s, _headers()) == []
        out = await _handle(s, _body(body, True))
        s.release()
        return _destination(out).split(",")[0]

    assert asyncio.run(pick()) == addresses["b"]
