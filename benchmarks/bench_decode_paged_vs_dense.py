"""Decode step cost: paged KV cache (block tables, torch backend) vs a dense per-request cache.

Same model weights, same batch; only the attention's KV storage differs:
- paged: kvserve's TorchAttentionBackend over ``[num_blocks, L, 2, block_size, H_kv, D]`` with
  shuffled block tables (gathers each request's blocks every step; the step includes building
  the AttentionMetadata);
- dense: one preallocated contiguous ``[B, H_kv, max_len, D]`` cache per layer (HF static-cache
  style), attention over a padded prefix view, no gather.
Prints per-step wall and CPU times and the paged/dense ratio for the full model step and for
attention alone (one layer). Paged and dense calls alternate, so load changes on a shared
machine hit both alike. Usage: python benchmarks/bench_decode_paged_vs_dense.py
[--preset small | --model-dir DIR] [--threads 1,2] [--dtype float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.engine.attention import AttentionMetadata, TorchAttentionBackend
from kvserve.model.loader import load_model
from kvserve.model.presets import make_model


class DenseBackend:
    """Contiguous per-request KV for one layer; decode-only (positions = current lengths)."""

    def __init__(self, batch: int, max_len: int, h_kv: int, d: int, dtype) -> None:
        self.k = torch.randn(batch, h_kv, max_len, d, dtype=dtype)
        self.v = torch.randn(batch, h_kv, max_len, d, dtype=dtype)
        self.lens: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def forward(self, q, k, v, kv_layer, meta, scale):
        b, hq, d = q.shape
        h_kv = k.shape[1]
        idx = torch.arange(b)
        self.k[idx, :, self.lens - 1] = k
        self.v[idx, :, self.lens - 1] = v
        s = int(self.lens.max())
        o = F.scaled_dot_product_attention(
            q.view(b, h_kv, hq // h_kv, d),
            self.k[:, :, :s],
            self.v[:, :, :s],
            attn_mask=self.mask,
            scale=scale,
        )
        return o.reshape(b, hq, d)


def _time(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of one call; CPU time is steadier on a shared machine."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def interleaved(fns: dict[str, object], iters: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) per function; the functions take turns call by call, so load
    changes on a shared machine hit all of them alike."""
    for fn in fns.values():
        fn()  # warm up (workspaces, caches)
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(rounds * iters):
        for name, fn in fns.items():
            samples[name].append(_time(fn))
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in samples.items()
    }


def run_case(
    model, batch: int, ctx: int, block_size: int, iters: int, rounds: int
) -> dict[str, tuple[float, float]]:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    rng = random.Random(0)
    lens = [max(1, ctx - rng.randrange(0, block_size * 4)) for _ in range(batch)]
    blocks_per = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per) + 1
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in blocks_per:
        tables.append(ids[pos : pos + n])
        pos += n
    kv = torch.randn(
        num_blocks,
        cfg.num_hidden_layers,
        2,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        dtype=dtype,
    )

    def build_meta() -> AttentionMetadata:
        return AttentionMetadata.build(
            block_size=block_size,
            query_lens=[1] * batch,
            num_computed=[n - 1 for n in lens],
            block_tables=tables,
        )

    meta = build_meta()
    input_ids = torch.randint(0, cfg.vocab_size, (batch,))
    positions = torch.tensor([n - 1 for n in lens])
    max_len = max(lens)
    dense = [
        DenseBackend(batch, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype)
        for _ in model.layers
    ]

    def dense_meta() -> None:  # the dense cache's per-step bookkeeping: lengths and mask
        lens_t = torch.tensor(lens)
        mask = (torch.arange(max_len)[None, :] < lens_t[:, None])[:, None, None, :]
        for d in dense:
            d.lens, d.mask = lens_t, mask

    dense_meta()
    # The model's own backend (shared by its layers); older models made one per layer.
    paged_backend = getattr(model, "attn_backend", None) or TorchAttentionBackend()

    def set_backend(kind: str) -> None:
        for layer, d in zip(model.layers, dense, strict=True):
            layer.self_attn.backend = paged_backend if kind == "paged" else d

    def paged_step() -> None:
        set_backend("paged")
        model.compute_logits(model(input_ids, positions, build_meta(), kv))

    def dense_step() -> None:
        set_backend("dense")
        dense_meta()
        model.compute_logits(model(input_ids, positions, meta, kv))

    h_q, h_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(batch, h_q, d, dtype=dtype)
    k = torch.randn(batch, h_kv, d, dtype=dtype)
    v = torch.randn(batch, h_kv, d, dtype=dtype)
    scale = d**-0.5
    with torch.inference_mode():
        out = interleaved({"paged_step": paged_step, "dense_step": dense_step}, iters, rounds)
        # Attention alone (one layer's worth, same q/k/v).
        out |= interleaved(
            {
                "paged_attn": lambda: paged_backend.forward(q, k, v, kv[:, 0], meta, scale),
                "dense_attn": lambda: dense[0].forward(q, k, v, None, meta, scale),
            },
            iters * 2,
            rounds,
        )
        set_backend("paged")
    return out


def machine() -> str:
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model_name = next(
            (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "?"
        )
    except OSError:
        model_name = platform.processor() or "?"
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return (
        f"{model_name}, nproc={nproc}, torch {torch.__version__}, {platform.platform()}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at start"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-dir", default=None, help="reuse a model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts to run")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    model_dir = args.model_dir or make_model(Path(tempfile.mkdtemp()) / args.preset, args.preset)
    model = load_model(model_dir, dtype=args.dtype, device="cpu")
    lines = [
        f"# Decode step: paged vs dense KV ({args.preset}, {args.dtype}, "
        f"block_size {args.block_size})",
        "",
        f"Machine: {machine()}",
        "",
        "Medians of interleaved calls; `wall / cpu` ms (CPU time = process time, all threads).",
        "",
        "| threads | batch | context | paged step | dense step | step ratio wall / cpu "
        "| paged attn | dense attn | attn ratio wall / cpu |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)

    def ms(x: tuple[float, float]) -> str:
        return f"{x[0] * 1e3:.2f} / {x[1] * 1e3:.2f}"

    def ratio(a: tuple[float, float], b: tuple[float, float]) -> str:
        return f"{a[0] / b[0]:.2f} / {a[1] / max(b[1], 1e-9):.2f}"

    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for b in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                r = run_case(model, b, ctx, args.block_size, args.iters, args.rounds)
                row = (
                    f"| {threads} | {b} | {ctx} | {ms(r['paged_step'])} | {ms(r['dense_step'])} "
                    f"| {ratio(r['paged_step'], r['dense_step'])} | {ms(r['paged_attn'])} "
                    f"| {ms(r['dense_attn'])} | {ratio(r['paged_attn'], r['dense_attn'])} |"
                )
                lines.append(row)
                print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
