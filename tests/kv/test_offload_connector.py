"""The offloading connector driven by the real Scheduler and KVCacheManager.

The model is replaced by a *reference KV writer*: the KV written for the token at position p
is a function of the whole prefix ``tokens[: p + 1]`` (a running CRC), and the "sampled" token
is a function of the KV it reads. Before computing, every scheduled request checks that all
its computed positions hold exactly the expected KV, so a block loaded from the tier into the
wrong place, a partial load, a store racing a reuse, or a skipped recompute fails the test at
the step where it happens. The engine-level tests with a real model are in
``test_offload_e2e.py``.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections import deque

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.connector import create_connector
from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.kv.offload.connector import OffloadingConnector

BS = 4
VOCAB = 50
MAX_TOKENS = 5
GiB = 1 << 30


def expected_kv(tokens: list[int]) -> torch.Tensor:
    """[len(tokens), 2 (K/V), 2] float32: exact encodings of a running prefix CRC."""
    out = torch.empty(len(tokens), 2, 2)
    h = 0
    for p, t in enumerate(tokens):
        h = zlib.crc32(t.to_bytes(4, "little"), h)
        out[p, :, 0] = float(h & 0xFFFF)
        out[p, :, 1] = float(h >> 16)
    return out


class Harness:
    """Scheduler + connector + a KV tensor, stepped in the engine's order."""

    def __init__(
        self,
        num_blocks: int,
        offload_chunks: int,
        *,
        blocks_per_chunk: int = 1,
        policy: str = "lru",
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 32,
        events: bool = False,
        **config_kw,
    ) -> None:
        # kv_cache: [blocks, layers=1, K/V, block_size, heads=1, head_dim=2]
        self.kv = torch.zeros(num_blocks, 1, 2, BS, 1, 2)
        chunk_bytes = self.kv[0].numel() * 4 * blocks_per_chunk
        self.config = EngineConfig(
            model="",
            block_size=BS,
            num_kv_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_offload_size=offload_chunks * chunk_bytes / GiB,
            kv_offload_block_size=BS * blocks_per_chunk,
            kv_offload_policy=policy,
            enable_kv_cache_events=events,
            **config_kw,
        )
        self.kvm = KVCacheManager(
            num_blocks=num_blocks, block_size=BS, max_model_len=4096, enable_kv_cache_events=False
        )
        conn = create_connector(self.config)
        assert isinstance(conn, OffloadingConnector)
        conn.register_kv_caches(self.kv)
        assert conn.tier.num_slots + conn.tier.num_spare == offload_chunks
        self.conn = conn
        self.sched = Scheduler(self.config, self.kvm, conn)
        self.done: dict[str, Request] = {}
        self.checked_tokens = 0
        self.load_jobs: list = []

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), block_size=BS)
        self.sched.add_request(req)
        return req

    def _run_forward(self, so: SchedulerOutput) -> ModelRunnerOutput:
        mro = ModelRunnerOutput()
        work = []
        # Like a model layer: first write every scheduled token's KV, then attend.
        for req in so.scheduled:
            rid = req.request_id
            table = so.block_ids[rid]
            start, n = req.num_computed_tokens, so.num_scheduled_tokens[rid]
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start + n)])
            want = expected_kv(req.all_token_ids[: start + n])
            self.kv[slots[start:] // BS, 0, :, slots[start:] % BS] = want[start:].unsqueeze(-2)
            work.append((req, slots, want))
        flat = self.kv[:, 0].permute(0, 2, 1, 3, 4).reshape(-1, 2, 2)  # [slot, K/V, D]
        for req, slots, want in work:
            rid = req.request_id
            got = flat[slots]
            if not torch.equal(got, want):
                bad = (got != want).any(-1).any(-1).nonzero().flatten().tolist()
                raise AssertionError(f"{rid}: wrong KV at positions {bad[:10]} of {len(want)}")
            self.checked_tokens += len(want)
            if len(want) == req.num_tokens:
                # Sample from what attention reads: all KV of the sequence.
                mro.sampled_token_ids[rid] = [int(got.double().sum().item()) % VOCAB]
        return mro

    def step(self) -> SchedulerOutput:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.load_jobs.extend(meta.loads)
        self.conn.handle_preemptions(so.preempted_req_ids)
        self.conn.start_load_kv(meta)
        mro = self._run_forward(so) if not so.is_empty else ModelRunnerOutput()
        self.conn.wait_for_save(meta)
        if so.is_empty and self.sched.has_requests():
            self.conn.wait_for_transfers(0.002)  # as the engine does: sleep, do not spin
        co = self.conn.get_finished(so.finished_req_ids)
        mro.finished_sending |= co.finished_sending
        mro.finished_recving |= co.finished_recving
        mro.invalid_block_ids |= co.invalid_block_ids
        for req in self.sched.update_from_output(so, mro):
            if req.is_finished:
                self.done[req.request_id] = req
        self.kvm.check_integrity()
        return so

    def run(self, max_steps: int = 20000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                self.drain_storage_writes()
                self.assert_idle()
                return
            if self.step().is_empty:  # only transfers in flight: let them land
                self.conn.worker.wait(list(self.conn._jobs))
        waiting = [(r, len(self.kvm.get_blocks(r.request_id))) for r in self.sched.waiting]
        raise AssertionError(
            f"did not finish: running={self.sched.running} waiting (request, blocks held)="
            f"{waiting} free blocks={self.kvm.get_num_free_blocks()}"
        )

    def settle(self) -> None:
        """Let in-flight stores finish and their completions be applied."""
        self.conn.worker.wait(list(self.conn._jobs))
        self.run()

    def drain_storage_writes(self) -> None:
        """Let the cascade of stored chunks to the storage tiers end (it pins host chunks)."""
        deadline = time.monotonic() + 30
        while self.conn.has_pending_work():
            assert time.monotonic() < deadline, "storage writes did not end"
            self.conn.storage.wait_any(0.05)
            self.conn.get_finished(set())

    def assert_idle(self) -> None:
        self.sched.check_integrity()
        assert not self.conn._jobs and not self.conn._reqs and not self.conn._loads_to_start
        mgr = self.conn.manager
        assert all(mgr.ref_count(k) == 0 for k in list(mgr._entries))
        mgr.check_integrity()
        # The metadata shared by quiet steps was never given work.
        assert all(not (m.loads or m.stores or m.reads) for m in self.conn._quiet_meta)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def reference_outputs(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The same requests with a huge primary pool and no offloading."""
    h = Harness(num_blocks=4096, offload_chunks=1)
    for i, p in enumerate(prompts):
        h.add(f"r{i}", p, max_tokens)
        h.run()
    return [h.done[f"r{i}"].output_token_ids for i in range(len(prompts))]


def test_second_request_loads_prefix_from_tier() -> None:
    h = Harness(num_blocks=12, offload_chunks=64, max_num_seqs=1)
    rng = random.Random(0)
    a = prompt(rng, 30)
    h.add("a", a, 3)
    h.settle()
    # Flush the primary pool's cached blocks with an unrelated request using every block.
    h.add("x", prompt(rng, 40), 2)
    h.settle()
    b = h.add("b", a + [1, 2, 3], 3)
    h.run()
    assert b.num_external_computed_tokens == 28  # 7 full blocks; primary had none left
    assert b.num_cached_tokens == 0
    st = h.conn.stats()
    assert st.load_bytes == 7 * h.conn.tier.layout.block_bytes
    assert st.store_bytes > 0 and st.extra["loaded_chunks"] == 7
    assert h.done["b"].output_token_ids == reference_outputs([a, a + [1, 2, 3]], 3)[1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_partial_chunk_after_primary_hit(k: int) -> None:
    """Primary hit ends inside a chunk: only the chunk's remaining blocks are loaded."""
    h = Harness(num_blocks=64, offload_chunks=200, blocks_per_chunk=k, max_num_seqs=1)
    rng = random.Random(k)
    a = prompt(rng, 26 * BS + 1)
    h.add("a", a, 2)
    h.settle()
    # Evict the primary copies of blocks 3.. by re-using the pool, keep blocks 0..2 cached:
    # touch them by a request sharing only that prefix, then fill the pool.
    h.add("p", a[: 3 * BS + 1], 1)
    h.settle()
    h.add("fill", prompt(rng, 59 * BS), 1)
    h.settle()
    h.load_jobs.clear()
    b = h.add("b", a + [7], 2)
    h.run()
    hit, ext = b.num_cached_tokens, b.num_external_computed_tokens
    assert 0 < hit < 26 * BS and hit % BS == 0 and ext > 0
    assert hit + ext == (26 // k) * k * BS  # whole chunks of the tier
    (job,) = h.load_jobs
    assert job.chunks[0].offset == (hit // BS) % k
    assert sum(len(c.block_ids) for c in job.chunks) * BS == ext
    assert h.done["b"].output_token_ids == reference_outputs([a, a + [7]], 2)[1]


@pytest.mark.parametrize("k", [1, 2])
def test_one_store_per_step_for_every_request_and_a_chunk_computed_twice(k: int) -> None:
    """A step's completed chunks go to the tier as one job, every request's at once; a chunk
    two requests compute in the same step (the same prompt admitted together) is stored once,
    from the first one's blocks, and only that one waits for the store."""
    h = Harness(num_blocks=64, offload_chunks=64, blocks_per_chunk=k, max_num_seqs=4,
                max_num_batched_tokens=64)  # fmt: skip
    rng = random.Random(9 + k)
    shared = prompt(rng, 3 * k * BS + 1)
    other = prompt(rng, 2 * k * BS + 2)
    for rid, p in (("a", shared), ("b", list(shared)), ("c", other)):
        h.add(rid, p, 3)
    so = h.sched.schedule()
    meta = so.kv_connector_metadata
    (job,) = meta.stores
    assert job.keys == h.conn._chunk_keys(h.sched.running[0], 0, 3) + h.conn._chunk_keys(
        h.sched.running[2], 0, 2
    )
    assert len(set(job.keys)) == job.num_chunks == 5 and job.num_blocks == 5 * k
    assert [c.block_ids for c in job.chunks[:3]] == [
        so.block_ids["a"][i * k : (i + 1) * k] for i in range(3)
    ]
    (rec,) = [r for r in h.conn._jobs.values() if r.job is job]
    assert rec.store_reqs == ["a", "c"]
    # Finish that step as the engine would, then the rest.
    h.conn.start_load_kv(meta)
    mro = h._run_forward(so)
    h.conn.wait_for_save(meta)
    h.conn.worker.wait([job.job_id])
    co = h.conn.get_finished(so.finished_req_ids)
    mro.finished_sending |= co.finished_sending
    h.sched.update_from_output(so, mro)
    h.run()
    assert h.conn.stats().extra["stored_chunks"] >= 5
    ref = reference_outputs([shared, shared, other], 3)
    assert [h.done[r].output_token_ids for r in "abc"] == ref


def test_concurrent_requests_on_same_chunks_both_load() -> None:
    h = Harness(num_blocks=40, offload_chunks=64, max_num_seqs=4)
    rng = random.Random(2)
    base = prompt(rng, 32)
    h.add("a", base, 2)
    h.settle()
    h.add("x", prompt(rng, 140), 1)
    h.settle()
    reqs = [h.add(f"c{i}", base + [i, i + 1], 4) for i in range(3)]
    h.load_jobs.clear()
    h.step()  # all three admitted in one step: all load (no convoy on the same chunks)
    assert len({j.job_id for j in h.load_jobs}) >= 2
    h.run()
    assert all(r.num_external_computed_tokens > 0 for r in reqs)
    ref = reference_outputs([base] + [base + [i, i + 1] for i in range(3)], 4)
    assert [h.done[f"c{i}"].output_token_ids for i in range(3)] == ref[1:]


def test_abort_during_load_releases_blocks_and_pins() -> None:
    h = Harness(num_blocks=16, offload_chunks=64, max_num_seqs=2)
    rng = random.Random(3)
    a = prompt(rng, 40)
    h.add("a", a, 1)
    h.settle()
    h.add("x", prompt(rng, 56), 1)
    h.settle()
    b = h.add("b", a + [1], 3)
    # Hold the transfer thread so that the load is still in flight when b is aborted (an idle
    # step otherwise waits for it in wait_for_transfers).
    gate, real_run = threading.Event(), h.conn.worker._run
    h.conn.worker._run = lambda job: (gate.wait(10), real_run(job))[1]
    h.step()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert "b" in h.sched.held  # the load still writes its blocks
    gate.set()
    h.run()
    assert "b" not in h.sched.held
    h.add("y", prompt(rng, 56), 1)
    h.settle()
    # Aborted between schedule() and start_load_kv: the load still runs, then releases.
    c = h.add("c", a + [2], 3)
    so = h.sched.schedule()
    assert c.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert "c" in h.sched.held
    h.conn.start_load_kv(so.kv_connector_metadata)
    h.conn.wait_for_save(so.kv_connector_metadata)
    h.conn.worker.wait(list(h.conn._jobs))
    co = h.conn.get_finished(set())
    assert co.finished_sending == {"c"} and not co.finished_recving
    mro = ModelRunnerOutput(finished_sending=co.finished_sending)
    h.sched.update_from_output(so, mro)
    assert "c" not in h.sched.held
    h.run()


def test_corrupt_chunk_in_tier_is_recomputed() -> None:
    h = Harness(num_blocks=14, offload_chunks=64, max_num_seqs=1)
    rng = random.Random(4)
    a = prompt(rng, 36)
    h.add("a", a, 1)
    h.settle()
    h.add("x", prompt(rng, 48), 1)
    h.settle()
    mgr = h.conn.manager
    # Corrupt the tier's copy of block 4 of `a`.
    ref_req = Request("tmp", a, SamplingParams(max_tokens=1), block_size=BS)
    slot = mgr.slot_of(ref_req.block_hashes[4])
    assert slot is not None
    h.conn.tier.blocks[slot].fill_(-1.0)
    b = h.add("b", a + [5], 2)
    h.run()
    # Loaded blocks 0..3 were kept, 4.. recomputed; the output is unaffected. The metrics
    # report what was served (4 blocks), not what was planned (9).
    assert b.num_cached_tokens + b.num_external_computed_tokens == 16
    assert h.conn.stats().extra["invalid_chunks"] == 1
    assert mgr.lookup([ref_req.block_hashes[4]]) in (0, 1)  # dropped, maybe stored again
    assert h.done["b"].output_token_ids == reference_outputs([a, a + [5]], 2)[1]


def test_events_carry_tokens_and_parents() -> None:
    h = Harness(num_blocks=32, offload_chunks=4, blocks_per_chunk=2, events=True)
    rng = random.Random(5)
    a = prompt(rng, 4 * BS * 2 + 3)  # 4 chunks of 2 blocks
    req = h.add("a", a, 1)
    h.settle()
    ev = h.conn.take_events()
    stored = [e for e in ev if isinstance(e, BlockStored)]
    from kvserve.engine.hashing import hash_to_int

    assert [x for e in stored for x in e.block_hashes] == [
        hash_to_int(x) for x in req.block_hashes[:8]
    ]
    assert stored[0].parent_block_hash is None and stored[0].medium == "CPU"
    assert [t for e in stored for t in e.token_ids] == a[: 8 * BS]
    assert all(e.block_size == BS for e in stored)
    # A new sequence evicts: BlockRemoved lists the engine block hashes of whole chunks.
    h.add("b", prompt(rng, 4 * BS * 2 + 1), 1)
    h.settle()
    removed = [e for e in h.conn.take_events() if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) == 2 for e in removed)


@pytest.mark.parametrize(("seed", "policy", "k"), [(10, "lru", 1), (11, "arc", 2), (12, "lru", 3)])
def test_randomized_multi_turn_small_pool(seed: int, policy: str, k: int) -> None:
    """Multi-turn conversations + shared system prompts, primary pool far below the working
    set, preemptions and aborts: every computed position always holds the right KV and the
    outputs equal a run with a huge pool and no offloading."""
    rng = random.Random(seed)
    h = Harness(
        num_blocks=20,
        offload_chunks=40 // k,
        blocks_per_chunk=k,
        policy=policy,
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
    systems = [prompt(rng, rng.randrange(8, 30)) for _ in range(3)]
    convs = [list(rng.choice(systems)) for _ in range(8)]
    all_prompts: list[tuple[str, list[int], int]] = []
    aborted: set[str] = set()
    n = 0
    for _turn in range(6):
        batch = []
        for c, conv in enumerate(convs):
            if rng.random() < 0.3:
                continue
            conv += prompt(rng, rng.randrange(1, 9))
            if len(conv) > 56:
                conv[:] = list(rng.choice(systems))
                conv += prompt(rng, 3)
            rid = f"t{n}"
            n += 1
            batch.append((rid, list(conv), c))
            h.add(rid, list(conv), MAX_TOKENS)
        for _ in range(rng.randrange(1, 6)):
            if h.sched.has_requests():
                h.step()
        # Abort some requests mid-flight (possibly while loading or storing).
        for rid, _, _ in batch:
            if rid in h.sched.requests and rng.random() < 0.15:
                h.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        h.run()
        for rid, p, c in batch:
            all_prompts.append((rid, p, MAX_TOKENS))
            if rid not in aborted:
                convs[c] += h.done[rid].output_token_ids
    h.settle()
    st = h.conn.stats()
    # The workload did exercise what it is meant to.
    assert st.extra["loaded_chunks"] >= 10 and st.extra["evicted_chunks"] > 0
    assert h.sched.num_preemptions > 0 and aborted
    ok = [(rid, p, m) for rid, p, m in all_prompts if rid not in aborted]
    ref = reference_outputs([p for _, p, _ in ok], MAX_TOKENS)
    assert [h.done[rid].output_token_ids for rid, _, _ in ok] == ref


def test_requests_loading_kv_count_against_max_num_seqs() -> None:
    """Requests waiting for an asynchronous load hold blocks and staging room: the scheduler
    admits no more of them than max_num_seqs allows with the running ones."""
    rng = random.Random(11)
    h = Harness(num_blocks=64, offload_chunks=64, max_num_seqs=2, max_num_batched_tokens=64)
    prompts = [prompt(rng, 20) for _ in range(6)]
    for i, p in enumerate(prompts):
        h.add(f"a{i}", p, 1)
    h.run()
    h.settle()
    assert h.sched.reset_prefix_cache()  # the second requests hit only in the tier
    peak = [0]
    schedule = h.sched.schedule

    def counted():
        out = schedule()
        loading = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in h.sched.waiting)
        peak[0] = max(peak[0], len(h.sched.running) + loading)
        return out

    h.sched.schedule = counted
    for i, p in enumerate(prompts):
        h.add(f"b{i}", p + [1, 2], 2)
    h.run()
    assert len(h.load_jobs) >= 6 and all(
        h.done[f"b{i}"].num_external_computed_tokens > 0 for i in range(6)
    )
    assert peak[0] <= 2


def test_storage_hit_waits_for_host_slots_pinned_by_loads(tmp_path) -> None:
    """A storage hit is staged through host slots: when every slot is pinned by another
    request's load, the lookup asks again once they free up instead of missing."""
    rng = random.Random(12)
    h = Harness(
        num_blocks=64, offload_chunks=5, max_num_seqs=4, max_num_batched_tokens=64,
        kv_tier=[f"disk:path={tmp_path},size=1MiB,o_direct=false"],
    )  # fmt: skip
    assert h.conn.tier.num_slots == 4  # and a spill slot
    a, b = prompt(rng, 18), prompt(rng, 18)
    for rid, p in [("b0", b), ("a0", a)]:  # b's chunks reach disk, then a's fill the host
        h.add(rid, p, 1)
        h.run()
        h.settle()
    assert h.sched.reset_prefix_cache()
    h.add("a1", a + [1], 1)  # loads its 4 host chunks: every host slot pinned
    h.add("b1", b + [1], 1)  # its 4 chunks are on disk only
    h.run()
    assert h.done["a1"].num_external_computed_tokens == 16
    assert h.done["b1"].num_external_computed_tokens == 16
    h.conn.shutdown()


def test_cascade_write_that_failed_is_retried(redis_server_factory) -> None:
    """A chunk whose write reached no storage tier (the server was down) is written again
    once, later: with the server back by then, it is a storage hit afterwards."""
    rng = random.Random(13)
    srv = redis_server_factory()
    h = Harness(
        num_blocks=64, offload_chunks=8, max_num_seqs=4, max_num_batched_tokens=64,
        kv_tier=[f"redis:url={srv.url},socket_timeout=0.5"],
    )  # fmt: skip
    h.conn.write_retry_delay_s = 60.0  # retried only when the test says so
    p = prompt(rng, 18)
    srv.stop()
    h.add("r0", p, 1)
    while h.sched.has_requests() or h.conn._write_ops:  # stored; the write fails
        h.step()
        h.conn.storage.wait_any(0.01)
    assert h.conn.stats().extra["tier_write_retried_chunks"] == 4
    srv.start()
    h.conn._write_retries = deque((0.0, keys) for _, keys in h.conn._write_retries)  # due now
    h.run()
    assert h.conn.stats().extra["tier_write_failed_chunks"] == 0
    h.conn.manager.clear()  # only the storage tier holds the chunks now
    assert h.sched.reset_prefix_cache()
    h.add("r1", p + [1], 1)
    h.run()
    assert h.done["r1"].num_external_computed_tokens == 16
    h.conn.shutdown()


def test_chunks_the_host_tier_has_no_room_for_still_reach_storage(tmp_path) -> None:
    """A prompt of more chunks than the host tier holds: the chunks it rejects are copied to
    spill slots and written to the storage tier all the same."""
    rng = random.Random(14)
    h = Harness(
        num_blocks=64, offload_chunks=20, max_num_seqs=4, max_num_batched_tokens=128,
        kv_tier=[f"disk:path={tmp_path},size=1MiB,o_direct=false"],
    )  # fmt: skip
    assert h.conn.tier.num_slots == 18  # 2 spill slots
    req = h.add("r0", prompt(rng, 82), 1)  # 20 chunks in one step: 18 fit in the host tier
    h.run()
    h.settle()
    keys = [req.block_hashes[i] for i in range(20)]
    assert h.conn.manager.lookup(keys[:18]) == 18 and h.conn.manager.lookup(keys[18:]) == 0
    assert h.conn.tiers[0].exists(keys) == 20
    assert h.conn.stats().extra["tier_spilled_chunks"] == 2
    assert not h.conn._spills and len(h.conn._spill_free) == 2
    h.conn.shutdown()
