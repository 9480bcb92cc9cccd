"""CPU sampling draw: the per-row torch.multinomial loop the CPU worker uses vs a vectorized
counter-based draw (a splitmix64-style hash of (seed, token) -> uniform, then an exponential race),
32 rows x 49,152 tokens, two threads. A measurement for a follow-up, not code the worker runs.

    .venv/bin/python -m benchmarks.cpu_sampling_draw
"""

import time

import torch

torch.set_num_threads(2)
rows, vocab = 32, 49152
probs = torch.softmax(torch.randn(rows, vocab) * 3, -1)
gens = [torch.Generator().manual_seed(i) for i in range(rows)]
def loop():
    out = torch.empty(rows, dtype=torch.long)
    for i in range(rows):
        gens[i].manual_seed(i * 1_000_003 + 5)
        out[i] = torch.multinomial(probs[i], 1, generator=gens[i])[0]
    return out
seeds = torch.arange(rows, dtype=torch.int64)[:, None] * 1_000_003 + 5
ids = torch.arange(vocab, dtype=torch.int64)[None, :]
M = (1 << 53) - 1  # 53 random bits per uniform
def vectorized():  # splitmix64-style hash of (seed, token) -> uniform, then an exponential race
    x = seeds * 0x9E3779B97F4A7C15 + ids
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    u = ((x & M).double() + 0.5) / (M + 1)
    return (probs.double() / -torch.log(u)).argmax(-1)
for name, fn in (("loop", loop), ("vectorized", vectorized)):
    fn(); t = time.perf_counter()
    for _ in range(20): fn()
    print(name, round((time.perf_counter() - t) / 20 * 1e3, 2), "ms")
