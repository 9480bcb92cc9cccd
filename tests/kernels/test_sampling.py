"""sample_tokens (torch filters + Triton Gumbel-max draw) against the references.

Under the interpreter every program costs milliseconds, so the CPU run checks the kernel draw for
draw against a numpy emulation of its Philox + Gumbel-max arithmetic, and checks the emulation's
statistics over thousands of draws; the GPU run also checks the kernel's own statistics.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.sampling as sampling_module
from kernels.sampling import (_filter_top_k_top_p, greedy_token_ids, sample_tokens,
                              sample_tokens_ref, sampling_probs_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LOGITS_8 = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]
CASES = {  # (temperature, top_k, top_p)
    "plain": (1.0, 0, 1.0),
    "temperature": (0.6, 0, 1.0),
    "top_k": (1.2, 4, 1.0),
    "top_p": (0.9, 0, 0.75),
    "top_k_top_p": (1.5, 6, 0.85),
}


def params(num_rows: int, temperature=1.0, top_k=0, top_p=1.0, seed=0, offsets=None,
           device=DEVICE):
    """Per-row parameter tensors: scalars are repeated, sequences taken as they are."""
    def column(value, dtype):
        if isinstance(value, (int, float)):
            return torch.full((num_rows,), value, dtype=dtype, device=device)
        return torch.as_tensor(value, dtype=dtype, device=device)
    offsets = torch.arange(num_rows, device=device) if offsets is None else column(offsets,
                                                                                   torch.int64)
    return (column(temperature, torch.float32), column(top_k, torch.int32),
            column(top_p, torch.float32), column(seed, torch.int64), offsets)


def random_params(num_rows: int, vocab_size: int, gen: torch.Generator, device=DEVICE):
    """A mixed batch: some greedy rows, some filtered, seeds of both signs, large offsets."""
    temperatures = torch.rand(num_rows, generator=gen) * 1.5 + 0.2
    temperatures[::5] = 0.0
    top_ks = torch.randint(0, vocab_size + 3, (num_rows,), generator=gen, dtype=torch.int32)
    top_ks[1::2] = 0
    top_ps = torch.rand(num_rows, generator=gen) * 0.8 + 0.2
    top_ps[::3] = 1.0
    seeds = torch.randint(-2**62, 2**62, (num_rows,), generator=gen)
    offsets = torch.randint(0, 2**40, (num_rows,), generator=gen)
    return tuple(t.to(device) for t in (temperatures, top_ks, top_ps, seeds, offsets))


# ---- a numpy emulation of the kernel's draw: Philox4x32-10 keyed by the seed, counter
# (token id, offset low word, offset high word, 0), u from 23 bits, Gumbel-max over logits / T

MASK = np.uint64(0xFFFFFFFF)


def philox_first_word(seeds: np.ndarray, c0, c1, c2, c3) -> np.ndarray:
    """seeds: [num_rows, 1] uint64; counters: uint64 arrays of 32-bit words broadcast to
    [num_rows, vocab_size] -> the first output word of each."""
    c0, c1, c2, c3 = (np.broadcast_to(c, np.broadcast_shapes(c0.shape, c1.shape)).astype(np.uint64)
                      for c in (c0, c1, c2, c3))
    k0, k1 = seeds & MASK, seeds >> np.uint64(32)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        product_a, product_b = round_a * c0, round_b * c2  # exact: 32 x 32 bits fit in 64
        c0, c1, c2, c3 = ((product_b >> np.uint64(32)) ^ c1 ^ k0, product_b & MASK,
                          (product_a >> np.uint64(32)) ^ c3 ^ k1, product_a & MASK)
        k0 = (k0 + np.uint64(0x9E3779B9)) & MASK
        k1 = (k1 + np.uint64(0xBB67AE85)) & MASK
    return c0


def emulated_tokens(logits: torch.Tensor, temperatures, top_ks, top_ps, seeds, offsets
                    ) -> np.ndarray:
    """The tokens sample_tokens must return, filtered by sampling_probs_ref's support."""
    support = sampling_probs_ref(logits, temperatures, top_ks, top_ps).cpu().numpy() > 0
    logits = logits.float().cpu().numpy()
    num_rows, vocab_size = logits.shape
    as_words = np.array([int(s) % 2**64 for s in seeds.tolist()], dtype=np.uint64)[:, None]
    offsets = np.array([int(o) % 2**64 for o in offsets.tolist()], dtype=np.uint64)[:, None]
    ids = np.arange(vocab_size, dtype=np.uint64)[None, :]
    bits = philox_first_word(as_words, ids, offsets & MASK, offsets >> np.uint64(32),
                             np.zeros((1, 1), dtype=np.uint64))
    uniform = ((bits >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2**-23)
    gumbel = -np.log(-np.log(uniform))
    temperatures = temperatures.float().cpu().numpy()[:, None]
    greedy = temperatures == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = np.where(greedy, logits, np.where(support, logits, -np.inf)
                          / np.where(greedy, np.float32(1), temperatures) + gumbel)
    return scores.argmax(axis=1)


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.cpu().double()).abs().sum().item()


