"""The P/D decision inside the scheduler: decode endpoint first, the uncached prompt tokens on
it against the threshold, the prefill pool's own profile and saturation, roles."""

from __future__ import annotations

import pytest

from kvserve.cluster.config import (
    ConfigError,
    EndpointSpec,
    PDConfig,
    SchedulerConfig,
    ScorerSpec,
)
from kvserve.cluster.disaggregation import (
    REASON_BELOW,
    REASON_NO_PREFILL,
    REASON_SATURATED,
    REASON_SPLIT,
)
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.filters import NoEndpointError
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scheduler import Scheduler

from .test_scheduling import BS, Ctx, store_prefix

PROMPT = list(range(1, 25 * BS + 1))  # 100 tokens, 25 blocks of 4


def ep(name: str, role: str = "both", **state) -> Endpoint:
    spec = EndpointSpec(url=f"http://{name}:1", name=name, kv_events=f"tcp://{name}:2", role=role)
    e = Endpoint(spec, models=("m",), healthy=True)
    for k, v in state.items():
        setattr(e, k, v)
    return e


def scheduler(ctx: Ctx, threshold: int = 32, **pd) -> Scheduler:
    cfg = SchedulerConfig(
        scorers=[
            ScorerSpec("precise_prefix", 3.0, {"speculative_ttl_s": 60.0}),
            ScorerSpec("load", 1.0, {"capacity": 8}),
        ]
    )
    return Scheduler.from_config(cfg, ctx, PDConfig(threshold=threshold, **pd))


def req(tokens: list[int] = PROMPT, **kw) -> RoutingRequest:
    return RoutingRequest(model="m", token_ids=tokens, **kw)


def test_split_when_the_decode_endpoint_lacks_threshold_tokens() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=100)  # the whole prompt uncached: exactly the threshold
    p, d = ep("p", "prefill"), ep("d", "decode")
    dec = s.schedule(req(), [p, d])
    assert dec.ranked == [d]  # a prefill-only endpoint never serves whole requests
    assert dec.pd is not None and dec.pd.disaggregate and dec.pd.reason == REASON_SPLIT
    assert dec.pd.prefill is p and dec.pd.uncached_tokens == 100
    dec = scheduler(Ctx(), threshold=101).schedule(req(), [p, d])
    assert dec.pd is not None and not dec.pd.disaggregate and dec.pd.reason == REASON_BELOW
    assert dec.pd.prefill is None


def test_tokens_the_decode_endpoint_holds_are_not_counted() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=32)
    p, d = ep("p", "prefill"), ep("d", "decode")
    store_prefix(ctx.index, "d", PROMPT[: 17 * BS])  # 68 held, 32 uncached: split
    dec = s.schedule(req(), [p, d])
    assert dec.pd is not None and dec.pd.disaggregate and dec.pd.uncached_tokens == 32
    store_prefix(ctx.index, "d", PROMPT[: 18 * BS])  # 72 held, 28 uncached: decode alone
    dec = s.schedule(req(), [p, d])
    assert dec.pd is not None and dec.pd.reason == REASON_BELOW and dec.pd.uncached_tokens == 28
    # A full hit: the block with the last prompt token is never a hit (it is computed).
    store_prefix(ctx.index, "d", PROMPT)
    dec = s.schedule(req(), [p, d])
    assert dec.pd is not None and dec.pd.uncached_tokens == BS


def test_decode_endpoint_is_chosen_first_then_its_cache_decides() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=32)
    p, d1, d2 = ep("p", "prefill"), ep("d1", "decode"), ep("d2", "decode")
    store_prefix(ctx.index, "d2", PROMPT[: 24 * BS])
    dec = s.schedule(req(), [p, d1, d2])
    assert dec.ranked[0] is d2  # the prefix holder, by the usual scorers
    assert dec.pd is not None and dec.pd.reason == REASON_BELOW and dec.pd.uncached_tokens == 4
    # Blocks only the prefill endpoint holds do not count for the decode side.
    ctx2 = Ctx()
    store_prefix(ctx2.index, "p", PROMPT)
    dec = scheduler(ctx2).schedule(req(), [p, d1])
    assert dec.pd is not None and dec.pd.disaggregate and dec.pd.uncached_tokens == 100


