"""Per-request measurements, shared by the HTTP load generator and the offline driver."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """What one request measured (seconds). ``error`` is None when it completed."""

    request_id: str
    session_id: str = ""
    turn: int = 0
    group: int | None = None
    start_time: float = 0.0  # send time, seconds after the run started
    output_len: int = 0  # requested output tokens
    prompt_tokens: int | None = None  # from usage, or the prompt's ids; None when unknown
    cached_tokens: int | None = None  # prompt tokens served from cache; None when not reported
    output_tokens: int = 0
    ttft: float | None = None  # time to first token
    itl: list[float] = field(default_factory=list)  # gaps between streamed token chunks
    e2e: float | None = None  # send to last token
    endpoint: str | None = None  # instance that served it (router header), when known
    error: str | None = None
    # The answer, kept only until the next turn is built (multi-turn feedback).
    output_text: str = ""
    output_token_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def finish_time(self) -> float | None:
        return None if self.e2e is None else self.start_time + self.e2e

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("output_text")
        d.pop("output_token_ids")
        d["itl"] = [round(x, 6) for x in self.itl]
        return d