# ---- exact cases

def test_greedy_rows_are_argmax(monkeypatch):
    monkeypatch.setattr(sampling_module, "SPLIT_SIZE", 256)  # 4 splits of 2 blocks
    monkeypatch.setattr(sampling_module, "BLOCK_SIZE", 128)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 1000, generator=gen).to(DEVICE)
    logits[3, 900] = logits[3, 100] = 50.0  # a tie across splits: the lower id, as argmax
    logits[4, 300] = logits[4, 301] = 50.0  # a tie inside a block
    temperatures, top_ks, top_ps, seeds, offsets = random_params(7, 1000, gen)
    temperatures.zero_()
    tokens = sample_tokens(logits, temperatures, top_ks, top_ps, seeds, offsets)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[3] == 100 and tokens[4] == 300
    half = logits.to(torch.bfloat16)
    assert torch.equal(sample_tokens(half, temperatures, top_ks, top_ps, seeds, offsets),
                       half.argmax(dim=-1))


def test_greedy_token_ids_are_argmax(monkeypatch):
    monkeypatch.setattr(sampling_module, "SPLIT_SIZE", 256)  # 4 splits of 2 blocks
    monkeypatch.setattr(sampling_module, "BLOCK_SIZE", 128)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=gen).to(DEVICE)
    logits[1, 900] = logits[1, 100] = 50.0  # a tie across splits: the lower id, as argmax
    logits[2, 300] = logits[2, 301] = 50.0  # a tie inside a block
    logits[3] = float("-inf")  # nothing allowed: the first id, as argmax
    logits[4, 999] = 60.0  # the last id, in the last (partial) split
    tokens = greedy_token_ids(logits)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens.tolist()[1:5] == [100, 300, 0, 999]
    half = logits.to(torch.bfloat16)
    assert torch.equal(greedy_token_ids(half), half.argmax(dim=-1))
    out = torch.full((6, 2), -1, dtype=torch.int64, device=DEVICE)[:, 0]  # not contiguous
    assert greedy_token_ids(logits, out=out) is out
    assert torch.equal(out, logits.argmax(dim=-1))
    assert greedy_token_ids(logits[:0]).shape == (0,)
    with pytest.raises(ValueError, match="vocab dim contiguous"):
        greedy_token_ids(logits.t())


def test_top_k_one_is_argmax_at_any_temperature():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen).to(DEVICE)
    temperatures, _, top_ps, seeds, offsets = random_params(5, 300, gen)
    temperatures = torch.tensor([0.3, 0.7, 1.0, 1.5, 4.0], device=DEVICE)
    top_ks = torch.ones(5, dtype=torch.int32, device=DEVICE)
    tokens = sample_tokens(logits, temperatures, top_ks, top_ps, seeds, offsets)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 200, generator=gen).to(DEVICE)
    temperatures, top_ks, top_ps, seeds, offsets = params(9, temperature=[0.0, 1.0] * 4 + [0.0])
    out = torch.full((9,), -1, dtype=torch.int64, device=DEVICE)
    assert sample_tokens(logits, temperatures, top_ks, top_ps, seeds, offsets, out=out) is out
    assert torch.equal(out[::2], logits[::2].argmax(dim=-1))
    assert ((out >= 0) & (out < 200)).all()


