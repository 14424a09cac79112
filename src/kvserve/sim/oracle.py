"""The oracle router: the real gateway with a scorer that reads every instance's exact state.

Owns :class:`OracleScorer` and :func:`start_oracle_router`. The scorer runs in the process
that holds the simulated engines (:class:`~kvserve.sim.instance.SimCluster`) and, for each
candidate, reads the engine's block pool (exact primary-cache hit of the prompt), its offload
tier (exact host-tier hit), and its waiting and running queues (the prefill work ahead), then
predicts the request's time to first token with the instance's own latency model::

    ttft(e) = queue_prefill_work(e) + prefill of requests routed to e not yet received
              + own(e),   own(e) = transfer(tier hit) + prefill(uncached tokens)

and picks the minimum of ``ttft(e) + own(e) - min own``: a miss also delays every request
queued behind it, so work beyond the cheapest placement counts twice (pure minimum-TTFT
greedy scatters a group's requests under load and loses its cache). No event lag, no
estimation of what an instance holds: an upper bound for routers that learn instance state
from KV events and scraped metrics. Reads are lock-free lookups of dicts and copies of
queues (atomic under the GIL).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvserve.cluster.config import EndpointSpec, PickerSpec, RouterConfig, ScorerSpec
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scorers import clamp01
from kvserve.engine.hashing import hash_block_tokens

if TYPE_CHECKING:
    from kvserve.cluster.gateway import Router
    from kvserve.sim.instance import SimCluster, SimInstance


class OracleScorer:
    name = "oracle"

    def __init__(self, cluster: SimCluster) -> None:
        self.instances = cluster.by_name()
        # Per instance: own cost of each request routed there, and how many were routed.
        self._routed: dict[str, deque[float]] = {n: deque() for n in self.instances}
        self._num_routed = dict.fromkeys(self.instances, 0)
        self._base_added = {n: i.num_added for n, i in self.instances.items()}
        self._picks: dict[int, tuple[str, float]] = {}  # id(request) -> (pick, own cost)

    def predicted_ttft(self, inst: SimInstance, req: RoutingRequest) -> float:
        """Modelled seconds until ``req``'s first token if it were sent to ``inst`` now."""
        own, ahead = self.predict(inst, req)
        return own + ahead

    def predict(self, inst: SimInstance, req: RoutingRequest) -> tuple[float, float]:
        """(the request's own load + prefill time, the work queued ahead of it) on ``inst``."""
        engine = inst.engine
        lat = inst.runner.latency
        cfg = engine.config
        bs = cfg.block_size
        tokens = list(req.token_ids or [])
        n = len(tokens)
        hashes = hash_block_tokens(
            tokens, bs, seed=cfg.prefix_hash_seed, cache_salt=req.cache_salt
        )[: max(0, (n - 1) // bs)]
        hit = self._gpu_hit(engine, hashes)
        tier_blocks = self._tier_hit(engine, hashes, hit)
        own = lat.prefill_time(n, (hit + tier_blocks) * bs)
        own += lat.transfer_time(tier_blocks * inst.runner.kv_block_bytes())
        return own, self._queue_time(inst) + self._transit_time(inst)

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

    def _queue_time(self, inst: SimInstance) -> float:
        """Prefill still to do for requests the engine holds, at the modelled rate."""
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
        for r in waiting:
            hashes = r.block_hashes[: max(0, (r.num_tokens - 1) // bs)]
            hit = self._gpu_hit(inst.engine, hashes) * bs
            work += lat.prefill_time(r.num_tokens, max(hit, r.num_computed_tokens)) - lat.fixed
        # Decodes batched with the prefill slow each of its steps a little.
        return work + len(running) * lat.decode_per_seq

    def _transit_time(self, inst: SimInstance) -> float:
        """Prefill of requests routed to ``inst`` that its engine has not received yet."""
        name = inst.name
        arrived = inst.num_added - self._base_added[name]
        pending = max(0, self._num_routed[name] - arrived)
        q = self._routed[name]
        while len(q) > pending:
            q.popleft()
        return sum(q)

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        inf = float("inf")
        preds = [
            self.predict(inst, req) if (inst := self.instances.get(e.name)) else (inf, inf)
            for e in endpoints
        ]
        min_own = min(own for own, _ in preds)
        costs = [ahead + 2 * own - min_own for own, ahead in preds]
        # Count the request against its likely pick now (the picker takes the max score):
        # it is in transit from here until the engine receives it; ``observe`` corrects it.
        best = min(range(len(costs)), key=costs.__getitem__)
        if costs[best] != inf:
            name = endpoints[best].name
            self._assume(name, preds[best][0], +1)
            self._picks[id(req)] = (name, preds[best][0])
        finite = [c for c in costs if c != float("inf")]
        if not finite:
            return [0.0] * len(endpoints)
        lo, hi = min(finite), max(finite)
        if hi <= lo:
            return [1.0 if c != float("inf") else 0.0 for c in costs]
        return [0.0 if c == float("inf") else clamp01((hi - c) / (hi - lo)) for c in costs]

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        inst = self.instances.get(endpoint.name)
        if inst is None:
            return
        guess = self._picks.pop(id(req), None)
        if guess is None or guess[0] == endpoint.name:
            return
        # Tie broken otherwise, or failover: move the request to where it went.
        self._assume(guess[0], guess[1], -1)
        self._assume(endpoint.name, self.predict(inst, req)[0], +1)

    def _assume(self, name: str, own: float, delta: int) -> None:
        """Count (``+1``) or uncount (``-1``) one request routed to ``name``."""
        q = self._routed[name]
        self._num_routed[name] += delta
        if delta > 0:
            q.append(own)
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
