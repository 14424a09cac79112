"""Paged attention on CPU: the native kernel and the torch backend vs dense attention.

Three ways to hold the same K/V, same queries, same shapes (the ``small`` preset's heads:
12 query heads, 4 KV heads, head dim 64; block size 16; block tables shuffled):
- kernel: ``NativeAttentionBackend`` (C/OpenMP, reads K/V in place through the block table);
- torch: ``TorchAttentionBackend`` (index_select gather into a workspace, then SDPA);
- dense: one contiguous ``[B, H_kv, S, D]`` cache per layer (HF static-cache style), SDPA over
  it, no gather: the reference a paged cache is measured against.
Parts:
1. decode attention alone, one layer (batch 8, contexts 2k and 8k by default); the paged caches
   have all the model's layers interleaved per block, as the engine's cache does;
2. prefill attention with a cached prefix, one layer: ``n`` new queries after ``c`` cached
   tokens (dense: SDPA with the bottom-right causal mask over a contiguous cache);
3. the full model's decode step (``small`` preset, batch 8, contexts <= its 4096 positions),
   each attention backend in turn on the same model.
Every cell is the median of interleaved calls (the three variants take turns call by call, so
load changes hit all alike); ratios are of CPU time (process time, all threads), the steadier
measure on a shared machine; wall times are recorded too. Usage:
python benchmarks/bench_decode_paged_vs_dense.py [--quick] [--threads 1,2]
[--dtypes float32,bfloat16] [--out benchmarks/results/decode_paged_vs_dense]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.engine.attention import (
    AttentionMetadata,
    NativeAttentionBackend,
    TorchAttentionBackend,
)
from kvserve.engine.attention.native_backend import build_info
from kvserve.model.loader import load_model
from kvserve.model.presets import make_model

GOAL = 1.1  # paged (kernel) / dense attention time, batch 8, contexts 2k and 8k (issue 16)
VARIANTS = ("kernel", "torch", "dense")
Timing = tuple[float, float]  # (wall s, CPU s)


def _time(fn: Callable[[], object]) -> Timing:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def interleaved(fns: dict[str, Callable[[], object]], calls: int) -> dict[str, Timing]:
    """Median (wall, CPU) per function over ``calls`` calls each, taking turns call by call."""
    for fn in fns.values():
        fn()  # warm up (workspaces, first-touch of buffers)
    samples: dict[str, list[Timing]] = {k: [] for k in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            samples[name].append(_time(fn))
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in samples.items()
    }


class DenseBackend:
    """Contiguous per-request KV for one layer; decode-only (positions = current lengths)."""

    def __init__(self, batch: int, max_len: int, h_kv: int, d: int, dtype: torch.dtype) -> None:
        self.k = torch.randn(batch, h_kv, max_len, d).to(dtype)
        self.v = torch.randn(batch, h_kv, max_len, d).to(dtype)
        self.lens = torch.zeros(batch, dtype=torch.long)
        self.mask: torch.Tensor | None = None

    def set_lens(self, lens: list[int]) -> None:
        """The per-step bookkeeping of a dense cache: lengths and, when ragged, a mask."""
        self.lens = torch.tensor(lens)
        s = max(lens)
        ragged = min(lens) != s
        keep = torch.arange(s)[None, :] < self.lens[:, None]
        self.mask = (
            torch.zeros(keep.shape, dtype=self.k.dtype).masked_fill_(~keep, float("-inf"))[
                :, None, None, :
            ]
            if ragged
            else None
        )

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


def paged_cache(
    lens: list[int], layers: int, bs: int, h_kv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """``[num_blocks, layers, 2, bs, H_kv, D]`` with random K/V in layer 0 (the other layers'
    pages are never touched, so never resident) and shuffled block tables."""
    rng = random.Random(seed)
    per = [-(-n // bs) for n in lens]
    num_blocks = sum(per) + 1
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in per:
        tables.append(ids[pos : pos + n])
        pos += n
    kv = torch.empty(num_blocks, layers, 2, bs, h_kv, d, dtype=dtype)
    kv[:, 0] = torch.randn(num_blocks, 2, bs, h_kv, d).to(dtype)
    return kv, tables


def decode_attention(dims: dict, batch: int, ctx: int, dtype: torch.dtype, calls: int) -> dict:
    """Part 1: one layer's decode attention, ragged lengths within 4 blocks of ``ctx``."""
    h_q, h_kv, d, bs, layers = dims["h_q"], dims["h_kv"], dims["d"], dims["bs"], dims["layers"]
    rng = random.Random(ctx)
    lens = [max(1, ctx - rng.randrange(0, bs * 4)) for _ in range(batch)]
    kv, tables = paged_cache(lens, layers, bs, h_kv, d, dtype, ctx)
    kv_layer = kv[:, 0]

    def meta() -> AttentionMetadata:  # built per step by the runner: part of the paged cost
        return AttentionMetadata.build(
            block_size=bs, query_lens=[1] * batch, num_computed=[n - 1 for n in lens],
            block_tables=tables,
        )  # fmt: skip

    q, k, v = (torch.randn(batch, h, d).to(dtype) for h in (h_q, h_kv, h_kv))
    dense = DenseBackend(batch, max(lens), h_kv, d, dtype)
    kernel, torch_backend = NativeAttentionBackend(), TorchAttentionBackend()
    scale = d**-0.5

    def dense_step() -> None:
        dense.set_lens(lens)
        dense.forward(q, k, v, None, None, scale)

    return interleaved(
        {
            "kernel": lambda: kernel.forward(q, k, v, kv_layer, meta(), scale),
            "torch": lambda: torch_backend.forward(q, k, v, kv_layer, meta(), scale),
            "dense": dense_step,
        },
        calls,
    )