def test_kernel_matches_the_philox_emulation(monkeypatch):
    monkeypatch.setattr(sampling_module, "SPLIT_SIZE", 32)  # 2 splits
    monkeypatch.setattr(sampling_module, "BLOCK_SIZE", 32)
    gen = torch.Generator().manual_seed(3)
    num_rows, vocab_size = 64, 40
    logits = (2.0 * torch.randn(num_rows, vocab_size, generator=gen)).to(DEVICE)
    row_params = random_params(num_rows, vocab_size, gen)
    tokens = sample_tokens(logits, *row_params)
    expected = emulated_tokens(logits, *row_params)
    assert (tokens.cpu().numpy() == expected).mean() >= 0.99  # a float near-tie may flip one


# ---- seeds, offsets and batch independence

@pytest.mark.parametrize("offset", [0, 3, 2**33 + 5])
def test_seeded_row_is_independent_of_its_batch(offset):
    gen = torch.Generator().manual_seed(4)
    vocab_size = 300
    row = torch.randn(vocab_size, generator=gen).to(DEVICE)
    row_params = (1.1, 50, 0.9, 1234, offset)
    alone = sample_tokens(row[None], *params(1, *row_params[:4], offsets=[offset]))
    logits = torch.randn(16, vocab_size, generator=gen).to(DEVICE)
    logits[9] = row
    batch_params = [t.clone() for t in random_params(16, vocab_size, gen)]
    for column, value in zip(batch_params, row_params):
        column[9] = value
    in_batch = sample_tokens(logits, *batch_params)
    assert in_batch[9] == alone[0]


def test_tokens_do_not_depend_on_the_vocab_split(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 300, generator=gen).to(DEVICE)
    row_params = random_params(8, 300, gen)
    one_split = sample_tokens(logits, *row_params)
    monkeypatch.setattr(sampling_module, "SPLIT_SIZE", 64)  # 5 splits of 2 blocks
    monkeypatch.setattr(sampling_module, "BLOCK_SIZE", 32)
    assert torch.equal(sample_tokens(logits, *row_params), one_split)


def test_seeds_give_distinct_reproducible_streams():
    gen = torch.Generator().manual_seed(6)
    num_draws = 24
    logits = (0.1 * torch.randn(64, generator=gen)).to(DEVICE).expand(num_draws, 64)
    streams = {seed: sample_tokens(logits, *params(num_draws, seed=seed)) for seed in (1, 2)}
    assert (streams[1] == streams[2]).sum() < num_draws // 2
    assert torch.equal(sample_tokens(logits, *params(num_draws, seed=1)), streams[1])
    assert len(set(streams[1].tolist())) > 8  # the offsets move the stream


# ---- distributions

@pytest.mark.parametrize("case", CASES)
def test_emulated_draws_follow_the_filtered_softmax(case):
    """The kernel's arithmetic, emulated over 4,000 offsets, samples the filtered softmax."""
    num_draws = 4000
    logits = torch.tensor(LOGITS_8).expand(num_draws, 8)
    row_params = params(num_draws, *CASES[case], seed=77, device="cpu")
    probs = sampling_probs_ref(logits[:1], *(t[:1] for t in row_params[:3]))[0]
    tokens = torch.from_numpy(emulated_tokens(logits, *row_params))
    assert total_variation(tokens, probs) < 0.05
    assert (probs[tokens] > 0).all()  # no filtered token, ever


KERNEL_CASES = list(CASES) if DEVICE == "cuda" else ["top_k_top_p"]  # the interpreter is slow


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_draws_follow_the_filtered_softmax(case):
    num_draws, bound = (4000, 0.05) if DEVICE == "cuda" else (400, 0.12)
    logits = torch.tensor(LOGITS_8, device=DEVICE).expand(num_draws, 8)
    row_params = params(num_draws, *CASES[case], seed=78)
    probs = sampling_probs_ref(logits[:1], *(t[:1] for t in row_params[:3]))[0]
    tokens = sample_tokens(logits, *row_params)
    assert total_variation(tokens, probs) < bound
    assert (probs[tokens] > 0).all()


