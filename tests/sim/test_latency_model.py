"""The latency model's arithmetic and the step shapes the sim runner derives."""

from __future__ import annotations

import pytest

from kvserve.engine.outputs import SchedulerOutput
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.sim.latency_model import (
    PRESETS,
    LatencyModel,
    StepShape,
    get_preset,
    prefill_chunk_attn,
)
from kvserve.sim.runner import step_shape

M = LatencyModel(
    fixed=0.005,
    prefill_per_token=1e-4,
    prefill_attn_per_ctx=1e-8,
    decode_per_seq=1e-3,
    decode_per_ctx=1e-6,
    kv_bytes_per_token=1000,
    cpu_bandwidth=1e9,
    transfer_latency=1e-4,
)


def test_step_time_is_the_documented_sum():
    shape = StepShape(prefill_tokens=100, prefill_attn=5000.0, decode_seqs=3, decode_ctx=600)
    expected = 0.005 + 100 * 1e-4 + 5000 * 1e-8 + 3 * 1e-3 + 600 * 1e-6
    assert M.step_time(shape) == pytest.approx(expected)
    assert M.step_time(StepShape()) == 0.0


def test_prefill_attention_counts_each_token_against_its_context():
    # Tokens 10..13 attend to 11, 12, 13, 14 positions: 50 in total.
    assert prefill_chunk_attn(10, 4) == pytest.approx(11 + 12 + 13 + 14)
    assert prefill_chunk_attn(0, 1) == 1
    # A cached prefix shrinks the prefill but its context still costs attention.
    cold, warm = M.prefill_time(1000), M.prefill_time(1000, num_cached=900)
    assert warm < cold
    assert warm == pytest.approx(0.005 + 100 * 1e-4 + prefill_chunk_attn(900, 100) * 1e-8)


def test_decode_and_transfer_times():
    assert M.decode_step_time(4, 1000) == pytest.approx(0.005 + 4e-3 + 4000e-6)
    assert M.transfer_time(0) == 0.0
    assert M.transfer_time(2_000_000) == pytest.approx(1e-4 + 2e-3)
    assert M.block_bytes(16) == 16_000
    assert M.replace(cpu_bandwidth=0).transfer_time(10**9) == pytest.approx(1e-4)


def test_presets_are_sourced_and_plausible():
    assert set(PRESETS) >= {"h100-llama8b", "cpu-tiny"}
    h100 = get_preset("h100-llama8b")
    assert h100.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, bf16
    # Published ranges: prefill 10-20k tok/s for 8B on H100; ITL 10-20 ms at moderate batch.
    assert 10_000 <= 4096 / h100.prefill_time(4096) <= 20_000
    assert 0.010 <= h100.decode_step_time(32, 4096) <= 0.020
    assert h100.transfer_time(1 << 30) == pytest.approx((1 << 30) / 50e9, rel=0.01)
    for m in PRESETS.values():
        assert m.source
    with pytest.raises(ValueError, match="unknown latency preset"):
        get_preset("a100-nope")


def _req(rid: str, prompt_len: int, computed: int, outputs: int = 0) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), block_size=16)
    for i in range(outputs):
        r.append_output_token(100 + i)
    r.num_computed_tokens = computed
    return r


def test_step_shape_separates_prefill_chunks_from_decodes():
    decode = _req("d", 40, computed=41, outputs=2)  # 42 tokens, computing the last one
    chunk = _req("c", 100, computed=32)  # second chunk of a prefill
    last_token = _req("h", 64, computed=63)  # a full prefix hit: one prompt token left
    so = SchedulerOutput(
        scheduled=[decode, chunk, last_token],
        num_scheduled_tokens={"d": 1, "c": 50, "h": 1},
        total_num_scheduled_tokens=52,
    )
    shape = step_shape(so)
    assert shape.decode_seqs == 1 and shape.decode_ctx == 42
    assert shape.prefill_tokens == 51
    assert shape.prefill_attn == pytest.approx(
        prefill_chunk_attn(32, 50) + prefill_chunk_attn(63, 1)
    )
