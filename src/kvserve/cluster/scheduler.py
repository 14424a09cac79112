"""The routing decision: filters -> weighted scorers -> picker, and why it went that way.

Owns the composition of the pluggable parts (built from :class:`SchedulerConfig`) and the
decision's reason, reported in metrics: ``single_candidate`` when filters left one
endpoint, otherwise the scorer whose weighted score lifted the pick most above the weakest
candidate (``precise_prefix``, ``load``, ...), or ``tie`` when no scorer told them apart.

Only endpoints that decode (role ``decode`` or ``both``) are ranked. With P/D on, the
decision also says whether the request is split and where its prefill goes
(:mod:`kvserve.cluster.disaggregation`), made here so that every front end gets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cluster.config import PDConfig, SchedulerConfig
from kvserve.cluster.disaggregation import Disaggregator, PDDecision
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.filters import DecodeRoleFilter, Filter, NoEndpointError, make_filter
from kvserve.cluster.pickers import Picker, make_picker
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scorers import Scorer, ScorerContext, make_scorer

REASON_SINGLE = "single_candidate"
REASON_TIE = "tie"


@dataclass
class Decision:
    ranked: list[Endpoint]  # pick first, then the failover order
    scores: dict[str, float]  # total weighted score per candidate
    by_scorer: dict[str, list[float]]  # each scorer's [0, 1] scores, candidates' order
    candidates: list[Endpoint]
    reason: str
    pd: PDDecision | None = None  # P/D on: split or not, and the prefill endpoint


class Scheduler:
    def __init__(
        self,
        filters: list[Filter],
        scorers: list[tuple[Scorer, float]],
        picker: Picker,
        disaggregator: Disaggregator | None = None,
    ) -> None:
        self.filters = filters
        self.scorers = [(s, w) for s, w in scorers if w != 0.0]
        self.picker = picker
        self.disaggregator = disaggregator

    @classmethod
    def from_config(
        cls, config: SchedulerConfig, ctx: ScorerContext, pd: PDConfig | None = None
    ) -> Scheduler:
        filters = [DecodeRoleFilter(), *(make_filter(n) for n in config.filters)]
        scorers = [(make_scorer(s.name, ctx, s.params), s.weight) for s in config.scorers]
        scheduler = cls(filters, scorers, make_picker(config.picker.name, config.picker.params))
        if pd is not None and pd.enabled:
            prefill = cls(
                [],  # the disaggregator passes healthy prefill endpoints of the model
                [(make_scorer(s.name, ctx, s.params), s.weight) for s in pd.prefill_scorers],
                make_picker(pd.prefill_picker.name, pd.prefill_picker.params),
            )
            sources = [s for s, _ in scheduler.scorers if hasattr(s, "held_tokens")]
            scheduler.disaggregator = Disaggregator(
                pd, prefill, sources, ctx.index, ctx.history_block_size
            )
        return scheduler

    def schedule(self, req: RoutingRequest, endpoints: list[Endpoint]) -> Decision:
        """Rank the endpoints for ``req``; raises :class:`NoEndpointError` when none fits."""
        candidates = endpoints
        for f in self.filters:
            candidates = f.apply(req, candidates)
        if not candidates:
            raise NoEndpointError(503, "no endpoint can serve this request")
        n = len(candidates)
        totals = [0.0] * n
        by_scorer: dict[str, list[float]] = {}
        if n > 1:
            for scorer, weight in self.scorers:
                s = scorer.score(req, candidates)
                by_scorer[scorer.name] = s
                for i in range(n):
                    totals[i] += weight * s[i]
        order = self.picker.rank(totals)
        ranked = [candidates[i] for i in order]
        reason = REASON_SINGLE if n == 1 else self._reason(order[0], by_scorer)
        decision = Decision(
            ranked=ranked,
            scores={c.name: t for c, t in zip(candidates, totals, strict=True)},
            by_scorer=by_scorer,
            candidates=candidates,
            reason=reason,
        )
        if self.disaggregator is not None:
            decision.pd = self.disaggregator.decide(req, ranked[0], endpoints)
        return decision

    def _reason(self, picked: int, by_scorer: dict[str, list[float]]) -> str:
        best, best_lift = REASON_TIE, 1e-9
        for scorer, weight in self.scorers:
            s = by_scorer[scorer.name]
            lift = weight * (s[picked] - min(s))
            if lift > best_lift:
                best, best_lift = scorer.name, lift
        return best

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        """Tell stateful scorers where the request was finally served."""
        for scorer, _ in self.scorers:
            scorer.observe(req, endpoint)
