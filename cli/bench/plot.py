"""``--plot out.png``: latency distributions, and throughput, goodput and latency against
the request rate or concurrency when a sweep ran."""

from __future__ import annotations

from dataclasses import fields

from cli.bench.metrics import RequestRecord, latency_samples_ms

_RECORD_FIELDS = [f.name for f in fields(RequestRecord)]
_LATENCY_PANELS = ("TTFT", "TPOT", "ITL", "E2E")
_LABELS = {"TTFT": "time to first token", "TPOT": "time per output token",
           "ITL": "inter-token latency", "E2E": "end-to-end latency"}


def records_of(run: dict) -> list[RequestRecord]:
    return [RequestRecord(**{name: r[name] for name in _RECORD_FIELDS if name in r})
            for r in run["requests"]]


def run_label(run: dict) -> str:
    if run.get("label"):
        return run["label"]
    return f"concurrency {run['max_concurrency']}" if run.get("max_concurrency") else \
        "all requests"


def _bins(values: list[float], num_bins: int = 30) -> list[float]:
    """Bin edges; values that are (nearly) all equal get one bin around them, which
    matplotlib's own binning refuses."""
    low, high = min(values), max(values)
    if high - low <= 1e-6 * max(abs(high), 1.0):
        return [low - 0.5, high + 0.5]
    return [low + (high - low) * i / num_bins for i in range(num_bins + 1)]


def _draw_latencies(axes, runs: list[dict]) -> None:
    from matplotlib.ticker import MaxNLocator

    samples = [(run_label(run), latency_samples_ms(records_of(run))) for run in runs]
    for ax, name in zip(axes, _LATENCY_PANELS):
        for label, by_metric in samples:
            if by_metric[name]:
                ax.hist(by_metric[name], bins=_bins(by_metric[name]), histtype="step",
                        linewidth=1.5, label=label)
        ax.set_title(f"{name}: {_LABELS[name]}")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("ITL samples" if name == "ITL" else "requests")
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
        if len(samples) > 1:
            ax.legend(fontsize="small")


def sweep_axis(runs: list[dict]) -> tuple[str, list[str]] | None:
    """What a sweep varied and each run's value (as tick labels); None: not a sweep."""
    if len(runs) < 2:
        return None
    if len({run.get("request_rate") for run in runs}) > 1:
        return "request rate (requests per second, Poisson)", \
            [f"{run['request_rate']:g}" for run in runs]
    if all(run.get("max_concurrency") for run in runs):
        return "max concurrency (requests in flight)", [str(run["max_concurrency"]) for run in runs]
    return None


def _draw_sweep(ax_throughput, ax_latency, runs: list[dict], axis: tuple[str, list[str]]
                ) -> None:
    name, ticks = axis
    points = list(range(len(runs)))  # evenly spaced, labelled (a rate may be inf)
    summaries = [run["summary"] for run in runs]
    ax_throughput.plot(points, [s["output_throughput"] for s in summaries], "o-",
                       label="output tok/s")
    ax_throughput.plot(points, [s["total_token_throughput"] for s in summaries], "s--",
                       label="total tok/s")
    ax_throughput.set_ylabel("tokens per second")
    ax_throughput.legend(fontsize="small", loc="upper left")
    if "goodput" in summaries[0]:
        ax_goodput = ax_throughput.twinx()
        ax_goodput.plot(points, [s["goodput"] for s in summaries], "^:", color="tab:green",
                        label="goodput (req/s)")
        ax_goodput.set_ylabel("requests per second within the SLOs")
        ax_goodput.legend(fontsize="small", loc="lower right")
    ax_throughput.set_title("throughput and goodput")
    for label, key, stat in (("median TTFT", "ttft_ms", "median"), ("p99 TTFT", "ttft_ms", "p99"),
                             ("median TPOT", "tpot_ms", "median"),
                             ("p99 stall (longest chunk gap)", "longest_chunk_gap_ms", "p99")):
        ax_latency.plot(points, [s[key][stat] for s in summaries], "o-", label=label)
    ax_latency.set_title("latency")
    ax_latency.set_ylabel("milliseconds")
    ax_latency.set_yscale("log")
    ax_latency.legend(fontsize="small")
    for ax in (ax_throughput, ax_latency):
        ax.set_xlabel(name)
        ax.set_xticks(points, ticks)
        ax.grid(alpha=0.3)


def build_figure(runs: list[dict], title: str):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    axis = sweep_axis(runs)
    num_rows = 3 if axis else 2
    fig, axes = plt.subplots(num_rows, 2, figsize=(12, 4 * num_rows), squeeze=False)
    _draw_latencies(axes[:2].ravel(), runs)
    if axis:
        _draw_sweep(axes[2][0], axes[2][1], runs, axis)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(runs: list[dict], path: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(runs, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
