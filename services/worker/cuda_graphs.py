"""CUDA graphs: whole decode steps, and mixed steps piece by piece.

``DecodeGraphs``: at start-up the model's forward is captured once per batch-size bucket with
every input in a static buffer; a decode step then copies its inputs into those buffers and
replays the bucket that fits, so a step costs one graph launch instead of a few hundred kernel
launches. Rows past the real batch are padding: slot -1 (the cache write skips it), context
length 1 over block 0, and their logits are dropped.

The same class with ``query_len`` K + 1 holds speculative decoding's verify steps whole: every
sequence its last token and K drafts, every token's logits wanted. The attention then takes the
chunk kernel's tile for K + 1 queries, its split chosen for max_model_len like a decode graph's
(segment bounds come from each sequence's real length on the device). Without it a verify step
ran as piecewise graphs, about 1.5 decode steps of time at batch 1 on an H200.

``PiecewiseGraphs``: a step with prompt chunks (any mix of query lengths) up to
``max_num_tokens`` tokens. Its attention depends on host-side bounds (longest query, number of
decodes, context length) that pick the kernels' tiles and grids, so attention runs eagerly on
the real rows; everything between two attentions (o_proj, norms, MLP, the next layer's qkv,
rotary and KV write) is one graph per token-count bucket: num_layers + 1 replays and
num_layers attention launches a step instead of ~10 launches a layer. Padding rows write to
slot -1 and are never read by attention or the logits.

With LoRA on CUDA (lora_slots.py) both classes capture each bucket twice: as above, and with
the adapters' deltas (``lora_capture``: the kernels read the step's adapter rows from a static
buffer); a step with adapter rows replays the second, any other the first. The two share the
bucket's pool and static buffers.

Every bucket writes its logits into one static buffer: an output kept alive per graph would stay
in the shared pool, and at 1,024 sequences with a 128k vocabulary those outputs alone came to
~17 GiB (the KV cache had been sized without them, so capture ran out of memory).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import structlog
import torch

from kernels.sampling import greedy_token_ids
from kernels.step_inputs import fill_graph_inputs, fill_pending_tokens
from services.worker.config import WorkerConfig
from services.worker.model import AttentionMetadata, Transformer, sparse_rows, wait_events

log = structlog.get_logger()

LoraCapture = Callable[[], AbstractContextManager] | None  # (lora_slots.py: graph_capture)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Collect garbage now, and none until the captures are done. An object collected in the
    middle of a capture can make CUDA calls that invalidate it (freeing a pinned tensor used
    on another stream records an event there), and torch no longer collects before one. Seen
    in GPU tests only: test_runner_gpu's captures failed with cudaErrorStreamCaptureInvalidated
    after test_draft_model_gpu's engines died in the same process, now and then; with this
    guard that order passed twice in a row on an H200 (session 21)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def smallest_bucket(buckets: list[int], size: int) -> int | None:
    """The smallest of the ascending ``buckets`` that holds ``size`` (None: none does)."""
    return next((bucket for bucket in buckets if bucket >= size), None)


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16: padding wastes at most ~25%."""
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    buckets += list(range(8, min(64, max_batch_size) + 1, 8))
    buckets += list(range(80, max_batch_size + 1, 16))
    if not buckets or buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return buckets