def test_a_request_just_sent_to_the_decode_endpoint_counts_as_held() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=32)
    p, d = ep("p", "prefill"), ep("d", "decode")
    dec = s.schedule(req(), [p, d])
    assert dec.pd is not None and dec.pd.disaggregate
    s.observe(req(), d)  # the decode leg went to d: it will hold the prompt's blocks
    dec = s.schedule(req(), [p, d])
    assert dec.pd is not None and dec.pd.reason == REASON_BELOW


def test_prefill_pool_profile_saturation_and_absence() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=32, prefill_max_active=2)
    p1, p2, d = ep("p1", "prefill"), ep("p2", "prefill"), ep("d", "decode")
    store_prefix(ctx.index, "p2", PROMPT[: 20 * BS])
    dec = s.schedule(req(), [p1, p2, d])
    assert dec.pd is not None and dec.pd.prefill is p2  # prefix-aware among the prefill pool
    p2.prefill_in_flight = 2  # saturated: the other one
    dec = s.schedule(req(), [p1, p2, d])
    assert dec.pd is not None and dec.pd.prefill is p1
    p1.num_requests_waiting = 5  # scraped queue: saturated too
    dec = s.schedule(req(), [p1, p2, d])
    assert dec.pd is not None and not dec.pd.disaggregate and dec.pd.reason == REASON_SATURATED
    p1.healthy = p2.healthy = False
    dec = s.schedule(req(), [p1, p2, d])
    assert dec.pd is not None and dec.pd.reason == REASON_NO_PREFILL


def test_an_endpoint_of_both_pools_never_prefills_for_itself() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=32)
    a = ep("a")
    dec = s.schedule(req(), [a])
    assert dec.ranked == [a] and dec.pd is not None and dec.pd.reason == REASON_NO_PREFILL
    b = ep("b")
    dec = s.schedule(req(), [a, b])
    assert dec.pd is not None and dec.pd.disaggregate
    assert {dec.ranked[0].name, dec.pd.prefill.name} == {"a", "b"}  # type: ignore[union-attr]


def test_skips_text_prompts_and_p_d_off() -> None:
    ctx = Ctx()
    s = scheduler(ctx, threshold=32)
    p, d = ep("p", "prefill"), ep("d", "decode")
    dec = s.schedule(req(pd_skip="client_kv_transfer_params"), [p, d])
    assert dec.pd is not None and dec.pd.reason == "client_kv_transfer_params"
    # Untokenized text: about 4 bytes a token.
    dec = s.schedule(RoutingRequest(model="m", text=b"x" * 128), [p, d])
    assert dec.pd is not None and dec.pd.disaggregate and dec.pd.uncached_tokens == 32
    dec = s.schedule(RoutingRequest(model="m", text=b"x" * 124), [p, d])
    assert dec.pd is not None and not dec.pd.disaggregate
    off = Scheduler.from_config(SchedulerConfig(), ctx, PDConfig(threshold=0))
    assert off.disaggregator is None and off.schedule(req(), [p, d]).pd is None
    with pytest.raises(NoEndpointError) as e:
        off.schedule(req(), [p])
    assert e.value.status == 503


def test_roles_and_pd_config_are_checked() -> None:
    assert EndpointSpec(url="http://a:1", role="kv_producer").role == "prefill"
    assert EndpointSpec(url="http://a:1", role="consumer").role == "decode"
    assert EndpointSpec(url="http://a:1").role == "both"
    with pytest.raises(ConfigError, match="role"):
        EndpointSpec(url="http://a:1", role="prefil")
    for bad in ({"threshold": -1}, {"prefill_timeout_s": 0}, {"prefill_max_active": 0}):
        with pytest.raises(ConfigError):
            PDConfig(**bad).validate()
