"""``--plot out.png``: latency distributions, and throughput against concurrency when a
sweep ran."""

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
    return f"concurrency {run['max_concurrency']}" if run.get("max_concurrency") else \
        run.get("label", "all requests")


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


def _draw_sweep(ax_throughput, ax_latency, runs: list[dict]) -> None:
    concurrency = [run["max_concurrency"] for run in runs]
    summaries = [run["summary"] for run in runs]
    ax_throughput.plot(concurrency, [s["output_throughput"] for s in summaries], "o-",
                       label="output tok/s")
    ax_throughput.plot(concurrency, [s["total_token_throughput"] for s in summaries], "s--",
                       label="total tok/s")
    ax_throughput.set_title("throughput vs. concurrency")
    ax_throughput.set_xlabel("max concurrency (requests in flight)")
    ax_throughput.set_ylabel("tokens per second")
    ax_throughput.legend(fontsize="small")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        ax_latency.plot(concurrency, [s[key]["median"] for s in summaries], "o-",
                        label=f"median {name}")
    ax_latency.set_title("latency vs. concurrency")
    ax_latency.set_xlabel("max concurrency (requests in flight)")
    ax_latency.set_ylabel("milliseconds")
    ax_latency.legend(fontsize="small")
    for ax in (ax_throughput, ax_latency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.grid(alpha=0.3)


def build_figure(runs: list[dict], title: str):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    is_sweep = len(runs) > 1 and all(run.get("max_concurrency") for run in runs)
    num_rows = 3 if is_sweep else 2
    fig, axes = plt.subplots(num_rows, 2, figsize=(12, 4 * num_rows), squeeze=False)
    _draw_latencies(axes[:2].ravel(), runs)
    if is_sweep:
        _draw_sweep(axes[2][0], axes[2][1], runs)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(runs: list[dict], path: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(runs, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
