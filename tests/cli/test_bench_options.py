"""Flag values, tables, the result JSON and the plot."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from PIL import Image

from cli.bench import options, report
from cli.bench.metrics import RequestRecord, summarize
from cli.bench.hf import useful_tokens
from cli.bench.plot import build_figure, plot_runs
from cli.bench.throughput import output_ratios, parse_backends
from cli.main import build_parser


@pytest.mark.parametrize("text, expected", [
    ("ttft=500,tpot=50", {"ttft": 0.5, "tpot": 0.05}),
    ("ttft=0.2s, e2el=1500ms", {"ttft": 0.2, "e2e": 1.5}),
    ("TPOT=12.5", {"tpot": 0.0125})])
def test_parse_slo(text, expected):
    assert options.parse_slo(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["ttft", "latency=5", "ttft=fast", "tpot=-1", ""])
def test_bad_slo_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        options.parse_slo(text)


def test_goodput_in_vllms_form_adds_to_the_slo():
    args = build_parser().parse_args(["bench", "serve", "--slo", "e2e=9000",
                                      "--goodput", "ttft:2000", "itl:100", "e2el:5000"])
    assert args.slo == pytest.approx({"ttft": 2.0, "itl": 0.1, "e2e": 5.0})
    assert build_parser().parse_args(["bench", "serve"]).slo is None
    for bad in ("ttft=2000", "stall:5", "itl:-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            options.parse_goodput_item(bad)


def test_a_sweep_varies_the_rate_or_the_concurrency_not_both():
    from cli.bench.serve import load_points

    args = build_parser().parse_args(["bench", "serve", "--request-rate", "5,10,inf",
                                      "--max-concurrency", "64"])
    assert load_points(args) == [(5.0, 64), (10.0, 64), (math.inf, 64)]
    args = build_parser().parse_args(["bench", "serve", "--max-concurrency", "1,4"])
    assert load_points(args) == [(math.inf, 1), (math.inf, 4)]
    both = build_parser().parse_args(["bench", "serve", "--request-rate", "5,10",
                                      "--max-concurrency", "1,4"])
    with pytest.raises(SystemExit, match="not both"):
        load_points(both)


def test_rates_lists_and_backends():
    assert options.parse_rate("inf") == math.inf and options.parse_rate("2.5") == 2.5
    assert options.parse_rate_list("5, 10,inf") == [5.0, 10.0, math.inf]
    assert options.parse_int_list("1,2, 8") == [1, 2, 8]
    assert parse_backends("flotilla,hf") == ["flotilla", "hf"]
    for bad in (lambda: options.parse_int_list("1,0"), lambda: parse_backends("vllm"),
                lambda: options.parse_rate("0"), lambda: options.parse_rate_list("5,x")):
        with pytest.raises(argparse.ArgumentTypeError):
            bad()


def test_the_command_line_parses():
    args = build_parser().parse_args(
        ["bench", "serve", "--num-prompts", "20", "--max-concurrency", "1,4", "--ignore-eos",
         "--slo", "ttft=100", "--request-rate", "inf"])
    assert (args.num_prompts, args.max_concurrency, args.ignore_eos) == (20, [1, 4], True)
    assert args.slo == {"ttft": 0.1} and args.base_url == "http://127.0.0.1:8000"
    throughput = build_parser().parse_args(["bench", "throughput", "--backend", "flotilla,hf"])
    assert throughput.ignore_eos is True and throughput.base_url is None
    serve = build_parser().parse_args(["serve", "--port", "9000"])  # `flotilla serve` too
    assert serve.port == "9000" and serve.host is None  # (None: the knob's default)


def test_useful_tokens_of_a_static_batch_row():
    assert useful_tokens([5, 6, 2, 9, 9], output_len=4, eos_id=2, ignore_eos=False) == 3
    assert useful_tokens([5, 6, 2, 9, 9], output_len=4, eos_id=2, ignore_eos=True) == 4
    assert useful_tokens([5, 6], output_len=4, eos_id=2, ignore_eos=True) == 2


def test_ratio_of_output_throughputs():
    results = [{"backend": "flotilla", "summary": {"output_throughput": 150.0}},
               {"backend": "hf", "summary": {"output_throughput": 100.0}}]
    assert output_ratios(results) == {"flotilla/hf": 1.5}


def sample_runs() -> list[dict]:
    runs = []
    for concurrency, step in ((1, 0.01), (4, 0.03)):
        records = [RequestRecord(prompt_len=8, output_len=4, e2e_s=0.1 + 3 * step + i * 0.01,
                                 chunk_times_s=[0.1 + i * 0.01 + k * step for k in range(4)],
                                 num_output_tokens=4) for i in range(6)]
        runs.append({"max_concurrency": concurrency, "summary": summarize(records, 1.0),
                     "requests": [report.record_dict(r) for r in records]})
    return runs


def test_table_and_json_hold_the_figures(tmp_path):
    runs = sample_runs()
    table = report.serve_table(runs[0]["summary"])
    assert "Successful requests:" in table and "24.00" in table  # output tok/s
    assert "concurrency" not in table
    assert "     4" in report.sweep_table(runs)
    path = tmp_path / "result.json"
    report.write_json(str(path), {"rate": math.inf, "runs": runs, "nan": math.nan})
    data = json.loads(path.read_text())
    assert data["rate"] == "inf" and data["nan"] is None
    assert data["runs"][0]["requests"][0]["itl_s"] == pytest.approx([0.01, 0.01, 0.01])


def test_plot_draws_labelled_axes(tmp_path):
    runs = sample_runs()
    figure = build_figure(runs, "a sweep")
    assert len(figure.axes) == 6  # 4 latency histograms + throughput and latency vs concurrency
    for ax in figure.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    assert "max concurrency" in figure.axes[4].get_xlabel()
    assert len(build_figure(runs[:1], "one run").axes) == 4
    path = tmp_path / "out.png"
    plot_runs(runs, str(path), "a sweep")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 600


def test_settings_record_the_flags_but_not_the_api_key(monkeypatch):
    monkeypatch.setattr("sys.argv", ["flotilla", "bench", "serve", "--api-key", "sk-secret"])
    args = build_parser().parse_args(["bench", "serve", "--api-key", "sk-secret", "--seed", "3"])
    settings = report.settings_of(args, model="m")
    assert settings["flags"]["api_key"] == "<set>" and settings["flags"]["seed"] == 3
    assert "sk-secret" not in json.dumps(settings, default=str)
    assert settings["command"] == ["flotilla", "bench", "serve", "--api-key", "<set>"]
    assert settings["model"] == "m" and settings["date"].startswith("20")
