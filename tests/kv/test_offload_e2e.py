"""End to end: the engine with a tiny primary pool and a host offload tier, on the tiny model.

Oracle: greedy outputs must be identical whether a prefix came from the primary pool, from
the offload tier, or was recomputed (an engine without prefix caching or offloading).
Requests are driven through ``LLMEngine`` with a step bound, so a stuck request fails the
test instead of hanging it.
"""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.outputs import RequestOutput

MAX_STEPS = 5000


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> LLM:
    """Everything recomputed: no prefix caching, no offloading, a large pool."""
    llm = LLM(model=str(tiny_model_dir), num_kv_blocks=1024, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def make_llm(model_dir, num_kv_blocks: int, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("kv_offload_block_size", 16)  # one block per chunk unless a test says
    return LLM(
        model=str(model_dir),
        num_kv_blocks=num_kv_blocks,
        kv_offload_size=kw.pop("kv_offload_size", 0.01),
        enable_prefix_caching=True,
        enable_kv_cache_events=True,
        debug=True,
        **kw,
    )


def primary_hit(model_dir, warm: list[int], prompt: list[int], max_tokens: int,
                **kw) -> RequestOutput:  # fmt: skip
    """``prompt`` run after ``warm`` on an engine whose primary pool (``kw``) holds both: the
    primary-pool-hit answer to compare a tier hit with."""
    big = make_llm(model_dir, **kw)
    try:
        run(big, [warm], 1)
        (out,) = run(big, [prompt], max_tokens)
        return out
    finally:
        big.shutdown()


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, abort: set[int] = frozenset(),
        abort_at_step: int = 1) -> list[RequestOutput | None]:  # fmt: skip
    """Run prompts concurrently; aborts prompts with index in ``abort`` after some steps."""
    eng = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [eng.add_request(None, p, sp) for p in prompts]
    done: dict[str, RequestOutput] = {}
    for step in range(MAX_STEPS):
        if step == abort_at_step and abort:
            eng.abort_request([ids[i] for i in abort])
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    else:
        raise AssertionError(f"engine did not finish: {eng.get_stats()}")
    assert_idle(llm)
    return [done.get(i) for i in ids]


def assert_idle(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_integrity()  # no request alive -> every block free
    conn = eng.connector
    assert not conn._jobs and not conn._reqs
    mgr = conn.manager
    assert all(mgr.ref_count(k) == 0 for k in list(mgr._entries))


def ref_tokens(reference: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run_plain(reference, prompts, max_tokens)]


def run_plain(llm: LLM, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return outs


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def test_prefix_from_tier_equals_primary_and_recompute(tiny_model_dir, reference) -> None:
    rng = random.Random(0)
    a = rand_prompt(rng, 120)
    b = a + rand_prompt(rng, 9)
    llm = make_llm(tiny_model_dir, num_kv_blocks=24)
    try:
        (oa,) = run(llm, [a], 6)
        # Evict a's blocks from the 23-block primary pool.
        run(llm, [rand_prompt(rng, 340)], 2)
        (ob,) = run(llm, [b], 6)
        assert ob.metrics.num_external_cached_tokens >= 96
        assert ob.metrics.num_cached_tokens + ob.metrics.num_external_cached_tokens <= len(b) - 1
        # Primary-pool hit of the same prompt in a large pool.
        ob_primary = primary_hit(tiny_model_dir, a, b, 6, num_kv_blocks=256)
        assert ob_primary.metrics.num_cached_tokens >= 112
        want = ref_tokens(reference, [a, b], 6)
        assert oa.outputs[0].token_ids == want[0]
        assert ob.outputs[0].token_ids == want[1] == ob_primary.outputs[0].token_ids
        st = llm.get_stats().connector
        assert st.load_bytes > 0 and st.store_bytes > 0 and st.lookup_hit_tokens >= 96
        events = llm.engine.take_kv_events()
        cpu = [e for e in events if getattr(e, "medium", None) == "CPU"]
        assert cpu and any(type(e).__name__ == "BlockStored" and e.token_ids for e in cpu)
    finally:
        llm.shutdown()


def test_large_chunks_from_tier_equal_primary_and_recompute(tiny_model_dir, reference) -> None:
    """256-token chunks (16 blocks): a primary hit that ends inside a chunk loads the rest of
    it; outputs equal the primary-pool hit and recomputation."""
    rng = random.Random(6)
    a = rand_prompt(rng, 600)  # two full chunks (512 tokens) reach the tier
    b = a + rand_prompt(rng, 9)
    llm = make_llm(tiny_model_dir, num_kv_blocks=48, kv_offload_block_size=256)
    try:
        assert llm.engine.connector.chunk_tokens == 256
        (oa,) = run(llm, [a], 4)
        run(llm, [rand_prompt(rng, 700)], 1)  # leaves at most 3 of a's blocks in the pool
        (ob,) = run(llm, [b], 4)
        hit, ext = ob.metrics.num_cached_tokens, ob.metrics.num_external_cached_tokens
        assert hit < 256 and ext > 0 and hit + ext == 512  # whole chunks of the tier
        want = ref_tokens(reference, [a, b], 4)
        assert oa.outputs[0].token_ids == want[0] and ob.outputs[0].token_ids == want[1]
        ob_primary = primary_hit(
            tiny_model_dir, a, b, 4, num_kv_blocks=128, kv_offload_block_size=256
        )
        assert ob_primary.metrics.num_cached_tokens >= 592
        assert ob_primary.outputs[0].token_ids == want[1]
        # Two chunks were loaded, the first only past the primary hit.
        st = llm.get_stats().connector
        assert st.extra["loaded_chunks"] == 2 and st.load_bytes == ext // 16 * (
            llm.engine.runner.kv_block_bytes()
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("seed", "policy", "chunk", "scale"),
    [(1, "lru", 16, 1), (2, "arc", 32, 1), (7, "lru", 64, 2), (8, "arc", 256, 8)],
)
def test_randomized_multi_turn(tiny_model_dir, reference, seed, policy, chunk, scale) -> None:
    """Several conversations sharing system prompts, a primary pool far below the working
    set: later turns load their history from the tier; outputs equal recomputation.
    ``scale`` stretches prompts and the pool so that chunks of ``chunk`` tokens fill up."""
    rng = random.Random(seed)
    llm = make_llm(
        tiny_model_dir,
        num_kv_blocks=20 * scale,
        kv_offload_policy=policy,
        kv_offload_block_size=chunk,
        kv_offload_size=0.01 * scale,
    )
    try:
        systems = [rand_prompt(rng, rng.randrange(20, 60) * scale) for _ in range(2)]
        convs = [list(rng.choice(systems)) for _ in range(6)]
        asked: list[list[int]] = []
        got: list[list[int]] = []
        for _turn in range(4):
            prompts = []
            for conv in convs:
                conv += rand_prompt(rng, rng.randrange(5, 40) * scale)
                prompts.append(list(conv))
            outs = run(llm, prompts, 4)
            for conv, p, o in zip(convs, prompts, outs, strict=True):
                asked.append(p)
                got.append(o.outputs[0].token_ids)
                conv += o.outputs[0].token_ids
        st = llm.get_stats()
        assert st.connector.lookup_hit_tokens > 0 and st.connector.load_bytes > 0
        assert got == ref_tokens(reference, asked, 4)
    finally:
        llm.shutdown()


def test_concurrent_requests_load_the_same_chunks(tiny_model_dir, reference) -> None:
    rng = random.Random(3)
    base = rand_prompt(rng, 96)
    llm = make_llm(tiny_model_dir, num_kv_blocks=40)
    try:
        run(llm, [base], 1)
        run(llm, [rand_prompt(rng, 600)], 1)  # flush the primary pool
        prompts = [base + rand_prompt(rng, 5) for _ in range(3)]
        outs = run(llm, prompts, 5)
        # All three were admitted in the same step and served from the tier.
        assert all(o.metrics.num_external_cached_tokens >= 80 for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == ref_tokens(reference, prompts, 5)
    finally:
        llm.shutdown()


def test_preemption_with_offloading(tiny_model_dir, reference) -> None:
    rng = random.Random(4)
    prompts = [rand_prompt(rng, rng.randrange(40, 90)) for _ in range(4)]
    llm = make_llm(tiny_model_dir, num_kv_blocks=20, max_num_seqs=4)
    try:
        outs = run(llm, prompts, 24)
        assert llm.get_stats().num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == ref_tokens(reference, prompts, 24)
    finally:
        llm.shutdown()


def test_aborts_during_transfers(tiny_model_dir, reference) -> None:
    rng = random.Random(5)
    base = rand_prompt(rng, 100)
    llm = make_llm(tiny_model_dir, num_kv_blocks=24)
    try:
        run(llm, [base], 1)
        run(llm, [rand_prompt(rng, 340)], 1)
        prompts = [base + rand_prompt(rng, 4) for _ in range(3)] + [rand_prompt(rng, 50)]
        # Abort two of the loading requests right after admission (their loads in flight)
        # and the fresh one while its stores are in flight.
        outs = run(llm, prompts, 4, abort={0, 2, 3}, abort_at_step=1)
        assert outs[1] is not None
        assert outs[1].outputs[0].token_ids == ref_tokens(reference, [prompts[1]], 4)[0]
        # The tier still serves the prefix afterwards.
        (again,) = run(llm, [base + [7, 8, 9]], 3)
        assert again.outputs[0].token_ids == ref_tokens(reference, [base + [7, 8, 9]], 3)[0]
    finally:
        llm.shutdown()


def test_idle_steps_skip_the_connector_and_change_nothing(tiny_model_dir, reference) -> None:
    """Decode steps with nothing to load or store and nothing in flight cost the connector one
    call (idle_step): the engine skips its worker-side calls there, and only there; outputs
    equal recompute, and every chunk a step completes is still stored."""
    llm = make_llm(tiny_model_dir, num_kv_blocks=64, kv_offload_block_size=16)
    conn = llm.engine.connector
    steps: list[dict] = []

    def counted(name):
        fn = getattr(conn, name)

        def wrapper(*a, **kw):
            out = fn(*a, **kw)
            calls = steps[-1]
            calls[name] = calls.get(name, 0) + 1
            if name == "idle_step":
                calls["idle"] = out
            elif name == "build_connector_meta":
                calls["stores"] = len(out.stores)
            return out

        setattr(conn, name, wrapper)

    for name in ("build_connector_meta", "idle_step", "handle_preemptions", "start_load_kv",
                 "wait_for_save", "get_finished"):  # fmt: skip
        counted(name)
    step = llm.engine.step

    def one_step():
        steps.append({})
        return step()

    llm.engine.step = one_step
    try:
        rng = random.Random(5)
        prompts = [rand_prompt(rng, 20), rand_prompt(rng, 37)]
        outs = run(llm, prompts, 40)
        assert [o.outputs[0].token_ids for o in outs] == ref_tokens(reference, prompts, 40)
        worker_side = ("handle_preemptions", "start_load_kv", "wait_for_save", "get_finished")
        idle = [s for s in steps if s.get("idle")]
        busy = [s for s in steps if "idle_step" in s and not s.get("idle")]
        assert len(idle) > len(steps) // 2  # most decode steps
        assert all(not any(m in s for m in worker_side) for s in idle)
        assert all(all(s.get(m) == 1 for m in worker_side) for s in busy)
        assert all(not s.get("idle") for s in steps if s.get("stores"))  # stores are issued
        # Every chunk the prompts and outputs complete (16 tokens each) was stored.
        stored = conn.stats().extra["stored_chunks"]
        assert stored == sum((len(p) + 40 - 1) // 16 for p in prompts)
    finally:
        llm.shutdown()
