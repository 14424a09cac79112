"""How close the engine's two phases come to what this machine can do (issue 16, goal 2).

Each ratio against a reference timed in the same process, in turns with the model (reference,
model, reference, ...), so load from other jobs hits both alike:
- prefill: FLOP/s of one prompt's forward pass (``--prompt-len`` tokens, logits of the last
  token only, as the engine computes them) / the matmul peak for the same dtype, the best of
  large square GEMMs (``--peak-sizes``), each timed both through ``torch.mm`` and, on CPU,
  through oneDNN with a packed weight (what the engine's projections run: for fp32 it is ~2x
  torch's BLAS here, so torch.mm alone would let prefill exceed its "peak"). FLOPs counted:
  2 x (tokens x projection weights) + causal attention (2 x 2 x T^2 / 2 x heads x head dim
  per layer) + the LM head for one token.
- decode at batch 1: bytes read per step (every projection weight, the LM head, one embedding
  row, the K/V of the ``--context`` tokens in every layer) / step time, against the memory
  read bandwidth measured by summing a buffer far larger than the caches.
Both through the engine's own path: ``ModelRunner`` (packed bf16 projections where the CPU has
bf16 units, the attention backend ``auto`` picks) with a paged cache and a shuffled block
table. Times are the minimum and the median of the turns; the ratio uses the minima (the least
disturbed estimate of each) and the medians are recorded too.

    .venv/bin/python benchmarks/bench_roofline.py                   # small preset, fp32 + bf16
    .venv/bin/python benchmarks/bench_roofline.py --quick --threads 1 --out /tmp/roofline
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

# What `import kvserve` sets before torch loads (OpenMP threads sleep at barriers); this script
# imports torch first, so it sets it itself.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from kvserve.bench.cli import default_model_dir
from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner, configure_threads
from kvserve.engine.outputs import SchedulerOutput
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import cpu_has_native_bf16

RESULTS = Path(__file__).resolve().parent / "results"


DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def matmul_peak_fn(n: int, dtype: torch.dtype):
    a = torch.randn(n, n, device=DEVICE).to(dtype)
    b = torch.randn(n, n, device=DEVICE).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=DEVICE)
    return lambda: torch.mm(a, b, out=out), 2 * n**3


def packed_peak_fn(n: int, dtype: torch.dtype):
    """The same GEMM through oneDNN with a packed weight (``PackedLinear``), or None where
    the engine would not pack ``dtype``."""
    from kvserve.model.packed_linear import PackedLinear, batch_hint, can_pack

    if not can_pack(dtype, DEVICE, fp32=True):
        return None
    x = torch.randn(n, n, device=DEVICE).to(dtype)
    lin = PackedLinear(torch.randn(n, n, device=DEVICE).to(dtype), None, batch_hint(dtype))
    return lambda: lin(x), 2 * n**3


def read_bandwidth_fn(nbytes: int):
    """Sum of an fp32 buffer of ``nbytes``: reads it once, writes nothing."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=DEVICE)
    return lambda: buf.sum(), buf.numel() * 4


