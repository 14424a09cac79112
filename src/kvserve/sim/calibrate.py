"""Calibrate the latency model against the real engine on this machine.

``python -m kvserve.sim.calibrate [--preset tiny] [--threads 1]`` builds the real
:class:`LLMEngine` on a preset model (created in a temporary directory), times whole
``engine.step()`` calls of known shapes, prefills of 16..1024 tokens (alone in the step) and
decode-only steps of batch 1..32 at contexts 32..1024, fits the :class:`LatencyModel`
coefficients by non-negative least squares, and prints the fit next to the measurements plus
the host block-copy bandwidth (the CPU "offload" link). The ``cpu-tiny`` preset's numbers
come from this script.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from kvserve.sim.latency_model import LatencyModel, StepShape
from kvserve.sim.runner import step_shape


@dataclass
class Sample:
    shape: StepShape
    seconds: float


class _TimedRunner:
    """Wraps the real model runner and remembers the shape of the last step it ran."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.last_shape: StepShape | None = None

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute_model(self, so):
        self.last_shape = step_shape(so)
        return self._runner.execute_model(so)


def _features(s: StepShape) -> list[float]:
    return [1.0, s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.decode_ctx]


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares by active-set elimination (few columns, small data)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    for _ in range(iters):
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
        if not active:
            break
    return x


def fit(samples: list[Sample], base: LatencyModel) -> LatencyModel:
    # Relative error matters (steps span 100x): weight each row by 1 / measured time.
    a = np.array([_features(s.shape) for s in samples])
    b = np.array([s.seconds for s in samples])
    w = 1.0 / b
    x = nnls(a * w[:, None], b * w)
    return base.replace(
        fixed=float(x[0]),
        prefill_per_token=float(x[1]),
        prefill_attn_per_ctx=float(x[2]),
        decode_per_seq=float(x[3]),
        decode_per_ctx=float(x[4]),
    )


def measure(
    model_dir: str, *, threads: int, repeats: int, clock: str = "cpu", seed: int = 0
) -> list[Sample]:
    """Step samples. ``clock="cpu"``: the engine thread's CPU time (robust when other
    processes share the cores; exact for a single-threaded torch), ``"wall"``: wall time."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=model_dir,
        num_kv_blocks=4096,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        num_threads=threads,
    )
    runner = _TimedRunner(ModelRunner(config))
    engine = LLMEngine(config, runner=runner)
    vocab = runner.model_config.vocab_size
    rng = random.Random(seed)
    samples: list[Sample] = []
    ids = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(8, vocab) for _ in range(n)]

    now = time.thread_time if clock == "cpu" else time.perf_counter

    def timed_step() -> tuple[StepShape | None, float]:
        runner.last_shape = None
        t0 = now()
        engine.step()
        return runner.last_shape, now() - t0

    # Warm up (allocator, first-call overheads).
    for n in (64, 512):
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add_request(f"w{next(ids)}", prompt(n), params)
    while engine.has_unfinished_requests():
        engine.step()

    for n in (16, 32, 64, 128, 256, 512, 768, 1024):
        times = []
        for _ in range(repeats):
            engine.add_request(
                f"p{next(ids)}", prompt(n), SamplingParams(max_tokens=1, ignore_eos=True)
            )
            shape, dt = timed_step()
            while engine.has_unfinished_requests():
                engine.step()
            if shape is not None and shape.prefill_tokens == n:
                times.append(dt)
        samples.append(Sample(step_shape_prefill(n), statistics.median(times)))

    for batch in (1, 4, 8, 16, 32):
        for ctx in (32, 256, 1024):
            for _ in range(batch):
                engine.add_request(
                    f"d{next(ids)}", prompt(ctx), SamplingParams(max_tokens=6, ignore_eos=True)
                )
            by_shape: dict[StepShape, list[float]] = {}
            while engine.has_unfinished_requests():
                shape, dt = timed_step()
                if shape is not None and shape.prefill_tokens == 0 and shape.decode_seqs == batch:
                    by_shape.setdefault(shape, []).append(dt)
            for shape, ts in by_shape.items():
                samples.append(Sample(shape, statistics.median(ts)))
    engine.shutdown()
    return samples


def step_shape_prefill(n: int) -> StepShape:
    from kvserve.sim.latency_model import prefill_chunk_attn

    return StepShape(n, prefill_chunk_attn(0, n))


def copy_bandwidth(block_bytes: int, num_blocks: int = 512) -> float:  # noqa: D401
    """Bytes/s of the engine's batched block copy between two host tensors."""
    import torch

    from kvserve.kv.offload.block_copy import copy_blocks

    elems = block_bytes // 4
    src = torch.randn(num_blocks, elems)
    dst = torch.empty_like(src)
    ids = list(range(num_blocks))
    perm = ids[:]
    random.Random(0).shuffle(perm)
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        copy_blocks(src, dst, perm, ids)
        best = min(best, time.thread_time() - t0)
    return num_blocks * block_bytes / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="model preset to create and measure")
    parser.add_argument("--model", help="an existing model directory instead of a preset")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the engine thread's CPU time (robust on a shared machine); wall: wall time",
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from kvserve.model.presets import make_model

            model_dir = str(make_model(tmp, preset=args.preset))
        from kvserve.model.config import ModelConfig

        mc = ModelConfig.from_pretrained(model_dir)
        samples = measure(model_dir, threads=args.threads, repeats=args.repeats, clock=args.clock)
    itemsize = 4 if mc.torch_dtype == "float32" else 2
    kv_per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * itemsize
    bw = copy_bandwidth(kv_per_token * 16)
    model = fit(samples, LatencyModel(name=f"cpu-{args.preset}", kv_bytes_per_token=kv_per_token))
    head = ("prefill", "attn", "decodes", "ctx", "measured ms", "fit ms")
    print("{:>8} {:>10} {:>8} {:>8} {:>12} {:>8}".format(*head))
    for s in samples:
        sh = s.shape
        print(
            f"{sh.prefill_tokens:>8} {sh.prefill_attn:>10.0f} {sh.decode_seqs:>8} "
            f"{sh.decode_ctx:>8} {s.seconds * 1e3:>12.2f} {model.step_time(sh) * 1e3:>8.2f}"
        )
    errs = [abs(model.step_time(s.shape) - s.seconds) / s.seconds for s in samples]
    print(f"\nmean relative error {statistics.mean(errs):.1%}, max {max(errs):.1%}")
    print(
        "\nfitted LatencyModel:\n"
        f"    fixed={model.fixed:.3g},\n"
        f"    prefill_per_token={model.prefill_per_token:.3g},\n"
        f"    prefill_attn_per_ctx={model.prefill_attn_per_ctx:.3g},\n"
        f"    decode_per_seq={model.decode_per_seq:.3g},\n"
        f"    decode_per_ctx={model.decode_per_ctx:.3g},\n"
        f"    kv_bytes_per_token={kv_per_token},\n"
        f"    cpu_bandwidth={bw:.3g},  # block copy between host tensors\n"
        f"    max_model_len={mc.max_position_embeddings},"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