def test_ref_draws_follow_the_filtered_softmax():
    num_draws = 4000
    logits = torch.tensor(LOGITS_8).expand(num_draws, 8)
    row_params = params(num_draws, *CASES["top_k_top_p"], seed=79, device="cpu")
    probs = sampling_probs_ref(logits[:1], *(t[:1] for t in row_params[:3]))[0]
    tokens = sample_tokens_ref(logits, *row_params)
    assert total_variation(tokens, probs) < 0.05
    assert (probs[tokens] > 0).all()
    assert torch.equal(sample_tokens_ref(logits[:5], *(t[:5] for t in row_params)), tokens[:5])


def test_probs_ref_by_hand():
    logits = torch.tensor([LOGITS_8])
    softmax = torch.softmax(torch.tensor(LOGITS_8) / 0.9, dim=0)
    # sorted: ids 0 (2.0), 6 (1.5), 1 (1.0), 2 (0.5), 7 (0.2), ...
    probs = sampling_probs_ref(logits, *params(1, 0.9, 0, 0.75, device="cpu")[:3])[0]
    kept = [0, 6, 1]  # mass before id 1 is p0 + p6 < 0.75; before id 2 it is >= 0.75
    assert softmax[[0, 6]].sum() < 0.75 <= softmax[kept].sum()
    torch.testing.assert_close(probs[kept], softmax[kept] / softmax[kept].sum())
    assert probs.sum().item() == pytest.approx(1.0) and (probs > 0).sum() == 3
    top_k = sampling_probs_ref(logits, *params(1, 1.0, 2, 1.0, device="cpu")[:3])[0]
    assert (top_k > 0).nonzero().flatten().tolist() == [0, 6]


def test_filter_keeps_exactly_the_ref_support():
    gen = torch.Generator().manual_seed(8)
    logits = (2.0 * torch.randn(32, 500, generator=gen)).to(DEVICE)
    logits[0, :10] = 20.0  # ties at the top-k boundary: the lowest ids stay
    temperatures, top_ks, top_ps, _, _ = random_params(32, 500, gen)
    top_ks[0], top_ps[0], temperatures[0] = 4, 1.0, 1.0
    filtered = _filter_top_k_top_p(logits, temperatures, top_ks, top_ps)
    support = sampling_probs_ref(logits, temperatures, top_ks, top_ps) > 0
    sampled_rows = temperatures > 0
    assert torch.equal(filtered.isfinite()[sampled_rows], support[sampled_rows])
    assert torch.equal(filtered[filtered.isfinite()], logits[filtered.isfinite()])
    assert filtered[0].isfinite().nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_filters_never_pick_a_filtered_token():
    gen = torch.Generator().manual_seed(9)
    logits = (3.0 * torch.randn(24, 500, generator=gen)).to(DEVICE)
    temperatures, top_ks, top_ps, seeds, offsets = random_params(24, 500, gen)
    top_ks[::2] = torch.randint(2, 20, (12,), generator=gen, dtype=torch.int32).to(DEVICE)
    top_ps[1::2] = 0.6
    temperatures[temperatures == 0] = 2.0  # hot rows spread over many candidates
    probs = sampling_probs_ref(logits, temperatures, top_ks, top_ps)
    tokens = sample_tokens(logits, temperatures, top_ks, top_ps, seeds, offsets)
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_apply_filters_false_changes_nothing_without_filters():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(6, 100, generator=gen).to(DEVICE)
    row_params = params(6, temperature=[0.0, 0.5, 1.0, 1.0, 2.0, 0.8], top_k=[0, 0, 0, 100, 0, 0],
                        seed=[1, 2, 3, 4, 5, 6])
    assert torch.equal(sample_tokens(logits, *row_params),
                       sample_tokens(logits, *row_params, apply_filters=False))


# ---- real sizes on the GPU

VOCAB = 128256


