"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Owns the per-request random generators (one ``torch.Generator`` per seeded request, so its
draws do not depend on which other requests share the batch) and nothing else. Logprobs are
taken from the raw logits (before temperature / top-k / top-p), as vLLM does by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.sampling_params import SamplingParams

Logprobs = tuple[float, dict[int, float]]


@dataclass
class SamplingRow:
    """One row of the logits to sample from."""

    request_id: str
    params: SamplingParams
    num_output_tokens: int = 0  # for min_tokens
    eos_token_id: int | None = None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)  # unseeded requests share it
        self._generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: set[str]) -> None:
        """Forget the generators of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, row: SamplingRow) -> torch.Generator:
        if row.params.seed is None:
            return self._default
        g = self._generators.get(row.request_id)
        if g is None:
            g = self._generators[row.request_id] = torch.Generator().manual_seed(row.params.seed)
        return g

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[Logprobs | None]]:
        """``logits`` ``[N, V]`` (any device/dtype) -> one token id per row, and per row
        ``(sampled logprob, {token: logprob} of the top-k and the sampled token)`` when that
        row asked for logprobs."""
        n = logits.shape[0]
        device = logits.device
        raw = logits
        logits = self._apply_min_tokens(logits, rows)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        # All greedy: one argmax (exact in any dtype: the same first maximum in fp32, where
        # CPU argmax is ~5x faster than over bf16 / fp16).
        sampled = self._sample_random(logits, rows, rand) if rand else _argmax(logits)
        token_ids = sampled.tolist()
        logprobs: list[Logprobs | None] = [None] * n
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=device)
            lp = raw[idx].float().log_softmax(dim=-1)
            k = max(rows[i].params.logprobs for i in want)
            top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            chosen = lp.gather(1, sampled[idx][:, None])[:, 0].tolist()
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                kk = rows[i].params.logprobs
                d = dict(zip(top_ids[j][:kk], top_vals[j][:kk], strict=True))
                d[token_ids[i]] = chosen[j]
                logprobs[i] = (chosen[j], d)
        return token_ids, logprobs

    def _sample_random(
        self, logits: torch.Tensor, rows: list[SamplingRow], rand: list[int]
    ) -> torch.Tensor:
        """Token ids for every row: argmax for greedy rows, a draw for rows ``rand``."""
        n, vocab = logits.shape
        device = logits.device
        sampled = idx = None
        if len(rand) == n:
            sub = logits.float()
        else:
            sampled = logits.argmax(dim=-1)
            idx = torch.tensor(rand, device=device)
            sub = logits[idx].float()
        temp = [rows[i].params.temperature for i in rand]
        if any(t != 1.0 for t in temp):
            sub = sub / torch.tensor(temp, device=device)[:, None]
        top_k = [rows[i].params.top_k for i in rand]
        top_p = [rows[i].params.top_p for i in rand]
        probs = apply_top_k_top_p(sub, top_k, top_p).softmax(dim=-1)
        # Exponential race (argmax p / E, E ~ Exp(1)) == sampling from p; each seeded row draws
        # from its own generator on the CPU so results do not depend on the device or batch.
        noise = torch.empty(len(rand), vocab)
        unseeded = [j for j, i in enumerate(rand) if rows[i].params.seed is None]
        if len(unseeded) == len(rand):
            noise.exponential_(generator=self._default)
        else:
            for j, i in enumerate(rand):
                noise[j].exponential_(generator=self._generator(rows[i]))
        draws = (probs / noise.to(device)).argmax(dim=-1)
        if idx is None:
            return draws
        sampled[idx] = draws
        return sampled

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Forbid EOS and stop tokens until a request has ``min_tokens`` output tokens."""
        masked = False
        for i, r in enumerate(rows):
            if r.num_output_tokens >= r.params.min_tokens:
                continue
            stop = list(r.params.stop_token_ids)
            if r.eos_token_id is not None and not r.params.ignore_eos:
                stop.append(r.eos_token_id)
            stop = [t for t in stop if 0 <= t < logits.shape[1]]
            if stop:
                if not masked:
                    logits, masked = logits.clone(), True
                logits[i, stop] = float("-inf")
        return logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax; half-precision logits on the CPU are widened first (same indices)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k (0: off) and top-p nucleus (1.0: off) to -inf.
    The nucleus is the smallest set of highest-probability tokens whose mass reaches top_p
    (at least one token)."""
    vocab = logits.shape[1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    if use_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    if use_p:
        p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        sorted_logits = sorted_logits.masked_fill(
            (mass_before >= p[:, None]) & (rank > 0), float("-inf")
        )
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
