"""P/D disaggregation between real engines in one process, over real loopback sockets.

A producer engine (``kv_role=producer``) runs the prefill leg; a consumer engine pulls the
blocks through the producer's block server and decodes. Oracle: greedy outputs equal an engine
that recomputes everything (no prefix caching). Failure paths (nothing listening, a server that
never answers, a corrupted block, another prompt or model, an expired lease, an abort) must
recompute to the same output in bounded time. After every test both pools are back to baseline
(``check_integrity``: every block free once no request is alive) and no lease is left.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.multi_connector import MultiConnector
from kvserve.kv.pd.connector import PDConnector

BS = 16
DEADLINE_S = 120.0  # generous: a loaded 2-core box


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 160)
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(model=str(model_dir), debug=True, **kw))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    """Everything recomputed: no prefix caching."""
    eng = make_engine(tiny_model_dir, num_kv_blocks=400, enable_prefix_caching=False)
    yield eng
    eng.shutdown()


@pytest.fixture
def engines(tiny_model_dir: Path):
    """``engines(**config)`` -> an engine, shut down (after a baseline check) at the end."""
    made: list[LLMEngine] = []

    def make(**kw) -> LLMEngine:
        eng = make_engine(tiny_model_dir, **kw)
        made.append(eng)
        return eng

    yield make
    try:
        for eng in made:
            drain(eng)
            assert_baseline(eng)
    finally:
        for eng in made:
            eng.shutdown()


def drain(eng: LLMEngine, timeout: float = DEADLINE_S) -> None:
    """Step until nothing is alive (held blocks included)."""
    deadline = time.monotonic() + timeout
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, f"engine not idle: {eng.get_stats()}"
        eng.step()


def pd_of(eng: LLMEngine) -> PDConnector:
    conn = eng.connector
    if isinstance(conn, MultiConnector):
        conn = conn.connectors[0]
    assert isinstance(conn, PDConnector)
    return conn


def assert_baseline(eng: LLMEngine) -> None:
    eng.check_integrity()  # no request alive -> every block free
    assert not eng.scheduler.held
    conn = pd_of(eng)
    if conn.leases is not None:
        assert conn.leases.num_active == 0
    assert not conn._pulls and not conn._lookups and not conn._to_start and not conn._tried
    assert not conn._params_out


def run(
    eng: LLMEngine, prompts: list[list[int]], max_tokens: int, params: list[dict | None]
) -> list[RequestOutput]:
    """Run ``prompts`` together to the end (bounded in time)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [
        eng.add_request(None, p, sp, kv_transfer_params=k)
        for p, k in zip(prompts, params, strict=True)
    ]
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"requests did not finish: {eng.get_stats()}"
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def prefill(producer: LLMEngine, prompts: list[list[int]]) -> list[dict]:
    outs = run(producer, prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o.kv_transfer_params for o in outs]
    assert all(p is not None and p["do_remote_prefill"] for p in params)
    return params


