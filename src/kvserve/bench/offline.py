"""The same workloads run offline, through ``kvserve.LLM`` (no HTTP, no client overhead).

All requests of a round are submitted at once with one ``llm.generate`` call, so TTFT is
measured from submission (the engine's ``arrival_time``) and includes queueing behind the
rest of the batch, as in vLLM's offline throughput benchmark. Multi-turn sessions run in
rounds: round k holds every session's turn k, built from its turn k-1 answer (token ids
directly). Think times do not apply offline. Throughput is tokens over the summed wall time
of the rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.bench.loadgen import LoadResult
from kvserve.bench.records import RequestRecord
from kvserve.bench.report import Run, summarize
from kvserve.bench.workloads import Conversation, Workload


def _record(out: Any, req, t0: float, rid: str) -> RequestRecord:
    m = out.metrics
    comp = out.outputs[0]
    rec = RequestRecord(
        request_id=rid,
        session_id=req.session_id,
        turn=req.turn,
        group=req.group,
        start_time=m.arrival_time - t0,
        output_len=req.output_len,
        prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens,
        output_tokens=len(comp.token_ids),
        ttft=m.time_to_first_token,
        e2e=m.e2e_latency,
    )
    if rec.e2e is None and m.last_token_time is not None:
        rec.e2e = m.last_token_time - m.arrival_time
    if comp.finish_reason == "abort":
        rec.error = "aborted"
    return rec


def run_offline(
    llm: Any,
    workload: Workload,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    seed: int | None = None,
    progress: bool = True,
    warmup: Workload | None = None,
    tokenize: Callable[[str], list[int]] | None = None,
) -> LoadResult:
    """Run ``workload`` on ``llm`` (a ``kvserve.LLM``); returns records and the duration."""
    from kvserve import SamplingParams

    def params(output_len: int) -> Any:
        return SamplingParams(
            max_tokens=output_len, temperature=temperature, ignore_eos=ignore_eos, seed=seed
        )

    if warmup is not None and warmup.sessions:
        reqs = [Conversation(s).next_request() for s in warmup.sessions]
        llm.generate([r.prompt for r in reqs], [params(r.output_len) for r in reqs], use_tqdm=False)

    convs = [Conversation(s, "completions", tokenize=tokenize) for s in workload.sessions]
    records: list[RequestRecord] = []
    busy = 0.0
    t0 = time.monotonic()
    status = None
    if progress:
        from rich.console import Console

        status = Console(stderr=True).status(f"offline: {workload.num_requests} requests")
        status.start()
    try:
        rnd = 0
        while True:
            active = [c for c in convs if not c.done]
            if not active:
                break
            reqs = [c.next_request() for c in active]
            if status is not None:
                status.update(f"offline round {rnd}: {len(reqs)} requests (submitted at once)")
            start = time.monotonic()
            outs = llm.generate(
                [r.prompt for r in reqs], [params(r.output_len) for r in reqs], use_tqdm=False
            )
            busy += time.monotonic() - start
            if len(outs) != len(reqs):
                raise RuntimeError(f"generate returned {len(outs)} outputs for {len(reqs)}")
            for c, r, out in zip(active, reqs, outs, strict=True):
                rec = _record(out, r, t0, f"offline{len(records)}-{r.session_id}-{r.turn}")
                records.append(rec)
                comp = out.outputs[0]
                if rec.error is not None:
                    c.end()  # its history is lost
                else:
                    c.record_answer(comp.text, comp.token_ids)
            rnd += 1
    finally:
        if status is not None:
            status.stop()
    return LoadResult(records, busy)


def offline_run(
    model_dir: str | Path,
    workload: Workload,
    *,
    engine_kwargs: dict[str, Any] | None = None,
    label: str = "kvserve-offline",
    warmup: Workload | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    tokenize: Callable[[str], list[int]] | None = None,
    progress: bool = True,
) -> Run:
    """Load ``kvserve.LLM`` on ``model_dir``, run the workload, shut down; one report run."""
    from kvserve import LLM

    kwargs = {k: v for k, v in (engine_kwargs or {}).items() if v is not None}
    t = time.monotonic()
    llm = LLM(model=str(model_dir), **kwargs)
    load_s = time.monotonic() - t
    try:
        result = run_offline(
            llm,
            workload,
            temperature=temperature,
            ignore_eos=ignore_eos,
            progress=progress,
            warmup=warmup,
            tokenize=tokenize,
        )
    finally:
        llm.shutdown()
    summary = summarize(result.records, result.duration, label)
    conf = dict(model=str(model_dir), engine=kwargs, load_seconds=round(load_s, 2))
    return Run(summary, result.records, conf)