class DecodeGraphs:
    """``query_len`` > 1: steps whose every sequence has that many queries, each with its
    logits (speculative decoding's verify steps: a token and its drafts)."""

    def __init__(self, model: Transformer, max_batch_size: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device, query_len: int = 1,
                 lora_capture: LoraCapture = None) -> None:
        self.model, self.lora_capture = model, lora_capture
        self.buckets = batch_buckets(max_batch_size)
        self.max_model_len = max_model_len
        self.query_len = query_len
        size = self.buckets[-1]
        num_tokens = size * query_len
        self.input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long, device=device)
        # [size, max_blocks_per_seq]
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        # [size]: padding sequences attend to their own query_len slots of block 0
        self.seq_lens = torch.full((size,), query_len, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32,
                                            device=device)  # [size + 1]
        self.logits_indices = torch.arange(num_tokens, dtype=torch.long, device=device)
        # [num_tokens, vocab_size] fp32: every bucket's logits (rows past its batch: padding)
        self.logits = torch.empty(num_tokens, model.config.vocab_size, dtype=torch.float32,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # (with the deltas)

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        num_tokens = batch_size * self.query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            logits_indices=self.logits_indices[:num_tokens],
            max_query_len=self.query_len, max_seq_len=self.max_model_len, all_logits=True)

    @torch.inference_mode()
    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture every bucket (or just ``buckets``), largest first: the others reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        with collector_paused():
            for batch_size in sorted(buckets or self.buckets, reverse=True):
                self.graphs[batch_size] = self._capture(batch_size, pool)
                if self.lora_capture is not None:
                    with self.lora_capture():
                        self.lora_graphs[batch_size] = self._capture(batch_size, pool)
        self._warm_up_step_launches()
        torch.cuda.synchronize()
        log.info("cuda_graphs_captured", buckets=sorted(self.graphs),
                 lora_buckets=sorted(self.lora_graphs))

    def _capture(self, batch_size: int, pool: tuple[int, int]) -> torch.cuda.CUDAGraph:
        """One bucket's graph, its kernels run once first, outside the capture."""
        num_tokens = batch_size * self.query_len
        args = (self.input_ids[:num_tokens], self.positions[:num_tokens],
                self._metadata(batch_size))
        # warm-up: Triton compiles and autotunes outside the capture
        self.model(*args, logits_out=self.logits[:num_tokens])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # the head writes the static logits
            self.model(*args, logits_out=self.logits[:num_tokens])
        return graph

    def _warm_up_step_launches(self) -> None:
        """Compile what runs around a replay now, not at the first step: the inputs' launch
        (with and without pending tokens; its own buffers copied onto themselves), the
        pending tokens' launch for other steps, and the greedy draw."""
        num_tokens = self.query_len
        step = (self.input_ids[:num_tokens], self.positions[:num_tokens],
                self.slot_mapping[:num_tokens], self.seq_lens[:1], self.block_tables[:1, :1])
        buffers = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                   self.block_tables)
        no_source = torch.full((num_tokens,), -1, dtype=torch.long, device=self.input_ids.device)
        for pending in (None, (no_source, self.input_ids[:1])):
            fill_graph_inputs(*step, buffers, 1, self.query_len, pending)
        fill_pending_tokens(self.input_ids[:num_tokens], no_source, self.input_ids[:1])
        greedy_token_ids(self.logits[:1])

    def bucket_for(self, batch_size: int) -> int | None:
        return smallest_bucket(self.buckets, batch_size)

    def runs(self, num_tokens: int, num_seqs: int, max_query_len: int, num_logits: int,
             lora: bool = False) -> bool:
        """Whether it runs a whole step of this shape: ``query_len`` tokens a sequence,
        every token's logits wanted (sampled or verified), a bucket holding the sequences;
        ``lora``: the step has adapter rows (graphs with the deltas needed)."""
        return (max_query_len == self.query_len
                and num_tokens == num_seqs * self.query_len == num_logits
                and self.bucket_for(num_seqs) is not None
                and (not lora or self.lora_capture is not None))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata,
            pending: tuple[torch.Tensor, torch.Tensor] | None = None, lora: bool = False
            ) -> torch.Tensor:
        """One step of query_len tokens per sequence -> logits [num_tokens, vocab_size].
        Its inputs reach the static buffers in one launch (kernels/step_inputs.py), padding
        rows writing nowhere and attending to cached slots of block 0; ``pending``: (source
        rows, the step in flight's tokens), put in place by the same launch."""
        num_tokens = input_ids.shape[0]
        num_seqs = num_tokens // self.query_len
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None and metadata.max_query_len == self.query_len
        fill_graph_inputs(input_ids, positions, metadata.slot_mapping, metadata.seq_lens,
                          metadata.block_tables.contiguous(),
                          (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                           self.block_tables), bucket, self.query_len, pending)
        (self.lora_graphs if lora else self.graphs)[bucket].replay()
        return self.logits[:num_tokens]


COMPUTE_BOUND_TOKENS = 256  # (8B on an H200: a step's GEMMs stop being weight-bound)


