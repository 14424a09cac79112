"""Decode step cost: paged KV cache (block tables, torch backend) vs a dense per-request cache.

Same model weights, same batch; only the attention's KV storage differs:
- paged: kvserve's TorchAttentionBackend over ``[num_blocks, L, 2, block_size, H_kv, D]`` with
  shuffled block tables (gathers each request's blocks every step);
- dense: one preallocated contiguous ``[B, H_kv, max_len, D]`` cache per layer (HF static-cache
  style), attention over a padded prefix view, no gather.
Prints per-step times and the paged/dense ratio for the full model step and for attention
alone. Usage: python benchmarks/bench_decode_paged_vs_dense.py [--preset small] [--out FILE]
"""

from __future__ import annotations

import argparse
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


def median_time(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_case(model, batch: int, ctx: int, block_size: int, iters: int) -> dict[str, float]:
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
    meta = AttentionMetadata.build(
        block_size=block_size,
        query_lens=[1] * batch,
        num_computed=[n - 1 for n in lens],
        block_tables=tables,
    )
    input_ids = torch.randint(0, cfg.vocab_size, (batch,))
    positions = torch.tensor([n - 1 for n in lens])
    max_len = max(lens)
    dense = [
        DenseBackend(batch, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype)
        for _ in model.layers
    ]
    lens_t = torch.tensor(lens)
    mask = (torch.arange(max_len)[None, :] < lens_t[:, None])[:, None, None, :]
    for d in dense:
        d.lens, d.mask = lens_t, mask
    paged_backend = TorchAttentionBackend()

    def set_backend(kind: str) -> None:
        for layer, d in zip(model.layers, dense, strict=True):
            layer.self_attn.backend = paged_backend if kind == "paged" else d

    out: dict[str, float] = {}
    with torch.inference_mode():
        for kind in ("paged", "dense"):
            set_backend(kind)
            out[f"{kind}_step"] = median_time(
                lambda: model.compute_logits(model(input_ids, positions, meta, kv)), iters
            )
        # Attention alone (one layer's worth, same q/k/v).
        h_q, h_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = torch.randn(batch, h_q, d, dtype=dtype)
        k = torch.randn(batch, h_kv, d, dtype=dtype)
        v = torch.randn(batch, h_kv, d, dtype=dtype)
        scale = d**-0.5
        out["paged_attn"] = median_time(
            lambda: paged_backend.forward(q, k, v, kv[:, 0], meta, scale), iters * 4
        )
        out["dense_attn"] = median_time(
            lambda: dense[0].forward(q, k, v, None, meta, scale), iters * 4
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
        f"{model_name}, nproc={nproc}, torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}, {platform.platform()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-dir", default=None, help="reuse a model directory")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir or make_model(Path(tempfile.mkdtemp()) / args.preset, args.preset)
    model = load_model(model_dir, dtype="float32", device="cpu")
    lines = [
        f"# Decode step: paged vs dense KV ({args.preset}, fp32, block_size {args.block_size})",
        "",
        f"Machine: {machine()}",
        "",
        "| batch | context | paged step ms | dense step ms | step ratio | paged attn ms "
        "| dense attn ms | attn ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for b in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            r = run_case(model, b, ctx, args.block_size, args.iters)
            row = (
                f"| {b} | {ctx} | {r['paged_step'] * 1e3:.2f} | {r['dense_step'] * 1e3:.2f} "
                f"| {r['paged_step'] / r['dense_step']:.2f} | {r['paged_attn'] * 1e3:.3f} "
                f"| {r['dense_attn'] * 1e3:.3f} | {r['paged_attn'] / r['dense_attn']:.2f} |"
            )
            lines.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