def ref_tokens(reference: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [
        o.outputs[0].token_ids for o in run(reference, prompts, max_tokens, [None] * len(prompts))
    ]


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def extra(eng: LLMEngine, key: str) -> float:
    return eng.get_stats().connector.extra[key]


def test_outputs_equal_with_disaggregation(engines, reference) -> None:
    """Prompts shorter than a block, of exactly whole blocks, and long ones, pulled
    concurrently: each decode equals recomputation and loads every full remote block (but the
    last prompt token)."""
    rng = random.Random(0)
    lens = [5, 16, 47, 200, 513]
    prompts = [rand_prompt(rng, n) for n in lens]
    producer = engines(kv_role="producer")
    consumer = engines(kv_role="consumer")
    params = prefill(producer, prompts)
    for n, p in zip(lens, params, strict=True):
        assert len(p["remote_block_ids"]) == n // BS and p["remote_block_size"] == BS
        assert p["remote_num_tokens"] == n // BS * BS
        assert p["remote_host"] == "127.0.0.1" and p["remote_port"] > 0
    assert extra(producer, "pd_leases_active") == 4  # the 5-token prompt has no full block
    outs = run(consumer, prompts, 24, params)
    want = ref_tokens(reference, prompts, 24)
    assert [o.outputs[0].token_ids for o in outs] == want
    for n, o in zip(lens, outs, strict=True):
        assert o.metrics.num_cached_tokens == 0
        assert o.metrics.num_external_cached_tokens == min(n // BS * BS, n - 1)
    total = sum(n // BS for n in lens)
    assert extra(consumer, "pd_blocks_pulled") == total
    assert extra(consumer, "pd_blocks_invalid") == 0
    drain(producer)
    assert extra(producer, "pd_blocks_sent") == total
    assert extra(producer, "pd_leases_pulled") == 4
    st = consumer.get_stats().connector
    assert st.load_bytes == total * consumer.runner.kv_block_bytes()


def test_text_prompt(engines, reference) -> None:
    """A text prompt: the decode leg tokenizes the same way, so the chain hashes agree."""
    producer = engines(kv_role="both")
    consumer = engines(kv_role="both")
    text = "The history of the paged key value cache begins with " * 6
    sp1 = SamplingParams(max_tokens=1, temperature=0.0)
    rid = producer.add_request(None, text, sp1, kv_transfer_params={"do_remote_decode": True})
    out = None
    while out is None:
        out = next((o for o in producer.step() if o.request_id == rid and o.finished), None)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    rid = consumer.add_request(None, text, sp, kv_transfer_params=out.kv_transfer_params)
    got = None
    while got is None:
        got = next((o for o in consumer.step() if o.request_id == rid and o.finished), None)
    ref_id = reference.add_request(None, text, sp)
    want = None
    while want is None:
        want = next((o for o in reference.step() if o.request_id == ref_id and o.finished), None)
    assert got.outputs[0].text == want.outputs[0].text
    assert got.metrics.num_external_cached_tokens > 0


def test_consumer_prefix_hit_pulls_only_the_rest(engines, reference) -> None:
    rng = random.Random(1)
    prompt = rand_prompt(rng, 300)  # 18 full blocks
    producer = engines(kv_role="producer")
    consumer = engines(kv_role="consumer")
    # The consumer already holds the first 5 blocks (another request shared them).
    run(consumer, [prompt[:80] + rand_prompt(rng, 30)], 1, [None])
    (params,) = prefill(producer, [prompt])
    (out,) = run(consumer, [prompt], 16, [params])
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 16)[0]
    assert out.metrics.num_cached_tokens == 80
    assert out.metrics.num_external_cached_tokens == 288 - 80
    assert extra(consumer, "pd_blocks_pulled") == 18 - 5
    drain(producer)
    assert extra(producer, "pd_blocks_sent") == 18 - 5


def test_full_local_hit_hands_the_lease_back_at_once(engines, reference) -> None:
    """The consumer holds every remote block: nothing is pulled, and the producer's blocks are
    freed right away, long before the lease would expire."""
    rng = random.Random(2)
    prompt = rand_prompt(rng, 100)
    producer = engines(kv_role="producer", kv_lease_timeout=600.0)
    consumer = engines(kv_role="consumer")
    run(consumer, [prompt], 1, [None])
    (params,) = prefill(producer, [prompt])
    (out,) = run(consumer, [prompt], 8, [params])
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 8)[0]
    assert out.metrics.num_external_cached_tokens == 0
    assert extra(consumer, "pd_pulls") == 0 and extra(consumer, "pd_releases_sent") == 1
    drain(producer, timeout=30)
    assert extra(producer, "pd_leases_pulled") == 1 and extra(producer, "pd_blocks_sent") == 0


def test_other_prompt_or_model_is_refused(engines, reference, tiny_model_dir) -> None:
    """Parameters of another prompt (chain hash differs) or of an engine with another hash
    seed (fingerprint differs) are refused before any pull; the leases are handed back."""
    rng = random.Random(3)
    a, b = rand_prompt(rng, 120), rand_prompt(rng, 120)
    producer = engines(kv_role="producer", kv_lease_timeout=600.0)
    consumer = engines(kv_role="consumer")
    other_seed = engines(kv_role="consumer", prefix_hash_seed="another-seed")
    pa, pb = prefill(producer, [a, a])
    (out,) = run(consumer, [b], 8, [pa])  # a's blocks offered for prompt b
    assert out.outputs[0].token_ids == ref_tokens(reference, [b], 8)[0]
    assert out.metrics.num_external_cached_tokens == 0
    (out,) = run(other_seed, [a], 8, [pb])
    assert out.outputs[0].token_ids == ref_tokens(reference, [a], 8)[0]
    assert out.metrics.num_external_cached_tokens == 0
    for eng in (consumer, other_seed):
        assert extra(eng, "pd_pulls") == 0 and extra(eng, "pd_releases_sent") == 1
    drain(producer, timeout=30)
    assert extra(producer, "pd_leases_pulled") == 2 and extra(producer, "pd_blocks_sent") == 0


def test_nothing_listening_recomputes(engines, reference) -> None:
    rng = random.Random(4)
    prompt = rand_prompt(rng, 150)
    producer = engines(kv_role="producer", kv_lease_timeout=1.0)  # never pulled
    consumer = engines(kv_role="consumer", kv_transfer_timeout=2.0)
    (params,) = prefill(producer, [prompt])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        params = dict(params, remote_port=s.getsockname()[1])
    t0 = time.monotonic()
    (out,) = run(consumer, [prompt], 8, [params])
    assert time.monotonic() - t0 < 60
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 8)[0]
    assert out.metrics.num_external_cached_tokens == 0
    assert extra(consumer, "pd_pulls_failed") == 1 and extra(consumer, "pd_blocks_pulled") == 0


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers (a stalled producer)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                conns.append(srv.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        srv.close()


def test_stalled_transfer_recomputes_in_bounded_time(engines, reference) -> None:
    rng = random.Random(5)
    prompt = rand_prompt(rng, 150)
    producer = engines(kv_role="producer", kv_lease_timeout=1.0)  # never pulled
    consumer = engines(kv_role="consumer", kv_transfer_timeout=1.0)
    (params,) = prefill(producer, [prompt])
    with silent_server() as port:
        t0 = time.monotonic()
        (out,) = run(consumer, [prompt], 8, [dict(params, remote_port=port)])
        waited = time.monotonic() - t0
    assert 1.0 <= waited < 60  # the no-progress timeout, then a recompute
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 8)[0]
    assert out.metrics.num_external_cached_tokens == 0
    assert extra(consumer, "pd_pulls_failed") == 1


