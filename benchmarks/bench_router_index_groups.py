"""Router KV index with KV cache groups (issue 15): hybrid matching, and no regression of the
full-attention path against the base revision, measured in the same run.

The base revision's ``cluster/kv_index.py`` (``--base-rev``, default: the commit before
KV groups) is loaded from git beside the current one; both index the same event streams,
interleaved round by round (order alternating), and the report gives current/base ratios:

1. Ingestion: pre-encoded batches (64 chained blocks per BlockStored, 1 in 4 batches also
   removes 16 older blocks) decoded and applied to a fresh index, as the subscriber does.
2. Scoring: a 32k-token prompt (2,047 cacheable blocks of 16) against 16 endpoints, endpoint
   i holding the first 128 * (i + 1) blocks of the prompt plus filler (the worst case of
   bench_router_index.py), p50 of the match over ``--reps``.
3. Hybrid (current only): the same shapes for a Gemma-3-like layout (group 0 full attention,
   group 1 sliding, window 512 tokens: 32 blocks), the sliding group keeping only its window
   (blocks that left it removed), and for a sliding-only (Mistral-style) layout. Ingestion
   counts every group's block events.
4. Memory per indexed block (tracemalloc, ``--mem-blocks`` blocks on one endpoint): base,
   current full-attention, current two-group.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/bench_router_index_groups.py
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.cluster import kv_index as current
from kvserve.cluster.prompt_keys import prompt_block_keys
from kvserve.kv.events import BlockRemoved, BlockStored, decode_batch, encode_batch

BS = 16
WINDOW = 512
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_BASE = "566cad133f4b4984f8d3936a94bcbc3cc3550387"  # main before KV groups in the index


def load_base(rev: str) -> ModuleType:
    """``cluster/kv_index.py`` as of ``rev``, imported under another name."""
    src = subprocess.run(
        ["git", "show", f"{rev}:src/kvserve/cluster/kv_index.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spec = importlib.util.spec_from_loader("kv_index_base", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kv_index_base"] = mod
    exec(compile(src, f"{rev[:10]}:kv_index.py", "exec"), mod.__dict__)
    return mod


def group_kw(group: int, layout: str) -> dict:
    """Event fields of ``group`` in a layout: ``full`` (legacy: no group fields), ``hybrid``
    (0 full, 1 sliding) or ``sliding`` (0 sliding)."""
    if layout == "full" or (layout == "hybrid" and group == 0):
        return {}
    return {
        "group_idx": group,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": WINDOW,
    }


def groups_of(layout: str) -> list[int]:
    return [0, 1] if layout == "hybrid" else [0]


def make_stream(n_blocks: int, seed: int, layout: str, per_batch: int = 64) -> list[bytes]:
    """Encoded batches storing ``n_blocks`` blocks per group in chains of 4 batches, with
    removals of older blocks; sliding groups also drop what left their window."""
    rng = random.Random(seed)
    base = [rng.randrange(32000) for _ in range(per_batch * BS)]
    win = -(-(WINDOW - 1) // BS)
    out, h, prev = [], 1, None
    for j in range(n_blocks // per_batch):
        toks = list(base)
        toks[0], toks[1] = j, seed
        parent = prev if j % 4 else None
        hashes = list(range(h, h + per_batch))
        events: list = []
        for g in groups_of(layout):
            kw = group_kw(g, layout)
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=toks,
                    block_size=BS,
                    medium="GPU",
                    **kw,
                )
            )
            if kw:  # sliding: the blocks before the window are freed
                events.append(
                    BlockRemoved(block_hashes=hashes[: per_batch - win], medium="GPU", group_idx=g)
                )
        if j % 4 == 3 and j >= 8:
            old = h - 6 * per_batch
            for g in groups_of(layout):
                gone = list(range(old, old + 16))
                if group_kw(g, layout):  # only the window's blocks are left in that group
                    gone = [x for x in gone if x >= old + per_batch - win]
                if gone:
                    events.append(BlockRemoved(block_hashes=gone, medium="GPU", group_idx=g))
        prev = h + per_batch - 1
        h += per_batch
        out.append(encode_batch(events))
    return out


def count_block_events(payloads: list[bytes]) -> int:
    return sum(len(e.block_hashes) for p in payloads for e in decode_batch(p).events)


def ingest_once(mod: ModuleType, payloads: list[bytes]) -> tuple[float, float]:
    idx = mod.KVIndex()
    gc.collect()
    t0, c0 = time.perf_counter(), time.thread_time()
    for p in payloads:
        idx.apply_events("e", decode_batch(p).events)
    return time.perf_counter() - t0, time.thread_time() - c0


def build_scoring_index(mod: ModuleType, layout: str, total: int, prompt: list[int]):
    idx = mod.KVIndex()
    per = total // 16
    rng = random.Random(1)
    filler = [rng.randrange(32000) for _ in range(64 * BS)]
    win = -(-(WINDOW - 1) // BS)
    h = 1
    for e in range(16):
        name = f"ep{e}"
        m = min(128 * (e + 1), len(prompt) // BS)
        chunks = [(s, min(64, m - s), prompt[s * BS : (s + min(64, m - s)) * BS], s > 0)
                  for s in range(0, m, 64)]  # fmt: skip
        left, j = per - m, 0
        while left > 0:
            toks = filler[: min(64, left) * BS]
            toks[0], toks[1] = j, e
            chunks.append((m + (per - m - left), min(64, left), toks, False))
            left -= min(64, left)
            j += 1
        for s, cnt, toks, chained in chunks:
            hashes = list(range(h + s, h + s + cnt))
            events = []
            for g in groups_of(layout):
                kw = group_kw(g, layout)
                events.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=(h + s - 1) if chained else None,
                        token_ids=toks,
                        block_size=BS,
                        medium="GPU",
                        **kw,
                    )
                )
            idx.apply_events(name, events)
        if layout != "full":  # sliding groups keep the window at the end of the prefix only
            g = groups_of(layout)[-1]
            idx.apply_events(name, [BlockRemoved(block_hashes=list(range(h, h + m - win)),
                                                 medium="GPU", group_idx=g)])  # fmt: skip
        h += per
    return idx


def add_shared_tier(idx, prompt: list[int], names: list[str], blocks: int = 512) -> None:
    """A shared file-system tier holding the prompt's first ``blocks`` blocks (the full group,
    the sliding group's window at their end), every endpoint a member: the exact path."""
    shared = {"medium": "STORAGE", "tier": "fs:/bench", "shared": True, "locality": "LOCAL"}
    win = -(-(WINDOW - 1) // BS)
    hashes = list(range(10**9, 10**9 + blocks))
    events = [
        BlockStored(block_hashes=hashes, parent_block_hash=None,
                    token_ids=prompt[: blocks * BS], block_size=BS, **shared),
        BlockStored(block_hashes=hashes[-win:], parent_block_hash=hashes[-win - 1],
                    token_ids=prompt[(blocks - win) * BS : blocks * BS], block_size=BS,
                    **group_kw(1, "hybrid"), **shared),
    ]  # fmt: skip
    idx.apply_events(names[0], events)
    for n in names:
        idx.add_tier_member(n, "fs:/bench")


def time_match(idx, names: list[str], keys: list[int], reps: int) -> tuple[list[float], dict]:
    out, got = [], {}
    for _ in range(reps):
        t0 = time.perf_counter()
        got = idx.match_endpoints(names, lambda bs: keys)
        out.append((time.perf_counter() - t0) * 1e3)
    return out, got


def bytes_per_block(mod: ModuleType, layout: str, n: int) -> float:
    payloads = make_stream(n, seed=7, layout=layout)
    decoded = [decode_batch(p).events for p in payloads]
    gc.collect()
    tracemalloc.start()
    idx = mod.KVIndex()
    for events in decoded:
        idx.apply_events("e", events)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size / idx.num_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-rev", default=DEFAULT_BASE)
    ap.add_argument("--ingest-blocks", type=int, default=300_000)
    ap.add_argument("--index-blocks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--mem-blocks", type=int, default=100_000)
    ap.add_argument("--out", default=str(RESULTS / "router_index_groups"))
    args = ap.parse_args()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "src/kvserve/cluster/kv_index.py"], cwd=ROOT
    ).returncode
    if dirty:
        head += "+uncommitted kv_index.py"
    base = load_base(args.base_rev)
    variants = {"base": base, "current": current}
    t_start = time.time()
    load_start = os.getloadavg()[0]

    # 1. Ingestion, interleaved.
    streams = {lay: make_stream(args.ingest_blocks, 0, lay) for lay in ("full", "hybrid")}
    n_events = {lay: count_block_events(p) for lay, p in streams.items()}
    ingest: dict[str, list[float]] = {"base": [], "current": [], "current_hybrid": []}
    for r in range(args.rounds):
        order = ["base", "current"] if r % 2 == 0 else ["current", "base"]
        for v in order:
            ingest[v].append(ingest_once(variants[v], streams["full"])[1])
        ingest["current_hybrid"].append(ingest_once(current, streams["hybrid"])[1])
    rate = {
        v: (n_events["hybrid" if v.endswith("hybrid") else "full"] / statistics.median(c))
        for v, c in ingest.items()
    }
    print("ingest events/s (CPU):", json.dumps({k: round(v) for k, v in rate.items()}))
    del streams
    gc.collect()

    # 2-3. Scoring.
    rng = random.Random(2)
    prompt = [rng.randrange(32000) for _ in range(32768)]
    keys = prompt_block_keys(prompt, BS)
    names = [f"ep{e}" for e in range(16)]
    indexes = {
        "base": build_scoring_index(base, "full", args.index_blocks, prompt),
        "current": build_scoring_index(current, "full", args.index_blocks, prompt),
    }
    match_ms: dict[str, list[float]] = {"base": [], "current": []}
    results: dict[str, dict] = {}
    for r in range(args.rounds):
        for v in ["base", "current"] if r % 2 == 0 else ["current", "base"]:
            ms, got = time_match(indexes[v], names, keys, args.reps)
            match_ms[v] += ms
            results[v] = got
    assert results["base"] == results["current"], "current and base disagree on legacy events"
    del indexes
    gc.collect()
    hybrid_ms: dict[str, list[float]] = {}
    hits: dict[str, list[int]] = {}
    for lay in ("hybrid", "hybrid_tier", "sliding"):
        idx = build_scoring_index(current, lay.removesuffix("_tier"), args.index_blocks, prompt)
        if lay == "hybrid_tier":
            add_shared_tier(idx, prompt, names)
        ms: list[float] = []
        for _ in range(args.rounds):
            m, got = time_match(idx, names, keys, args.reps)
            ms += m
        hybrid_ms[lay] = ms
        hits[lay] = [got[n][0] for n in names]
        del idx
        gc.collect()
    p50 = {k: statistics.median(v) for k, v in {**match_ms, **hybrid_ms}.items()}
    print("match p50 ms:", json.dumps({k: round(v, 3) for k, v in p50.items()}))

    # 4. Memory.
    mem = {
        "base": bytes_per_block(base, "full", args.mem_blocks),
        "current": bytes_per_block(current, "full", args.mem_blocks),
        "current_hybrid": bytes_per_block(current, "hybrid", args.mem_blocks),
    }
    print("bytes per block:", json.dumps({k: round(v) for k, v in mem.items()}))

    machine = describe_machine()
    record = {
        "benchmark": "router_index_groups",
        "base_rev": args.base_rev,
        "head_rev": head,
        "machine": machine,
        "loadavg_start_end": [load_start, os.getloadavg()[0]],
        "args": vars(args),
        "ingest_block_events": n_events,
        "ingest_cpu_s": ingest,
        "ingest_events_per_s_cpu": rate,
        "match_ms": {**match_ms, **hybrid_ms},
        "match_ms_p50": p50,
        "hybrid_hits": hits,
        "bytes_per_block": mem,
        "wall_s": time.time() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    ing_ratio = rate["current"] / rate["base"]
    match_ratio = p50["current"] / p50["base"]
    md = f"""# Router KV index with KV cache groups (issue 15)

`flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/bench_router_index_groups.py` \
({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, {record["wall_s"]:.0f} s). Base revision
`{args.base_rev[:10]}` (the index before KV groups), current `{record["head_rev"][:10]}`, loaded
side by side in one process and run interleaved ({args.rounds} rounds, order alternating).

## Machine
{machine_markdown(machine)}- Load average (1 min) at the start: {load_start:.2f}

## Full-attention events (vLLM's non-hybrid models, older publishers): current vs base
| measurement | base | current | current / base |
| --- | ---: | ---: | ---: |
| ingestion, block events/s per core (median of {args.rounds}, {n_events["full"]:,} events) | \
{rate["base"]:,.0f} | {rate["current"]:,.0f} | {ing_ratio:.3f} |
| match, 32k-token prompt x 16 endpoints, {args.index_blocks:,} blocks, p50 ms \
({args.rounds * args.reps} reps) | {p50["base"]:.3f} | {p50["current"]:.3f} | {match_ratio:.3f} |
| index memory, bytes per block (tracemalloc, {args.mem_blocks:,} blocks) | \
{mem["base"]:.0f} | {mem["current"]:.0f} | {mem["current"] / mem["base"]:.3f} |

Both revisions return the same matches for every endpoint (checked).

## KV groups (current only)
| layout | ingestion events/s per core | match p50 ms (same prompt, same shape) | \
bytes per block |
| --- | ---: | ---: | ---: |
| full attention only | {rate["current"]:,.0f} | {p50["current"]:.3f} | {mem["current"]:.0f} |
| Gemma-3-like: group 0 full, group 1 sliding (W={WINDOW}, window kept) | \
{rate["current_hybrid"]:,.0f} | {p50["hybrid"]:.3f} | {mem["current_hybrid"]:.0f} |
| the same, every endpoint a member of a shared tier holding the first 512 blocks | - | \
{p50["hybrid_tier"]:.3f} | - |
| sliding only (Mistral-style, W={WINDOW}, window kept) | - | {p50["sliding"]:.3f} | - |

Hybrid endpoints with a full-attention group (shared-tier members too) are matched in the
one pass over the prompt that serves every endpoint, then only their windows are probed;
sliding-only models are bounded by one backward pass, then matched one endpoint at a time.
Ingestion of the hybrid stream counts every group's block events (stores and removals:
{n_events["hybrid"]:,} for the same {args.ingest_blocks:,} blocks). Hits per endpoint, hybrid:
{hits["hybrid"][:3]}...{hits["hybrid"][-2:]}; sliding only: {hits["sliding"][:3]}...\
{hits["sliding"][-2:]} (endpoint 15 holds the whole prompt but only the window at its
end, 2,048 blocks: the 2,047-block hit needs block 2,015, which left the window, so its hit
falls back to nothing there - the rule, as the engine applies it). Memory per block is the
index's share per distinct block per endpoint: a second group adds no entry, only its bits.
"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
