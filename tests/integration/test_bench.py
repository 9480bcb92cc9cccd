"""``flotilla bench`` against the live stack: exact token counts, sane timings, both
throughput figures and their ratio, and a clear error for a wrong model."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from cli.main import main

pytestmark = pytest.mark.integration

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 12, 24, 8


def test_bench_serve_gives_exact_counts_and_sane_timings(stack, tmp_path, capsys):
    result, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(["bench", "serve", "--base-url", stack.base_url, "--num-prompts", str(NUM_PROMPTS),
                 "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
                 "--max-concurrency", "6", "--slo", "ttft=120000,tpot=120000", "--disable-tqdm",
                 "--result-json", str(result), "--plot", str(plot)])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(result.read_text())
    assert data["settings"]["flags"]["ignore_eos"] is True
    assert data["settings"]["model"] == "SmolLM2-135M-Instruct"
    run = data["runs"][0]
    summary = run["summary"]
    assert (summary["completed"], summary["failed"]) == (NUM_PROMPTS, 0)
    assert summary["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert summary["good_requests"] == NUM_PROMPTS
    for request in run["requests"]:
        assert (request["num_prompt_tokens"], request["num_output_tokens"]) == (INPUT_LEN, OUTPUT_LEN)
        assert 0 < request["chunk_times_s"][0] < request["e2e_s"]  # TTFT < E2E
        assert request["chunk_times_s"] == sorted(request["chunk_times_s"])
        assert all(gap >= 0 for gap in request["itl_s"])
    assert 0 < summary["ttft_ms"]["median"] < summary["e2e_ms"]["median"]
    with Image.open(plot) as image:
        assert image.format == "PNG"


def test_bench_throughput_prints_flotilla_hf_and_their_ratio(stack, tmp_path, capsys):
    result = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--backend", "flotilla,hf", "--base-url", stack.base_url,
                 "--num-prompts", "8", "--input-len", "16", "--output-len", str(OUTPUT_LEN),
                 "--hf-batch-size", "8", "--disable-tqdm", "--result-json", str(result)])
    assert code == 0
    out = capsys.readouterr().out
    assert "HF generate (batch 8)" in out and "ratio flotilla/hf (output tok/s)" in out
    data = json.loads(result.read_text())
    flotilla, hf = (r["summary"] for r in data["results"])
    assert flotilla["total_output_tokens"] == hf["total_output_tokens"] == 8 * OUTPUT_LEN
    assert flotilla["total_input_tokens"] == hf["total_input_tokens"] == 8 * 16
    assert data["output_throughput_ratios"]["flotilla/hf"] == pytest.approx(
        flotilla["output_throughput"] / hf["output_throughput"])


def test_bench_latency_times_fixed_batches(stack, tmp_path):
    result = tmp_path / "latency.json"
    code = main(["bench", "latency", "--base-url", stack.base_url, "--batch-size", "2",
                 "--input-len", "16", "--output-len", "4", "--num-iters", "2",
                 "--num-iters-warmup", "0", "--disable-tqdm", "--result-json", str(result)])
    assert code == 0
    data = json.loads(result.read_text())
    assert len(data["iterations"]["iteration_s"]) == 2 and data["num_short_outputs"] == 0
    assert data["summary"]["completed"] == 4 and data["summary"]["total_output_tokens"] == 16
    assert data["iterations"]["p50_s"] >= data["summary"]["e2e_ms"]["min"] / 1000


def test_a_wrong_model_name_stops_at_the_warm_up(stack, capsys):
    code = main(["bench", "serve", "--base-url", stack.base_url, "--model", "no-such-model",
                 "--tokenizer", "smollm2", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--disable-tqdm"])
    assert code == 1
    assert "warm-up request failed: HTTP 404" in capsys.readouterr().err