def prefill_attention(dims: dict, cached: int, new: int, dtype: torch.dtype, calls: int) -> dict:
    """Part 2: one request's ``new`` queries after ``cached`` tokens, one layer."""
    h_q, h_kv, d, bs, layers = dims["h_q"], dims["h_kv"], dims["d"], dims["bs"], dims["layers"]
    s = cached + new
    kv, tables = paged_cache([s], layers, bs, h_kv, d, dtype, s)
    kv_layer = kv[:, 0]

    def meta() -> AttentionMetadata:
        return AttentionMetadata.build(
            block_size=bs, query_lens=[new], num_computed=[cached], block_tables=tables
        )

    q, k, v = (torch.randn(new, h, d).to(dtype) for h in (h_q, h_kv, h_kv))
    dk, dv = (torch.randn(1, h_kv, s, d).to(dtype) for _ in range(2))
    future = torch.arange(s)[None, :] > torch.arange(cached, s)[:, None]
    mask = torch.zeros(new, s, dtype=dtype).masked_fill_(future, float("-inf"))
    kernel, torch_backend = NativeAttentionBackend(), TorchAttentionBackend()
    scale = d**-0.5

    def dense() -> None:
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], dk, dv, attn_mask=mask if cached else None,
            is_causal=not cached, scale=scale, enable_gqa=h_q != h_kv,
        )  # fmt: skip

    return interleaved(
        {
            "kernel": lambda: kernel.forward(q, k, v, kv_layer, meta(), scale),
            "torch": lambda: torch_backend.forward(q, k, v, kv_layer, meta(), scale),
            "dense": dense,
        },
        calls,
    )


