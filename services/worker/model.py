"""One decoder for the Llama family (Llama 2/3/3.1, SmolLM, Mistral, Qwen2/2.5, Qwen3) and its
Mixture-of-Experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache.

RMSNorm, rotary embedding (default, linear and Llama-3.1 "llama3" scaling), SwiGLU MLP or sparse
MoE block (moe.py), grouped-query attention, optionally tied embeddings; the families' switches
are on ``ModelConfig`` (model_config.py). Tokens of all sequences in a step are flattened into
one batch: ``input_ids [num_tokens]`` and ``positions [num_tokens]``; ``AttentionMetadata`` says which
sequence each token belongs to and where its keys and values live. q/k/v and gate/up projections (and
their biases) are fused so each is one matmul; ``weights.py`` loads them.

The compute ops (RMSNorm with the residual add fused, rotary with the KV write, the gate_up
projection with SiLU-and-mul, paged attention) come from ``services/worker/ops.py``: Triton kernels on CUDA, their torch
references on CPU. Each residual add is fused into the norm after it, and a layer ends with the
next layer's input norm: o_proj and down go through ``ops.linear_add_rms_norm``, which at decode
sizes can do the add and the norm in the projection's split-K reduce (``ops.norm_in_reduce``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.paged_attention import AttentionPlan
from kernels.rotary import build_cos_sin_cache
from services.worker import ops
from services.worker.cpu_attention import DecodeContext
from services.worker.hidden_capture import NO_CAPTURE, FeatureCapture, NoCapture
from services.worker.layers import MLP, Linear, RMSNorm, add_rms_norm
from services.worker.moe import SparseMoeBlock
from services.worker.model_config import ModelConfig, compute_inv_freq
from services.worker.tensor_parallel import TensorParallel, VocabParallelEmbedding

__all__ = ["AttentionMetadata", "ModelConfig", "Transformer", "compute_inv_freq"]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's tokens start
    logits_indices: torch.Tensor  # [num_sampled] int64: tokens whose logits are returned
    # Host-side bounds, so GPU kernels size their launch without reading the tensors back
    # (CUDA graphs pass the largest values they must serve).
    max_query_len: int = 0
    max_seq_len: int = 0
    num_decodes: int = 0  # the first num_decodes sequences have one query each
    # every token's logits, in order (logits_indices is all of them): no gather before the head
    all_logits: bool = False
    # [num_tokens] int64: the row of the step in flight whose sampled token is this token's
    # input, -1 for the rest (None: no such token; step_inputs.fill_pending_inputs)
    pending_source_rows: torch.Tensor | None = None
    # the step's attention launches, planned by its first layer (ops.attention); not copied
    # by dataclasses.replace, so metadata with other lengths never runs an old plan
    attention_plan: AttentionPlan | None = field(default=None, init=False, repr=False,
                                                 compare=False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale, self.batch_invariant = config.head_dim ** -0.5, config.batch_invariant
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               config.qkv_bias, config)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, config, tp)
        if config.qk_norm:  # Qwen3: one [head_dim] weight shared by all heads
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.value_cache: torch.Tensor | None = None
        # an FP8 cache holds keys / k_scale and values / v_scale (kv_quant.py sets them)
        self.k_scale, self.v_scale = 1.0, 1.0
        self.decode_context: DecodeContext | None = None  # CPU: the decode rows' context, kept

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> the rotated queries [num_tokens, num_heads, head_dim];
        the keys and values are written to the cache. Reads no host-side metadata, so a CUDA
        graph can hold it (``cuda_graphs.PiecewiseGraphs``)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k rotated in place; k and v written to the cache
        ops.rotary_and_write_kv_cache(q, k, v, positions, cos_sin_cache, self.key_cache,
                                      self.value_cache, slot_mapping, self.k_scale, self.v_scale)
        return q

    def attend(self, q: torch.Tensor, metadata: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] -> attention output, the same shape (into
        ``out`` when given)."""
        return ops.attention(q, self.key_cache, self.value_cache, metadata, self.scale,
                             self.decode_context, out=out, k_scale=self.k_scale,
                             v_scale=self.v_scale, batch_invariant=self.batch_invariant)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int = 0):
        """``index``: the layer's place in the model (which layers are sparse: MoeSpec)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sparse = config.moe is not None and index in config.moe.sparse_layers
        self.mlp = SparseMoeBlock(config, config.moe, tp) if self.sparse else MLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, metadata: AttentionMetadata, normed: bool = False,
                next_norm: RMSNorm | None = None, kv_ready: Sequence[torch.cuda.Event] = (),
                valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``before_attention``, attention (after ``kv_ready``), ``after_attention``: (x,
        residual) as they take and return them."""
        q, residual = self.before_attention(x, residual, positions, cos_sin_cache,
                                            metadata.slot_mapping, normed)
        if kv_ready:
            wait_events(kv_ready)
        return self.after_attention(self.self_attn.attend(q, metadata), residual, next_norm,
                                    valid_rows)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, normed: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input minus the residual stream so far (the whole input when
        residual is None), or with ``normed`` this layer's input norm of the stream (the
        previous layer's ``after_attention`` applied it) -> (queries [num_tokens, num_heads,
        head_dim], the residual stream)."""
        if normed:
            h = x
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.self_attn.project(h, positions, cos_sin_cache, slot_mapping), residual

    def after_attention(self, attention_out: torch.Tensor, residual: torch.Tensor,
                        next_norm: RMSNorm | None = None, valid_rows: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention_out [num_tokens, num_heads, head_dim] -> (the MLP's output, the residual
        stream before it); with ``next_norm`` (the next layer's input norm, or the final one),
        (next_norm of the stream after this layer, that stream). Both adds are written into
        ``residual`` in place. ``valid_rows`` [num_tokens] bool: the rows a sparse block
        routes (None: all; padding rows are not)."""
        h, residual = add_rms_norm(attention_out.flatten(1), self.self_attn.o_proj, residual,
                                   self.post_attention_layernorm)
        if self.sparse:
            out = self.mlp(h, valid_rows)
            return (out, residual) if next_norm is None else next_norm(out, residual)
        if next_norm is None:
            return self.mlp(h), residual
        return add_rms_norm(self.mlp.gated(h), self.mlp.down_proj, residual, next_norm)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        """``config``: the whole model's; with ``tp`` this rank builds its part of it
        (tensor_parallel.py) and ``self.config`` is that part's."""
        super().__init__()
        self.tp = tp
        self.whole_config = config  # (what checkpoints and LoRA adapters are shaped by)
        self.config = config = tp.local_config(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   config)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, index)
                                    for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, self.embed_tokens.num_embeddings, bias=False))
        self.register_buffer("inv_freq", compute_inv_freq(config), persistent=False)
        # [max_position_embeddings, head_dim] fp32: cos then sin of position * inv_freq
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(
            self.inv_freq, config.max_position_embeddings), persistent=False)
        # an EAGLE head's hidden states, written by the forward (hidden_capture.py)
        self.hidden_capture: NoCapture | FeatureCapture = NO_CAPTURE

    def bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Hand each layer views of its cache.

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        """
        if kv_cache is None:  # unbind (after the memory profile's scratch cache)
            for layer in self.layers:
                layer.self_attn.key_cache = layer.self_attn.value_cache = None
                layer.self_attn.decode_context = None
            return
        # CPU: decode contexts kept from step to step. They hold what the cache holds for the
        # decoding sequences, plus padding and shared prefixes copied per sequence: cap them at
        # twice the cache (a larger batch falls back to gathering each step)
        context_bytes = 2 * kv_cache.nbytes // len(self.layers)
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            layer.self_attn.key_cache, layer.self_attn.value_cache = layer_cache[0], layer_cache[1]
            layer.self_attn.decode_context = (None if kv_cache.is_cuda
                                              else DecodeContext(context_bytes))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata,
                layer_waits: Sequence[Sequence[torch.cuda.Event]] | None = None,
                logits_out: torch.Tensor | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> logits [num_sampled, vocab_size] (fp32).
        ``layer_waits``: per layer, events its attention waits for (KV blocks loading in
        layer groups, kv_tiers.py). ``logits_out``: written and returned (a CUDA graph's
        static buffer). ``image_rows``: (rows [n] int64, embeddings [n, hidden_size]) that
        replace those tokens' embeddings (an image's placeholders: image_inputs.py).
        ``cos_sin_cache``: the rows ``positions`` index instead of the model's own (a step's
        M-RoPE table: qwen_images.py)."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if image_rows is not None:
            x = x.index_copy(0, image_rows[0], image_rows[1].to(x.dtype))
        # Each layer ends with the next one's input norm; the last one with the final norm
        # only where down's reduce carries it (elsewhere ``logits`` normalizes just the
        # sampled rows)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [
            self.norm if self.final_norm_in_layer(x) else None]
        valid_rows = sparse_rows(metadata.slot_mapping) if self.config.moe else None
        residual, normed = None, False
        capture = self.hidden_capture
        if capture.captures_final:  # every row's final norm, for the capture
            next_norms[-1] = self.norm
        cos_sin = self.cos_sin_cache if cos_sin_cache is None else cos_sin_cache
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True)):
            if index in capture.layer_ids:  # the stream entering this layer
                capture.take(index, residual if normed else x if residual is None
                             else x + residual, metadata.slot_mapping)
            x, residual = layer(x, residual, positions, cos_sin, metadata, normed,
                                next_norm, layer_waits[index] if layer_waits is not None else (),
                                valid_rows)
            normed = next_norm is not None
        if capture.captures_final:  # (the last layer normed every row)
            capture.take_final(x, metadata.slot_mapping)
        indices = None if metadata.all_logits else metadata.logits_indices
        if normed:
            return self.head(x if indices is None else x[indices], logits_out)
        return self.logits(x, residual, indices, logits_out)

    def final_norm_in_layer(self, x: torch.Tensor) -> bool:
        """Whether the last layer applies the final norm to all rows of x [num_tokens,
        hidden]: where down's reduce carries it (elsewhere ``logits`` normalizes just the
        sampled rows), and after a sparse block (a norm kernel either way)."""
        last = self.layers[-1]
        if last.sparse:
            return True
        down = last.mlp.down_proj
        return down.reduce is None and ops.norm_in_reduce(x.shape[0], down.kernel_weight, x,
                                                          self.norm.weight)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, indices: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's (x, residual) [num_tokens, hidden_size] -> logits of the rows
        ``indices`` (None: all) [num_sampled, vocab_size] (fp32; into ``out`` when given)."""
        if indices is not None:
            x, residual = x[indices], residual[indices]
        x, _ = self.norm(x, residual)  # [num_sampled, hidden_size]
        return self.head(x, out)

    def head(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed rows [num_sampled, hidden_size] -> logits [num_sampled, vocab_size]
        (fp32; into ``out`` when given)."""
        head_weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        invariant = self.config.batch_invariant
        if self.tp.size == 1 and out is not None:
            return ops.linear(x, head_weight, out=out, batch_invariant=invariant)
        logits = ops.linear(x, head_weight, batch_invariant=invariant)  # [num_sampled, rank's rows]
        logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float() if out is None else out.copy_(logits)


def sparse_rows(slot_mapping: torch.Tensor) -> torch.Tensor:
    """[num_tokens] bool: the rows a sparse block routes; padding (slot -1) goes nowhere."""
    return slot_mapping >= 0


def wait_events(events: Sequence[torch.cuda.Event]) -> None:
    """The current stream waits on the device for ``events`` (none: no call at all)."""
    for event in events:
        torch.cuda.current_stream().wait_event(event)
