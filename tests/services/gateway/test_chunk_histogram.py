"""The per-chunk histograms (ChunkHistogram) expose what prometheus_client's Histogram
would for the same observations: buckets (le: at most the bound), count and sum."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.gateway.metrics import ChunkHistogram

BOUNDS = (0.001, 0.01, 0.1, 1.0)


def exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith("x_seconds_") and "_created" not in line]


def test_buckets_count_and_sum_equal_the_librarys():
    library, cheap = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", buckets=BOUNDS, registry=library)
    chunks = ChunkHistogram("x_seconds", "doc", BOUNDS, cheap)
    for value in (0.0005, 0.001, 0.005, 0.01, 0.5, 3.0, 0.1, 1.0, 0.0):
        reference.observe(value)
        chunks.observe(value)
    lines = exposition(cheap)
    assert lines == exposition(library)
    assert 'x_seconds_bucket{le="0.001"} 3.0' in lines and "x_seconds_count 9.0" in lines
