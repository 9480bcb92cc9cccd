"""CUDA graphs for decode-only steps.

At start-up the model's forward is captured once per batch-size bucket with every input in a
static buffer; a decode step then copies its inputs into those buffers and replays the bucket
that fits, so a step costs one graph launch instead of a few hundred kernel launches. Rows past
the real batch are padding: slot -1 (the cache write skips it), context length 1 over block 0,
and their logits are dropped. Mixed steps (any prompt chunk) run eagerly.

Every bucket writes its logits into one static buffer: an output kept alive per graph would stay
in the shared pool, and at 1,024 sequences with a 128k vocabulary those outputs alone came to
~17 GiB (the KV cache had been sized without them, so capture ran out of memory).
"""

from __future__ import annotations

import structlog
import torch

from services.worker.model import AttentionMetadata, Transformer

log = structlog.get_logger()


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16: padding wastes at most ~25%."""
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    buckets += list(range(8, min(64, max_batch_size) + 1, 8))
    buckets += list(range(80, max_batch_size + 1, 16))
    if not buckets or buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return buckets


class DecodeGraphs:
    def __init__(self, model: Transformer, max_batch_size: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch_size)
        self.max_model_len = max_model_len
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)  # [size]
        self.positions = torch.zeros(size, dtype=torch.long, device=device)  # [size]
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)  # [size]
        # [size, max_blocks_per_seq]
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)  # [size]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(size, dtype=torch.long, device=device)
        # [size, vocab_size] fp32: every bucket's logits (rows past its batch are padding)
        self.logits = torch.empty(size, model.config.vocab_size, dtype=torch.float32,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            logits_indices=self.logits_indices[:batch_size],
            max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture every bucket (or just ``buckets``), largest first: the others reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        for batch_size in sorted(buckets or self.buckets, reverse=True):
            args = (self.input_ids[:batch_size], self.positions[:batch_size],
                    self._metadata(batch_size))
            self.model(*args)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:batch_size].copy_(self.model(*args))
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        log.info("cuda_graphs_captured", buckets=sorted(self.graphs))

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """One decode step (one token per sequence) -> logits [num_seqs, vocab_size]."""
        num_seqs = input_ids.shape[0]
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None and metadata.max_query_len == 1
        width = metadata.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        if bucket > num_seqs:  # padding rows: write nowhere, attend to one cached slot
            self.slot_mapping[num_seqs:bucket].fill_(-1)
            self.seq_lens[num_seqs:bucket].fill_(1)
            self.block_tables[num_seqs:bucket, 0].fill_(0)
        self.graphs[bucket].replay()
        return self.logits[:num_seqs]