class ModelSteps:
    """A prefill of ``prompt_len`` tokens and decode steps after ``context`` tokens, at
    batch 1, through one :class:`ModelRunner`."""

    def __init__(
        self, model_dir: str, dtype: str, prompt_len: int, context: int, threads: int | None = None
    ) -> None:
        cfg = EngineConfig(
            model=model_dir, dtype=dtype, block_size=16, device=str(DEVICE), num_threads=threads
        )
        self.runner = ModelRunner(cfg)
        m = self.runner.model_config
        self.config = m
        bs = self.runner.block_size
        num_blocks = -(-max(prompt_len, context + 1) // bs) + 1
        self.runner.allocate_kv_cache(num_blocks + 8)
        self.table = list(range(1, num_blocks + 8))
        random.Random(0).shuffle(self.table)
        self.prompt = [random.Random(1).randrange(3, m.vocab_size) for _ in range(prompt_len)]
        self.context = context
        self.greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        # Decode: fill the context once, then every timed step recomputes the same position.
        ids = self.prompt * (context // prompt_len + 1)
        self.decode_req = Request("d", ids[: context + 1], self.greedy, block_size=bs)
        self._run(self.decode_req, context)  # writes the context's K/V

    def _run(self, req: Request, n: int) -> None:
        so = SchedulerOutput(
            scheduled=[req], num_scheduled_tokens={req.request_id: n}, block_ids={}
        )
        so.block_ids[req.request_id] = self.table
        self.runner.execute_model(so)
        req.num_computed_tokens += n

    def prefill(self) -> None:
        req = Request("p", self.prompt, self.greedy, block_size=self.runner.block_size)
        self._run(req, len(self.prompt))

    def decode(self) -> None:
        self.decode_req.num_computed_tokens = self.context
        self._run(self.decode_req, 1)

    # -- what one step does ------------------------------------------------------------
    def projection_params(self) -> int:
        m = self.config
        per_layer = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size
        per_layer += 3 * m.hidden_size * m.intermediate_size
        return m.num_hidden_layers * per_layer

    def prefill_flops(self) -> int:
        m, t = self.config, len(self.prompt)
        attn = m.num_hidden_layers * 2 * 2 * (t * t // 2) * m.num_attention_heads * m.head_dim
        return 2 * t * self.projection_params() + attn + 2 * m.hidden_size * m.vocab_size

    def decode_bytes(self) -> int:
        m = self.config
        elem = torch.empty((), dtype=self.runner.dtype).element_size()
        weights = self.projection_params() + m.vocab_size * m.hidden_size + m.hidden_size
        kv = self.context * m.num_hidden_layers * 2 * m.kv_size
        return (weights + kv) * elem


def interleaved(fns: dict[str, callable], turns: int) -> dict[str, list[float]]:
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(turns):
        for k, fn in fns.items():
            times[k].append(_timed(fn))
    return times


def measure(args: argparse.Namespace, dtype: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    tdt = getattr(torch, dtype)
    steps = ModelSteps(args.model, dtype, args.prompt_len, args.context, threads)
    out: dict = {
        "dtype": dtype,
        "threads": threads,
        "attention_backend": getattr(steps.runner.attn_backend, "name", "?"),
        "packed_projections": type(steps.runner.model.layers[0].mlp.down_proj).__name__,
    }
    # Prefill vs the matmul peak.
    peaks = {f"mm{n}": matmul_peak_fn(n, tdt) for n in args.peak_sizes}
    if args.device == "cpu":
        packed = {f"packed{n}": packed_peak_fn(n, tdt) for n in args.peak_sizes}
        peaks |= {k: v for k, v in packed.items() if v is not None}
    fns = {k: f for k, (f, _) in peaks.items()} | {"prefill": steps.prefill}
    t = interleaved(fns, args.turns)
    peak = max(flops / min(t[k]) for k, (_, flops) in peaks.items())
    peak_med = max(flops / statistics.median(t[k]) for k, (_, flops) in peaks.items())
    pf = steps.prefill_flops()
    out["prefill"] = {
        "prompt_len": args.prompt_len,
        "flops": pf,
        "time_min_s": min(t["prefill"]),
        "time_median_s": statistics.median(t["prefill"]),
        "flops_per_s": pf / min(t["prefill"]),
        "peak_flops_per_s": peak,
        "ratio": pf / min(t["prefill"]) / peak,
        "ratio_median": pf / statistics.median(t["prefill"]) / peak_med,
    }
    # Decode vs the read bandwidth.
    read, nbytes = read_bandwidth_fn(args.bandwidth_mib << 20)
    decode_turns = args.turns * 4
    t = interleaved({"read": read, "decode": steps.decode}, decode_turns)
    bw = nbytes / min(t["read"])
    db = steps.decode_bytes()
    out["decode"] = {
        "context": args.context,
        "bytes_per_step": db,
        "step_min_s": min(t["decode"]),
        "step_median_s": statistics.median(t["decode"]),
        "bytes_per_s": db / min(t["decode"]),
        "read_bandwidth_bytes_per_s": bw,
        "ratio": db / min(t["decode"]) / bw,
        "ratio_median": (db / statistics.median(t["decode"]))
        / (nbytes / statistics.median(t["read"])),
    }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the small preset)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cpu", help="cpu | cuda (references on the same device)")
    p.add_argument("--threads", default=None, help="comma list (default: the engine's)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--context", type=int, default=512, help="decode: tokens in the KV cache")
    p.add_argument("--peak-sizes", default="1024,2048", help="square GEMM sizes for the peak")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="read-bandwidth buffer")
    p.add_argument("--turns", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="short prompt, few turns")
    p.add_argument("--out", default=str(RESULTS / "roofline"), help="path without suffix")
    args = p.parse_args(argv)
    args.model = args.model or str(default_model_dir("small"))
    args.peak_sizes = [int(x) for x in args.peak_sizes.split(",")]
    if args.quick:
        args.prompt_len, args.context, args.turns, args.bandwidth_mib = 128, 128, 2, 256
        args.peak_sizes = [512]
    return args


def _markdown(report: dict) -> str:
    rows = [
        "| dtype | threads | prefill FLOP/s | matmul peak | prefill ratio | decode bytes/s | "
        "read bandwidth | decode ratio | decode step (min / median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        pf, dc = r["prefill"], r["decode"]
        rows.append(
            f"| {r['dtype']} | {r['threads']} | {pf['flops_per_s'] / 1e9:.1f} G | "
            f"{pf['peak_flops_per_s'] / 1e9:.1f} G | **{pf['ratio']:.2f}** "
            f"(median {pf['ratio_median']:.2f}) | {dc['bytes_per_s'] / 1e9:.2f} GB/s | "
            f"{dc['read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s | **{dc['ratio']:.2f}** "
            f"(median {dc['ratio_median']:.2f}) | {dc['step_min_s'] * 1e3:.1f} / "
            f"{dc['step_median_s'] * 1e3:.1f} ms |"
        )
    a = report["args"]
    r0 = report["runs"][0]
    return "\n".join(
        [
            "# Roofline: prefill vs matmul peak, decode vs memory read bandwidth",
            "",
            f"Model `{a['model']}`; prefill of {a['prompt_len']} tokens (one request, logits "
            f"of its last token); decode at batch 1 after {a['context']} tokens; {a['turns']} "
            "turns (decode: 4x as many), model and reference interleaved. Goal: >= 0.5 each.",
            f"Attention backend: {r0['attention_backend']}; projections: "
            f"{', '.join(sorted({r['dtype'] + ': ' + r['packed_projections'] for r in report['runs']}))}; "  # noqa: E501
            f"native bf16 on this CPU: {report['native_bf16']}.",
            "",
            *rows,
            "",
            "Ratios use the fastest turn of the model and of its reference (medians in "
            "brackets). Load average (1 min) before / after: "
            f"{report['load_before']:.2f} / {report['load_after']:.2f}.",
            "",
            machine_markdown(report["machine"]),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads:
        threads = [int(x) for x in args.threads.split(",")]
    else:  # the engine's own default (cores minus the one left to the server)
        threads = [configure_threads(None, DEVICE)]
    load_before = os.getloadavg()[0]
    runs = []
    for dtype in args.dtypes.split(","):
        for n in threads:
            r = measure(args, dtype, n)
            pf, dc = r["prefill"], r["decode"]
            print(
                f"{dtype} x{n}: prefill {pf['flops_per_s'] / 1e9:.1f} GFLOP/s of "
                f"{pf['peak_flops_per_s'] / 1e9:.1f} -> {pf['ratio']:.2f}; decode "
                f"{dc['bytes_per_s'] / 1e9:.2f} GB/s of "
                f"{dc['read_bandwidth_bytes_per_s'] / 1e9:.2f} -> {dc['ratio']:.2f}",
                flush=True,
            )
            runs.append(r)
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "native_bf16": cpu_has_native_bf16(),
        "runs": runs,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "machine": describe_machine(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(_markdown(report))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