def hot_logits(num_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows, VOCAB] rows, all the same: 8 hot tokens (LOGITS_8 + 20) among random ones
    (which then hold ~3e-5 of the mass at temperature 1)."""
    row = torch.randn(VOCAB, generator=gen, device="cuda")
    hot = torch.randperm(VOCAB, generator=gen, device="cuda")[:8]
    row[hot] = torch.tensor(LOGITS_8, device="cuda") + 20.0
    return row.expand(num_rows, VOCAB), hot


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_exact_rows(dtype):
    gen = torch.Generator(device="cuda").manual_seed(11)
    logits = (4.0 * torch.randn(64, VOCAB, generator=gen, device="cuda")).to(dtype)
    temperatures, top_ks, top_ps, seeds, offsets = random_params(64, VOCAB, torch.Generator(),
                                                                 device="cuda")
    greedy = sample_tokens(logits, torch.zeros_like(temperatures), top_ks, top_ps, seeds, offsets)
    assert torch.equal(greedy, logits.argmax(dim=-1))
    top_1 = sample_tokens(logits, temperatures + 0.5, torch.ones_like(top_ks), top_ps, seeds,
                          offsets)
    assert torch.equal(top_1, logits.argmax(dim=-1))
    tokens = sample_tokens(logits, temperatures, top_ks, top_ps, seeds, offsets)
    for row in (1, 2, 33):  # alone == in the batch
        alone = sample_tokens(logits[row:row + 1], temperatures[row:row + 1], top_ks[row:row + 1],
                              top_ps[row:row + 1], seeds[row:row + 1], offsets[row:row + 1])
        assert alone[0] == tokens[row]
    matches = tokens.cpu().numpy() == emulated_tokens(logits, temperatures, top_ks, top_ps, seeds,
                                                      offsets)
    assert matches.mean() >= 0.95  # GPU log and division are approximate: a near-tie may flip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_greedy_token_ids_at_a_128k_vocab(dtype):
    gen = torch.Generator(device="cuda").manual_seed(14)
    logits = (4.0 * torch.randn(64, 128256, generator=gen, device="cuda")).to(dtype)
    logits[5, 128255] = logits[5, 7] = 100.0  # a tie across the first and last splits
    for rows in (1, 3, 64):
        assert torch.equal(greedy_token_ids(logits[:rows]), logits[:rows].argmax(dim=-1))
    assert greedy_token_ids(logits)[5] == 7
    static = logits[:4].clone()
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    greedy_token_ids(static, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy_token_ids(static, out=out)
    static.copy_(logits[10:14])
    graph.replay()
    assert torch.equal(out, logits[10:14].argmax(dim=-1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["plain", "top_k", "top_p", "top_k_top_p"])
def test_gpu_full_vocab_distribution(case):
    gen = torch.Generator(device="cuda").manual_seed(12)
    num_draws = 4000
    logits, _ = hot_logits(1, gen)
    temperature, top_k, top_p = CASES[case]
    probs = sampling_probs_ref(logits, *params(1, temperature, top_k, top_p, device="cuda")[:3])[0]
    tokens = torch.cat([
        sample_tokens(logits.expand(1000, VOCAB),
                      *params(1000, temperature, top_k, top_p, seed=5,
                              offsets=torch.arange(start, start + 1000)))
        for start in range(0, num_draws, 1000)])
    assert total_variation(tokens, probs) < 0.05
    assert (probs[tokens] > 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("apply_filters", [False, True])
def test_gpu_cuda_graph_capture(apply_filters):
    """No host sync: the whole call captures into a CUDA graph and replays with new inputs."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    logits = 4.0 * torch.randn(8, VOCAB, generator=gen, device="cuda")
    row_params = params(8, temperature=[0.0, 1.0, 0.7, 1.3] * 2,
                        top_k=[0, 0, 40, 0] * 2 if apply_filters else 0,
                        top_p=[1.0, 0.9, 1.0, 0.8] * 2 if apply_filters else 1.0,
                        seed=list(range(8)), device="cuda")
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile the kernel outside the capture
        sample_tokens(logits, *row_params, apply_filters=apply_filters, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_tokens(logits, *row_params, apply_filters=apply_filters, out=out)
    for step in range(3):
        logits.copy_(4.0 * torch.randn(8, VOCAB, generator=gen, device="cuda"))
        row_params[4].add_(1)  # offsets: the next draw
        graph.replay()
        expected = sample_tokens(logits, *row_params, apply_filters=apply_filters)
        assert torch.equal(out, expected), step
