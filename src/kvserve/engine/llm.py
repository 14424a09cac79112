"""The offline API in the shape vLLM users know: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.engine import EngineStats, LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

PromptLike = str | Sequence[int] | dict[str, Any]


class LLM:
    """Offline batch inference. Keyword arguments are :class:`EngineConfig` fields."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in input order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
        ``{"prompt": "..."}``. With ``n > 1`` each output holds ``n`` completions.
        """
        items = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError("sampling_params must be one value or one per prompt")
        # Fan out n into n engine requests (seeds derived so samples differ but reproduce).
        groups: list[list[str]] = []
        for prompt, sp in zip(items, params, strict=True):
            ids = []
            for i in range(sp.n):
                child = dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i)
                rid = f"{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, prompt, child, cache_salt=cache_salt)
                ids.append(rid)
            groups.append(ids)
        finished: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in groups)
        progress = _Progress(total) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if progress:
                            progress.advance()
        except BaseException:
            self.engine.abort_request([r for g in groups for r in g if r not in finished])
            raise
        finally:
            if progress:
                progress.close()
        results = []
        for ids in groups:
            first = finished[ids[0]]
            for i, rid in enumerate(ids[1:], start=1):
                comp = finished[rid].outputs[0]
                comp.index = i
                first.outputs.append(comp)
            results.append(first)
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template, then :meth:`generate`."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(conv, add_generation_prompt=True) for conv in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
    if (
        isinstance(prompts, str | dict)
        or isinstance(prompts, Sequence)
        and prompts
        and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(str(p["prompt"]))
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, str):
            out.append(p)
        else:
            out.append(list(p))
    return out


class _Progress:
    def __init__(self, total: int) -> None:
        from rich.progress import Progress

        self._p = Progress(transient=True)
        self._p.start()
        self._task = self._p.add_task("generating", total=total)

    def advance(self) -> None:
        self._p.advance(self._task)

    def close(self) -> None:
        self._p.stop()