def token_buckets(max_num_tokens: int) -> list[int]:
    """Powers of two from 16 and the midpoints between them, then from COMPUTE_BOUND_TOKENS
    eight buckets an octave, up to ``max_num_tokens``.

    Small steps are bound by reading the weights, so padding them costs little; each bucket is
    num_layers + 1 graphs, so there are few of them. Past a few hundred tokens a step's GPU
    time grows with its tokens: padded to a midpoint, a 1,039-token step (40 decodes and a
    1,000-token chunk, 8B, H200) took 36.6 ms in the 1,536 bucket against 26.1 eagerly."""
    buckets, size = [], 16
    while size < max_num_tokens:
        step = size // 8 if size >= COMPUTE_BOUND_TOKENS else size // 2
        buckets += list(range(size, 2 * size, step))
        size *= 2
    buckets = [b for b in buckets if b < max_num_tokens]
    return buckets + [max_num_tokens] if max_num_tokens > 0 else []


class PiecewiseGraphs:
    """Steps of any query lengths: graphs between the attentions (see the module's text)."""

    def __init__(self, model: Transformer, max_num_tokens: int, device: torch.device,
                 use_graphs: bool = True, lora_capture: LoraCapture = None) -> None:
        """use_graphs False runs the same pieces uncaptured (tests: the CPU can check the
        static buffers and padding; the GPU, graphs against their own pieces)."""
        self.model, self.lora_capture = model, lora_capture
        self.buckets = token_buckets(max_num_tokens)
        self.use_graphs = use_graphs
        config, attn = model.config, model.layers[0].self_attn
        size = self.buckets[-1]
        dtype = model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)  # [size]
        self.positions = torch.zeros(size, dtype=torch.long, device=device)  # [size]
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)  # [size]
        # [size, num_heads, head_dim]: a layer's queries, then its attention output
        self.query = torch.zeros(size, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.attention_out = torch.zeros_like(self.query)
        # [size, hidden_size]: the last layer's output and the residual stream
        self.hidden = torch.zeros(size, config.hidden_size, dtype=dtype, device=device)
        self.residual = torch.zeros_like(self.hidden)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.lora_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # (with the deltas)
        self.num_steps = 0  # steps run

    def _pieces(self, num_tokens: int) -> list:
        """The num_layers + 1 pieces of a bucket: each reads and writes the static buffers."""
        model, layers = self.model, self.model.layers
        positions, slot_mapping = self.positions[:num_tokens], self.slot_mapping[:num_tokens]
        query, residual = self.query[:num_tokens], self.residual[:num_tokens]
        attention_out = self.attention_out[:num_tokens]

        def keep(new_query: torch.Tensor, new_residual: torch.Tensor) -> None:
            query.copy_(new_query)
            if new_residual.data_ptr() != residual.data_ptr():  # the norms add in place
                residual.copy_(new_residual)

        capture = model.hidden_capture  # (an EAGLE head's features: hidden_capture.py)

        def first() -> None:
            x = model.embed_tokens(self.input_ids[:num_tokens])  # [num_tokens, hidden_size]
            if 0 in capture.layer_ids:
                capture.take(0, x, slot_mapping)
            keep(*layers[0].before_attention(x, None, positions, model.cos_sin_cache,
                                             slot_mapping))

        def after(layer):  # padding rows of a sparse block route to no expert
            valid_rows = sparse_rows(slot_mapping) if layer.sparse else None
            return layer.after_attention(attention_out, residual, valid_rows=valid_rows)

        def between(index: int):
            def piece() -> None:  # layer index - 1 after its attention, layer index before
                x, new_residual = after(layers[index - 1])
                if index in capture.layer_ids:  # the stream entering layer index
                    capture.take(index, x + new_residual, slot_mapping)
                keep(*layers[index].before_attention(x, new_residual, positions,
                                                     model.cos_sin_cache, slot_mapping))
            return piece

        def last() -> None:
            x, new_residual = after(layers[-1])
            if capture.captures_final:
                capture.take_final(model.norm(x + new_residual), slot_mapping)
            self.hidden[:num_tokens].copy_(x)
            if new_residual.data_ptr() != residual.data_ptr():
                residual.copy_(new_residual)

        return [first] + [between(i) for i in range(1, len(layers))] + [last]

    @torch.inference_mode()
    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture every bucket (or just ``buckets``), largest first, into one pool: each
        piece's temporaries are freed by its end, so the buckets reuse the largest one's
        memory."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        with collector_paused():
            for num_tokens in sorted(buckets or self.buckets, reverse=True):
                self.graphs[num_tokens] = self._capture(num_tokens, pool)
                if self.lora_capture is not None:
                    with self.lora_capture():
                        self.lora_graphs[num_tokens] = self._capture(num_tokens, pool)
        torch.cuda.synchronize()
        log.info("piecewise_graphs_captured", buckets=sorted(self.graphs),
                 num_graphs=sum(len(g) for g in self.graphs.values()),
                 lora_buckets=sorted(self.lora_graphs))

    def _capture(self, num_tokens: int, pool: tuple[int, int]) -> list[torch.cuda.CUDAGraph]:
        pieces = self._pieces(num_tokens)
        for piece in pieces:  # warm-up: Triton compiles outside the capture
            piece()
        torch.cuda.synchronize()
        graphs = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                piece()
            graphs.append(graph)
        return graphs

    def bucket_for(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.buckets, num_tokens)

    def takes(self, num_tokens: int, lora: bool = False) -> bool:
        """Whether a step of ``num_tokens`` fits a bucket (``lora``: with adapter rows)."""
        return (self.bucket_for(num_tokens) is not None
                and (not lora or self.lora_capture is not None or not self.use_graphs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata,
            layer_waits: Sequence[Sequence[torch.cuda.Event]] | None = None,
            lora: bool = False) -> torch.Tensor:
        """One step of ``num_tokens`` <= the largest bucket -> logits [num_sampled, vocab_size].
        ``layer_waits``: per layer, events its attention waits for (between the pieces)."""
        num_tokens = input_ids.shape[0]
        bucket = self.bucket_for(num_tokens)
        assert bucket is not None
        self.num_steps += 1
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping)
        self.slot_mapping[num_tokens:bucket].fill_(-1)  # padding writes nowhere
        if self.use_graphs:
            graphs = (self.lora_graphs if lora else self.graphs)[bucket]
            pieces = [graph.replay for graph in graphs]
        else:
            pieces = self._pieces(bucket)
        query, attention_out = self.query[:num_tokens], self.attention_out[:num_tokens]
        for index, (layer, piece) in enumerate(zip(self.model.layers, pieces)):
            piece()
            if layer_waits is not None:
                wait_events(layer_waits[index])
            layer.self_attn.attend(query, metadata, out=attention_out)
        pieces[-1]()
        return self.model.logits(self.hidden[:num_tokens], self.residual[:num_tokens],
                                 metadata.logits_indices)


MAX_VERIFY_GRAPH_TOKENS = 256  # larger verify steps (many drafted requests) run piecewise


def verify_graphs(model: Transformer, max_num_seqs: int, num_speculative_tokens: int,
                  block_size: int, max_model_len: int, device: torch.device) -> DecodeGraphs:
    """Graphs of verify steps: K + 1 queries a sequence (K: num_speculative_tokens), at most
    MAX_VERIFY_GRAPH_TOKENS tokens (the worker's and the memory profile's, alike)."""
    query_len = num_speculative_tokens + 1
    return DecodeGraphs(model, min(max_num_seqs, MAX_VERIFY_GRAPH_TOKENS // query_len),
                        -(-max_model_len // block_size), max_model_len, device,
                        query_len=query_len)


def mixed_graph_tokens(config: WorkerConfig) -> int:
    """The largest step the piecewise graphs take: no larger than a step can be."""
    return min(config.max_graph_tokens, config.max_num_batched_tokens)


def capture_step_graphs(model: Transformer, config: WorkerConfig, max_model_len: int,
                        device: torch.device, lora_capture: LoraCapture = None
                        ) -> tuple[DecodeGraphs, DecodeGraphs | None, PiecewiseGraphs | None]:
    """The worker's graphs, captured: decode steps, verify steps (None without
    speculative decoding) and steps in pieces (None: max_graph_tokens 0); decode and
    piecewise ones with LoRA's deltas too where ``lora_capture`` (verify steps with adapter
    rows run piecewise)."""
    decode = DecodeGraphs(model, config.max_num_seqs, -(-max_model_len // config.block_size),
                          max_model_len, device, lora_capture=lora_capture)
    decode.capture()
    mixed = None
    if mixed_graph_tokens(config):
        mixed = PiecewiseGraphs(model, mixed_graph_tokens(config), device,
                                lora_capture=lora_capture)
        mixed.capture()
    verify = None
    if config.num_speculative_tokens:
        verify = verify_graphs(model, config.max_num_seqs, config.num_speculative_tokens,
                               config.block_size, max_model_len, device)
        verify.capture()
    return decode, verify, mixed