def test_corrupt_block_fails_its_digest_and_is_recomputed(engines, reference) -> None:
    """A block changed after the prefill (here: by hand, after the lease was sealed) fails its
    digest on the consumer: the blocks before it are used, it and the rest recomputed."""
    rng = random.Random(6)
    prompt = rand_prompt(rng, 200)  # 12 full blocks
    producer = engines(kv_role="producer")
    consumer = engines(kv_role="consumer")
    (params,) = prefill(producer, [prompt])
    lease = pd_of(producer).leases.get(params["remote_request_id"])
    assert lease is not None and lease.sealed.wait(30) and lease.digests is not None
    producer.kv_cache[params["remote_block_ids"][4]].add_(0.5)
    (out,) = run(consumer, [prompt], 12, [params])
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 12)[0]
    assert out.metrics.num_external_cached_tokens == 4 * BS
    assert extra(consumer, "pd_blocks_pulled") == 4
    assert extra(consumer, "pd_blocks_invalid") == 12 - 4
    drain(producer)
    assert extra(producer, "pd_pulls_served_failed") == 1


def test_lease_expiry_frees_the_blocks(engines, reference) -> None:
    rng = random.Random(7)
    prompt = rand_prompt(rng, 100)
    producer = engines(kv_role="producer", kv_lease_timeout=0.5)
    consumer = engines(kv_role="consumer")
    (params,) = prefill(producer, [prompt])
    assert producer.get_stats().kv_cache_usage > 0  # held for the decode side
    drain(producer, timeout=30)  # nobody pulls: the lease expires
    assert_baseline(producer)
    assert extra(producer, "pd_leases_expired") == 1
    # A late decode leg finds the lease gone and recomputes.
    (out,) = run(consumer, [prompt], 8, [params])
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 8)[0]
    assert out.metrics.num_external_cached_tokens == 0
    assert extra(consumer, "pd_pulls_failed") == 1


