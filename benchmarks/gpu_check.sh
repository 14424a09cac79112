#!/usr/bin/env bash
# The GPU check, in one script of under 10 minutes (issue 16): on a machine with an NVIDIA GPU,
#   1. a virtualenv with CUDA torch (the system's, when it already sees the GPU; else from PyPI)
#      and kvserve; FlashInfer when it can be installed (else the torch attention backend);
#   2. HF-exactness on CUDA: fp32 greedy tokens and logits of the tiny Llama / Qwen2 / Qwen3 /
#      Mistral presets vs transformers fp32 (on the CPU, the tests' oracle), and bf16 vs
#      transformers bf16 on the GPU (top-1 and logits within the bound of tests/engine/test_bf16);
#      then the model and bf16 tests themselves on CUDA;
#   3. the offloading benchmark's four measurements (P1 overhead, P2 hit-rate curve, P3 load
#      bandwidth, P4 TTFT) on the small preset, CUDA pool with the pinned host tier;
#   4. the throughput benchmark (kvserve HTTP, bf16) and the roofline benchmark on the GPU.
# Everything goes to benchmarks/results/gpu/ (or $GPU_OUT); each step has its own time limit and
# a failed step is recorded and does not stop the others. Offline boxes: put wheels in $WHEELS
# (pip download of kvserve's dependencies) and they are installed from there.
#
#   bash benchmarks/gpu_check.sh    # at most 585 s of step limits (setup 150 s of them)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_OUT:-benchmarks/results/gpu}
VENV=${GPU_VENV:-.venv-gpu}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
echo "# GPU check $(date -u +%FT%TZ)" >"$SUMMARY"
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, record status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "- $name: $([ $rc = 0 ] && echo ok || echo "FAILED (rc $rc)") in $((SECONDS - t0)) s" \
        | tee -a "$SUMMARY"
    return 0
}

# -- 1. environment ------------------------------------------------------------------------
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >>"$SUMMARY"
PIP_SRC=()
[ -n "${WHEELS:-}" ] && PIP_SRC=(--no-index --find-links "$WHEELS")
setup() {
    if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        python3 -m venv --system-site-packages "$VENV"  # reuse the system's CUDA torch
    else
        python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "${PIP_SRC[@]}" torch
    fi
    "$VENV/bin/pip" install -q "${PIP_SRC[@]}" -e ".[test]" || return 1
    "$VENV/bin/pip" install -q "${PIP_SRC[@]}" flashinfer-python \
        || echo "flashinfer not installed: the torch attention backend serves"
    "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(); \
print(torch.__version__, torch.cuda.get_device_name())"
}
step setup 150 setup
PY="$VENV/bin/python"
export PYTHONUNBUFFERED=1

# -- 2. HF-exactness on CUDA ------------------------------------------------------------------
step parity 90 "$PY" - "$OUT/parity.json" <<'EOF'
import json, sys, tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model.presets import make_model

PROMPTS = ["The river runs past the old mill, and", "Alice",
           "In Kyoto, the engine reads each request and splits the prompt into blocks"]
N = 24
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
tmp = Path(tempfile.mkdtemp())
for arch in ["llama", "qwen2", "qwen3", "mistral"]:
    d = make_model(tmp / arch, "tiny", arch=arch)
    r = {}
    for dtype, hf_dev in [("float32", "cpu"), ("bfloat16", "cuda")]:
        tdt = getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=tdt).to(hf_dev).eval()
        llm = LLM(str(d), device="cuda", dtype=dtype, num_kv_blocks=256)
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        got = [o.outputs[0].token_ids for o in llm.generate(
            ids, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))]
        want = []
        for p in ids:
            x = torch.tensor([p], device=hf_dev)
            with torch.no_grad():
                g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(g[0, len(p):].tolist())
        # tokens before the first difference (after one, greedy streams part ways)
        same = sum(next((i for i, (a, b) in enumerate(zip(ga, gb)) if a != b), len(gb))
                   for ga, gb in zip(got, want))
        backend = llm.engine.runner.attn_backend
        r[dtype] = {
            "greedy_equal": got == want,
            "tokens_before_first_difference": f"{same}/{sum(map(len, want))}",
            "attention_backend": getattr(backend, "name", "?"),
            "backend_disabled": getattr(backend, "disabled_reason", None),
        }
        del llm, hf
        torch.cuda.empty_cache()
    out["models"][arch] = r
    print(arch, r, flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=2))
ok = all(m["float32"]["greedy_equal"] for m in out["models"].values())
sys.exit(0 if ok else 1)
EOF
step tests 90 "$PY" -m pytest tests/engine/test_bf16.py tests/model tests/engine/test_model_runner.py -q

# -- 3. offloading benchmarks (P1-P4) ----------------------------------------------------------
# (bench_offload writes under benchmarks/results/: gpu/offload_small.{md,json,png})
step offload 120 "$PY" benchmarks/bench_offload.py --preset small --reps 2 --out gpu/offload_small

# -- 4. throughput and roofline ---------------------------------------------------------------
step throughput 90 "$PY" benchmarks/bench_throughput.py --dtype bfloat16 --skip-offline \
    --num-prompts 64 --input-len 512 --output-len 128 --no-progress --out "$OUT" \
    --stem throughput_gpu
step roofline 45 "$PY" benchmarks/bench_roofline.py --device cuda --dtypes bfloat16,float32 \
    --prompt-len 2048 --context 2048 --peak-sizes 4096,8192 --bandwidth-mib 4096 \
    --out "$OUT/roofline"
cat "$SUMMARY"
