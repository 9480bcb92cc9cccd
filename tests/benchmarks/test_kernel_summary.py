"""The kernel summary reads a PyTorch profiler trace (flotilla's or vLLM's) into per-step
milliseconds by kind."""

import gzip
import json

import pytest

from benchmarks.gpu.kernel_summary import kind_of, load_events, summarize


def trace_events() -> list[dict]:
    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    return [kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 0, 600),
            kernel("_paged_attention_kernel", 600, 200),
            kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 800, 100),
            kernel("_add_rms_norm_kernel", 900, 40),
            kernel("Memcpy DtoH (Device -> Pinned)", 940, 10, cat="gpu_memcpy"),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0}]


def test_kinds_of_kernels_of_both_engines():
    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert kind_of("_all_reduce_add_rms_norm_kernel") == "communication"
    assert kind_of("void flash::FlashAttnFwdSm90<...>") == "attention"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kind_of("_skinny_gemm_kernel") == "gemm"
    assert kind_of("_add_rms_norm_kernel") == "norm"
    assert kind_of("elementwise_kernel<...>") == "other"


@pytest.mark.parametrize("gzipped", [False, True])
def test_gpu_time_per_step_by_kind(tmp_path, gzipped):
    path = tmp_path / ("trace.json.gz" if gzipped else "trace.json")
    text = json.dumps({"traceEvents": trace_events()})
    if gzipped:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    events = load_events(path)
    assert len(events) == 5  # GPU activity only: no CPU ops, no instant events
    summary = summarize(events, num_steps=2)
    assert summary["busy_ms_per_step"] == pytest.approx(0.475)
    assert summary["span_ms_per_step"] == pytest.approx(0.475)
    assert summary["kinds_ms_per_step"] == {"gemm": 0.3, "attention": 0.1, "communication": 0.05,
                                            "norm": 0.02, "other": 0.005}
    assert summary["kernels"][0] == {"name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
                                     "kind": "gemm", "calls": 1, "ms_per_step": 0.3}