def test_lease_serves_one_pull(engines, reference) -> None:
    """A second decode leg with the same parameters finds the lease ended and recomputes."""
    rng = random.Random(8)
    prompt = rand_prompt(rng, 100)
    producer = engines(kv_role="producer")
    c1 = engines(kv_role="consumer")
    c2 = engines(kv_role="consumer")
    (params,) = prefill(producer, [prompt])
    (o1,) = run(c1, [prompt], 8, [params])
    (o2,) = run(c2, [prompt], 8, [params])
    want = ref_tokens(reference, [prompt], 8)[0]
    assert o1.outputs[0].token_ids == want == o2.outputs[0].token_ids
    assert o1.metrics.num_external_cached_tokens == 96
    assert o2.metrics.num_external_cached_tokens == 0


def test_abort_before_the_pull_hands_the_lease_back(engines) -> None:
    rng = random.Random(9)
    prompt = rand_prompt(rng, 100)
    producer = engines(kv_role="producer", kv_lease_timeout=600.0)
    consumer = engines(kv_role="consumer")
    (params,) = prefill(producer, [prompt])
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    rid = consumer.add_request(None, prompt, sp, kv_transfer_params=params)
    consumer.abort_request([rid])
    drain(consumer)
    drain(producer, timeout=30)  # released by the consumer, not by expiry
    assert extra(producer, "pd_leases_pulled") == 1 and extra(producer, "pd_leases_expired") == 0


def test_abort_while_pulling_releases_the_blocks(engines) -> None:
    """A request aborted while its pull is stalled lets go of its blocks at once (the pull's
    socket is shut down), not after the transfer timeout."""
    rng = random.Random(10)
    prompt = rand_prompt(rng, 150)
    producer = engines(kv_role="producer", kv_lease_timeout=1.0)  # never pulled
    consumer = engines(kv_role="consumer", kv_transfer_timeout=300.0)
    (params,) = prefill(producer, [prompt])
    with silent_server() as port:
        sp = SamplingParams(max_tokens=8, temperature=0.0)
        rid = consumer.add_request(
            None, prompt, sp, kv_transfer_params=dict(params, remote_port=port)
        )
        deadline = time.monotonic() + 30
        while not pd_of(consumer).puller._socks:  # connected, waiting for the header
            assert time.monotonic() < deadline
            consumer.step()
        assert consumer.get_stats().kv_cache_usage > 0
        consumer.abort_request([rid])
        t0 = time.monotonic()
        drain(consumer, timeout=30)
        assert time.monotonic() - t0 < 10  # far below the 300 s transfer timeout
        assert_baseline(consumer)
    assert extra(consumer, "pd_pulls_failed") == 1


def test_offload_and_pd_chained(engines, reference) -> None:
    """kv_role with a host tier: the decode leg's blocks come from the producer, its stores go
    to the host tier, and a later request hits them there."""
    rng = random.Random(11)
    prompt = rand_prompt(rng, 256)
    producer = engines(kv_role="producer", kv_offload_size=0.01, kv_offload_block_size=16)
    consumer = engines(
        kv_role="consumer", kv_offload_size=0.01, kv_offload_block_size=16, num_kv_blocks=40
    )
    (params,) = prefill(producer, [prompt])
    (out,) = run(consumer, [prompt], 8, [params])
    want = ref_tokens(reference, [prompt], 8)[0]
    assert out.outputs[0].token_ids == want
    assert out.metrics.num_external_cached_tokens == 255
    # Evict the prompt from the consumer's small pool; it comes back from the host tier.
    run(consumer, [rand_prompt(rng, 600)], 1, [None])
    (again,) = run(consumer, [prompt], 8, [None])
    assert again.outputs[0].token_ids == want
    assert again.metrics.num_external_cached_tokens > 0
    st = consumer.get_stats().connector
    assert st.extra["pd_blocks_pulled"] == 16 and st.store_bytes > 0
