"""The oracle router: the real gateway with a scorer that reads every instance's exact state.

Owns :class:`OracleScorer` and :func:`start_oracle_router`. The scorer runs in the process
that holds the simulated engines (:class:`~kvserve.sim.instance.SimCluster`) and, for each
candidate, reads the engine's block pool (exact primary-cache hit of the prompt, and which
cached blocks a placement would evict), its offload tier (exact host-tier hit), and its
waiting and running queues (the prefill work ahead). It predicts with the instance's own
latency model and picks the minimum of::

    cost(e) = ahead(e) + own(e) + (own(e) - min own) + evict(e)
    ahead(e) = prefill work the engine holds + prefill of requests routed to e, not arrived
    own(e)   = transfer(tier hit) + prefill(uncached tokens)
    evict(e) = prefill of the cached blocks that the new blocks of the waiting, in-transit
               and this request would push out of e's pool (reusable work destroyed)

``ahead + own`` is the request's predicted TTFT. A miss also delays every request queued
behind it, so work beyond the cheapest placement counts twice, and a miss that overflows an
instance's free memory destroys other prefixes that later requests would have hit: pure
minimum-TTFT greedy scatters a group's requests under load and thrashes the cache. Ties go to
the first candidate, and the scores single the pick out (the picker never breaks the tie
another way), so the request is counted in transit exactly where it goes. No event lag, no
estimation of what an instance holds: an upper bound for routers that learn instance state
from KV events and scraped metrics. The engines step in their own threads; reads are copies
of queues and dict lookups, and the free-queue walk stops at an unlinked block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.cluster.config import EndpointSpec, PickerSpec, RouterConfig, ScorerSpec
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.engine.hashing import hash_block_tokens

if TYPE_CHECKING:
    from kvserve.cluster.gateway import Router
    from kvserve.sim.instance import SimCluster, SimInstance

# Score of the runners-up is at most this: only the pick scores 1.0.
RUNNER_UP_MAX = 0.99
MAX_PENDING_PICKS = 4096


@dataclass
class Prediction:
    own: float  # the request's own load + prefill time (s)
    ahead: float  # prefill queued ahead of it: held by the engine and in transit (s)
    evict: float  # prefill of the cached blocks its placement would evict (s)
    new_blocks: int  # blocks it allocates beyond its cache hit


class OracleScorer:
    name = "oracle"

    def __init__(self, cluster: SimCluster) -> None:
        self.instances = cluster.by_name()
        # Per instance: (own cost, new blocks) of each request routed there, not yet arrived.
        self._routed: dict[str, deque[tuple[float, int]]] = {n: deque() for n in self.instances}
        self._num_routed = dict.fromkeys(self.instances, 0)
        self._base_added = {n: i.num_added for n, i in self.instances.items()}
        self._picks: dict[int, tuple[str, float, int]] = {}  # id(request) -> pick, own, blocks
        # The last request asked about, (block size, seed) and its block hashes.
        self._memo: tuple[RoutingRequest, tuple, list[bytes]] | None = None

    def predicted_ttft(self, inst: SimInstance, req: RoutingRequest) -> float:
        """Modelled seconds until ``req``'s first token if it were sent to ``inst`` now."""
        p = self.predict(inst, req)
        return p.own + p.ahead

    def predict(self, inst: SimInstance, req: RoutingRequest) -> Prediction:
        """The request's own load + prefill time, the work ahead of it, and what it evicts."""
        engine = inst.engine
        lat = inst.runner.latency
        cfg = engine.config
        bs = cfg.block_size
        tokens = list(req.token_ids or [])
        n = len(tokens)
        hashes = self._hashes(req, tokens, bs, cfg.prefix_hash_seed)
        hit = self._gpu_hit(engine, hashes)
        tier_blocks = self._tier_hit(engine, hashes, hit)
        own = lat.prefill_time(n, (hit + tier_blocks) * bs)
        own += lat.transfer_time(tier_blocks * inst.runner.kv_block_bytes())
        new_blocks = -(-(n + 1) // bs) - hit
        queued, queued_blocks = self._queue(inst)
        transit, transit_blocks = self._transit(inst)
        demand = queued_blocks + transit_blocks + new_blocks
        evicted = self._evicted_blocks(engine, demand, set(hashes[:hit]))
        evict = lat.prefill_per_token * evicted * bs
        return Prediction(own, queued + transit, evict, new_blocks)

    def _hashes(self, req: RoutingRequest, tokens: list[int], bs: int, seed) -> list[bytes]:
        """Block hashes of the prompt's blocks a hit can cover (all but the last token),
        computed once per request (every candidate asks for the same)."""
        memo = self._memo  # holds the request: its id cannot be reused while it is here
        if memo is not None and memo[0] is req and memo[1] == (bs, seed):
            return memo[2]
        hashes = hash_block_tokens(tokens, bs, seed=seed, cache_salt=req.cache_salt)
        hashes = hashes[: max(0, (len(tokens) - 1) // bs)]
        self._memo = (req, (bs, seed), hashes)
        return hashes

    @staticmethod
    def _gpu_hit(engine, hashes: list[bytes]) -> int:
        cached = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
        n = 0
        for h in hashes:
            if not cached.get(h):
                break
            n += 1
        return n

    @staticmethod
    def _tier_hit(engine, hashes: list[bytes], gpu_hit: int) -> int:
        conn = engine.connector
        manager = getattr(conn, "manager", None)
        if manager is None:
            return 0
        k = conn.blocks_per_chunk
        first = -(-gpu_hit // k)
        keys = [hashes[(i + 1) * k - 1] for i in range(first, len(hashes) // k)]
        chunks = manager.lookup(keys) if keys else 0
        return max(0, min(len(hashes), (first + chunks) * k) - gpu_hit)

    @staticmethod
    def _evicted_blocks(engine, demand: int, own_hit: set[bytes]) -> int:
        """Cached blocks that allocating ``demand`` new blocks would evict.

        Free blocks are handed out from the head of the free queue: uncached ones first,
        then cached ones, least recently freed first. The request's own hit blocks leave
        the free queue before allocation: neither handed out nor evicted.
        """
        if demand <= 0:
            return 0
        pool = engine.kv_cache_manager.block_pool
        queue = pool.free_block_queue
        tail = queue._tail
        node = queue._head.next_free_block
        taken = evicted = steps = 0
        # The engine thread may relink blocks meanwhile: stop at an unlinked block, and
        # never walk more nodes than the pool has.
        while taken < demand and node is not None and node is not tail:
            steps += 1
            if steps > pool.num_blocks:
                break
            h = node.block_hash
            if h is None:
                taken += 1
            elif h not in own_hit:
                taken += 1
                evicted += 1
            node = node.next_free_block
        return evicted

    def _queue(self, inst: SimInstance) -> tuple[float, int]:
        """(prefill still to do for requests the engine holds, new blocks the waiting need)."""
        sched = inst.engine.scheduler
        lat = inst.runner.latency
        running = list(sched.running)
        waiting = list(sched.waiting)
        work = 0.0
        for r in running:
            left = r.num_tokens - r.num_computed_tokens
            if left > 1:
                work += lat.prefill_time(r.num_tokens, r.num_computed_tokens) - lat.fixed
        bs = sched.block_size
        blocks = 0
        for r in waiting:
            hashes = r.block_hashes[: max(0, (r.num_tokens - 1) // bs)]
            hit = self._gpu_hit(inst.engine, hashes)
            work += lat.prefill_time(r.num_tokens, max(hit * bs, r.num_computed_tokens)) - lat.fixed
            blocks += max(0, -(-(r.num_tokens + 1) // bs) - hit)
        # Decodes batched with the prefill slow each of its steps a little.
        return work + len(running) * lat.decode_per_seq, blocks

    def _transit(self, inst: SimInstance) -> tuple[float, int]:
        """(prefill, new blocks) of requests routed to ``inst`` its engine has not received."""
        name = inst.name
        arrived = inst.num_added - self._base_added[name]
        pending = max(0, self._num_routed[name] - arrived)
        q = self._routed[name]
        while len(q) > pending:
            q.popleft()
        return sum(own for own, _ in q), sum(blocks for _, blocks in q)

    def costs(self, req: RoutingRequest, endpoints: list[Endpoint]) -> tuple[list[float], list]:
        """Each endpoint's cost (inf: not a simulated instance) and prediction."""
        preds = [
            self.predict(inst, req) if (inst := self.instances.get(e.name)) else None
            for e in endpoints
        ]
        owns = [p.own for p in preds if p is not None]
        min_own = min(owns) if owns else 0.0
        inf = float("inf")
        costs = [inf if p is None else p.ahead + 2 * p.own - min_own + p.evict for p in preds]
        return costs, preds

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        inf = float("inf")
        costs, preds = self.costs(req, endpoints)
        best = min(range(len(costs)), key=costs.__getitem__)  # first of equals
        if costs[best] == inf:
            return [0.0] * len(endpoints)
        # Count the request against its pick now: it is in transit from here until the
        # engine receives it; ``observe`` moves it on failover.
        p = preds[best]
        name = endpoints[best].name
        self._assume(name, p.own, p.new_blocks, +1)
        if len(self._picks) >= MAX_PENDING_PICKS:  # answers that never came: forget them
            self._picks.clear()
        self._picks[id(req)] = (name, p.own, p.new_blocks)
        lo = costs[best]
        hi = max(c for c in costs if c != inf)
        scores = []
        for i, c in enumerate(costs):
            if i == best:
                scores.append(1.0)
            elif c == inf:
                scores.append(0.0)
            else:
                scores.append(RUNNER_UP_MAX * (hi - c) / (hi - lo) if hi > lo else RUNNER_UP_MAX)
        return scores

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        inst = self.instances.get(endpoint.name)
        guess = self._picks.pop(id(req), None)
        if inst is None or guess is None or guess[0] == endpoint.name:
            return
        # Failover: move the request to where it went.
        self._assume(guess[0], guess[1], guess[2], -1)
        p = self.predict(inst, req)
        self._assume(endpoint.name, p.own, p.new_blocks, +1)

    def _assume(self, name: str, own: float, blocks: int, delta: int) -> None:
        """Count (``+1``) or uncount (``-1``) one request routed to ``name``."""
        q = self._routed[name]
        self._num_routed[name] += delta
        if delta > 0:
            q.append((own, blocks))
        elif q:
            q.pop()


def oracle_router_config(cluster: SimCluster, port: int, host: str, tokenizer: str) -> RouterConfig:
    return RouterConfig(
        host=host,
        port=port,
        endpoints=[
            EndpointSpec(url=i.url, name=i.name, model=i.engine.model_name)
            for i in cluster.instances
        ],
        tokenizer=tokenizer,
        scheduler=_scheduler_config(),
    )


def _scheduler_config():
    from kvserve.cluster.config import SchedulerConfig

    # Replaced by the oracle below; a valid config for the rest of the router.
    return SchedulerConfig(scorers=[ScorerSpec("load", 1.0)], picker=PickerSpec("max_score"))


async def start_oracle_router(
    cluster: SimCluster, port: int, *, host: str = "127.0.0.1", tokenizer: str
) -> Router:
    """The real :class:`Router` gateway, its scorers replaced by the oracle; started."""
    from kvserve.cluster.filters import make_filter
    from kvserve.cluster.gateway import Router
    from kvserve.cluster.pickers import MaxScorePicker
    from kvserve.cluster.scheduler import Scheduler

    router = Router(oracle_router_config(cluster, port, host, tokenizer))
    filters = [make_filter("model"), make_filter("healthy")]
    router.scheduler = Scheduler(filters, [(OracleScorer(cluster), 1.0)], MaxScorePicker(seed=0))
    await router.start()
    return router