def model_step(model, batch: int, ctx: int, calls: int) -> dict:
    """Part 3: the full model's decode step, each attention backend in turn."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    bs = 16
    rng = random.Random(ctx)
    lens = [max(1, ctx - rng.randrange(0, bs * 4)) for _ in range(batch)]
    per = [-(-n // bs) for n in lens]
    num_blocks = sum(per) + 1
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in per:
        tables.append(ids[pos : pos + n])
        pos += n
    h_kv, d = cfg.num_key_value_heads, cfg.head_dim
    kv = torch.randn(num_blocks, cfg.num_hidden_layers, 2, bs, h_kv, d).to(dtype)
    input_ids = torch.randint(0, cfg.vocab_size, (batch,))
    positions = torch.tensor([n - 1 for n in lens])
    dense = [DenseBackend(batch, max(lens), h_kv, d, dtype) for _ in model.layers]
    backends = {"kernel": NativeAttentionBackend(), "torch": TorchAttentionBackend()}

    def step(kind: str) -> Callable[[], None]:
        def run() -> None:
            meta = AttentionMetadata.build(
                block_size=bs, query_lens=[1] * batch, num_computed=[n - 1 for n in lens],
                block_tables=tables,
            )  # fmt: skip
            if kind == "dense":  # one length/mask computation per step, shared by the layers
                dense[0].set_lens(lens)
                for db in dense[1:]:
                    db.lens, db.mask = dense[0].lens, dense[0].mask
            for layer, db in zip(model.layers, dense, strict=True):
                layer.self_attn.backend = db if kind == "dense" else backends[kind]
            model.compute_logits(model(input_ids, positions, meta, kv))

        return run

    out = interleaved({k: step(k) for k in VARIANTS}, calls)
    for layer in model.layers:
        layer.self_attn.backend = backends["kernel"]
    return out


def _row(cells: dict) -> dict:
    """Timings in ms and the CPU-time ratios of the paged variants to dense."""
    row = {f"{k}_ms": [round(cells[k][0] * 1e3, 3), round(cells[k][1] * 1e3, 3)] for k in cells}
    dense_cpu = max(cells["dense"][1], 1e-9)
    row["kernel_over_dense"] = round(cells["kernel"][1] / dense_cpu, 3)
    row["torch_over_dense"] = round(cells["torch"][1] / dense_cpu, 3)
    row["kernel_over_torch"] = round(cells["kernel"][1] / max(cells["torch"][1], 1e-9), 3)
    return row


def _fmt(ms: list[float]) -> str:
    return f"{ms[0]:.2f} / {ms[1]:.2f}"


def markdown(doc: dict) -> str:
    info = doc["kernel_build"]
    lines = [
        "# Paged attention on CPU: native kernel and torch backend vs dense",
        "",
        f"Recorded {doc['date']}; heads {doc['dims']['h_q']}/{doc['dims']['h_kv']} x "
        f"{doc['dims']['d']} (small preset), block size {doc['dims']['bs']}, paged caches "
        f"with {doc['dims']['layers']} layers per block, shuffled block tables. Kernel: "
        f"{info.get('isa')} paths (CPU: {info.get('cpu_isa')}), OpenMP {info.get('openmp')}. "
        "Load average (1/5/15 min) at start "
        f"{doc['load_start']}, at end {doc['load_end']}.",
        "",
        machine_markdown(doc["machine"]),
        "Cells: median `wall / cpu` ms of interleaved calls; ratios of CPU time "
        f"(goal kernel / dense <= {GOAL} for decode, batch 8, 2k and 8k).",
    ]
    parts = [
        ("decode", "1. Decode attention, one layer", "batch | context"),
        ("prefill", "2. Prefill attention after a cached prefix, one layer", "cached | new"),
        ("step", "3. Full decode step, small preset (all layers, MLPs, logits)", "batch | context"),
    ]
    for key, title, cols in parts:
        rows = [r for r in doc["results"] if r["part"] == key]
        if not rows:
            continue
        lines += [
            "",
            f"## {title}",
            "",
            f"| dtype | threads | {cols} | kernel | torch | dense | kernel/dense | "
            "torch/dense | kernel/torch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            a, b = (r["batch"], r["context"]) if key != "prefill" else (r["cached"], r["new"])
            lines.append(
                f"| {r['dtype']} | {r['threads']} | {a} | {b} | {_fmt(r['kernel_ms'])} "
                f"| {_fmt(r['torch_ms'])} | {_fmt(r['dense_ms'])} | {r['kernel_over_dense']:.2f} "
                f"| {r['torch_over_dense']:.2f} | {r['kernel_over_torch']:.2f} |"
            )
    dec = [r for r in doc["results"] if r["part"] == "decode" and r["batch"] == 8]
    if dec:
        worst = max(r["kernel_over_dense"] for r in dec)
        met = "met" if worst <= GOAL else "not met"
        lines += [
            "",
            f"Goal (decode, batch 8): kernel / dense <= {GOAL}: **{met}** "
            f"(worst {worst:.2f} over {len(dec)} cases).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few calls, small contexts (smoke)")
    ap.add_argument("--threads", default="1,2", help="torch (and kernel) thread counts")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="2048,8192", help="decode contexts (part 1)")
    ap.add_argument("--prefill", default="2048:512,8192:512", help="cached:new pairs (part 2)")
    ap.add_argument("--step-contexts", default="2048", help="model step contexts (part 3)")
    ap.add_argument("--calls", type=int, default=15, help="timed calls per variant and cell")
    ap.add_argument("--model-dir", default=None, help="reuse a small-preset model directory")
    ap.add_argument("--isa", default=None, help="kernel paths (avx512bf16, avx512, ...)")
    ap.add_argument("--out", default="benchmarks/results/decode_paged_vs_dense")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.prefill, args.step_contexts, args.calls = "256", "128:32", "", 3
    if args.isa:
        from kvserve.engine.attention import _paged_attention

        if _paged_attention.set_isa(args.isa) != args.isa:
            raise SystemExit(f"this CPU cannot run the kernel's {args.isa} paths")
    model_dir = args.model_dir or make_model(Path(tempfile.mkdtemp()) / "small", "small")
    load = lambda: " ".join(f"{x:.1f}" for x in os.getloadavg())  # noqa: E731
    doc: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": describe_machine(),
        "kernel_build": build_info(),
        "load_start": load(),
        "args": vars(args),
        "results": [],
    }
    models: dict[str, torch.nn.Module] = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = models.setdefault(dtype_name, load_model(model_dir, dtype=dtype, device="cpu"))
        cfg = model.config
        dims = dict(
            h_q=cfg.num_attention_heads, h_kv=cfg.num_key_value_heads, d=cfg.head_dim, bs=16,
            layers=cfg.num_hidden_layers,
        )  # fmt: skip
        doc["dims"] = dims
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            base = {"dtype": dtype_name, "threads": threads}
            with torch.inference_mode():
                for ctx in map(int, filter(None, args.contexts.split(","))):
                    r = decode_attention(dims, args.batch, ctx, dtype, args.calls)
                    doc["results"].append(
                        base | {"part": "decode", "batch": args.batch, "context": ctx} | _row(r)
                    )
                    print(doc["results"][-1], flush=True)
                for pair in filter(None, args.prefill.split(",")):
                    cached, new = map(int, pair.split(":"))
                    r = prefill_attention(dims, cached, new, dtype, max(3, args.calls // 3))
                    doc["results"].append(
                        base | {"part": "prefill", "cached": cached, "new": new} | _row(r)
                    )
                    print(doc["results"][-1], flush=True)
                for ctx in map(int, filter(None, args.step_contexts.split(","))):
                    r = model_step(model, args.batch, ctx, max(3, args.calls // 3))
                    doc["results"].append(
                        base | {"part": "step", "batch": args.batch, "context": ctx} | _row(r)
                    )
                    print(doc["results"][-1], flush=True)
    doc["load_end"] = load()
    out = Path(args.out)
    if args.quick:
        out = Path(tempfile.mkdtemp()) / out.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    text = markdown(doc)
    old = out.with_suffix(".md")
    if old.exists() and "\n## Reading" in old.read_text():  # hand-written notes carry over
        text += "\n## Reading" + old.read_text().split("\n## Reading", 1)[1]
    old.write_text(text)
    print(markdown(doc))
    print(f"wrote {out}.md/.json")


if __name__ == "__main__":
    main()
