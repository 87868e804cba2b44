"""A tiny Llama-style decoder over a paged KV cache (CPU, seeded).

RMSNorm, rotary position embeddings, causal masked attention with grouped KV
heads, SwiGLU; module names follow Hugging Face's Llama (``embed_tokens``,
``layers[i].self_attn.q_proj`` ...) so the probes and the fault injectors can
address weights by their usual names. The weights are random but seeded: the
outputs are gibberish bytes, deterministic for a seed.

Attention reads and writes a paged KV pool through per-sequence block tables:
token position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LabConfig", "TinyLlama", "RMSNorm", "LoraContext", "draft_config", "read_state_dict"]


@dataclass
class LabConfig:
    """Model shape and serving limits of one lab engine (tiny defaults)."""

    # model
    vocab_size: int = 320  # the byte tokenizer (259 ids) padded
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4  # < num_heads: grouped-query attention
    intermediate_size: int = 128
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0
    # KV cache
    block_size: int = 8
    num_blocks: int = 256
    # serving
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_waiting: int = 64
    max_tokens_limit: int = 128
    request_timeout_s: float | None = None  # default per-request deadline (504 past it)
    strict_detokenize: bool = False  # detokenize with errors="strict" (else "replace")
    tensor_parallel_size: int = 1  # checked against the heads at load, as vLLM does
    # weights: None = the seeded random init; else a checkpoint file (.safetensors
    # or a torch file), written from the seeded init when missing
    checkpoint: str | None = None
    truncate_checkpoint: bool = False  # cut the checkpoint file short before loading
    nvlink_links: int = 0  # active NVLink links of the fake GPU
    # speculative decoding (0: off) and the draft's shape
    spec_k: int = 0
    draft_layers: int = 1
    # LoRA
    max_loras: int = 4
    max_lora_rank: int = 16
    # probes and logging
    checker_tiers: str = "numerical"  # module outputs too: ACTIVATION_INF is seen
    kv_verify_per_step: int = 64
    poll_every: int = 4
    stats_every: int = 10
    served_model_name: str = "lab-tiny-llama"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # short aliases
    @property
    def layers(self) -> int:
        return self.num_layers

    @property
    def hidden(self) -> int:
        return self.hidden_size

    @property
    def max_position(self) -> int:
        return self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def draft_config(cfg: LabConfig) -> LabConfig:
    """The draft model of speculative decoding: the target's first layers, same
    width and vocabulary (it shares the target's embeddings and head)."""
    return replace(cfg, num_layers=max(1, min(cfg.draft_layers, cfg.num_layers)), spec_k=0)


class LoraContext(Protocol):
    """Per-row adapter deltas for one forward (see :mod:`rca.lab.lora`)."""

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LabConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def _proj(self, name: str, x: torch.Tensor, lora: LoraContext | None) -> torch.Tensor:
        out = getattr(self, name)(x)
        if lora is not None:
            d = lora.delta(self.index, name, x)
            if d is not None:
                out = out + d
        return out

    def qkv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoraContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self._proj("q_proj", x, lora).view(b, t, self.num_heads, self.head_dim)
        k = self._proj("k_proj", x, lora).view(b, t, self.num_kv_heads, self.head_dim)
        v = self._proj("v_proj", x, lora).view(b, t, self.num_kv_heads, self.head_dim)
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q ``[B, T, H, D]``, k/v ``[B, S, KVH, D]``, mask ``[B, T, S]`` bool."""
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
        )
        b, _, t, _ = out.shape
        return out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: LabConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LabConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class TinyLlama(nn.Module):
    """The decoder. :meth:`forward` runs over the paged pool; :meth:`forward_dense`
    is the plain (non-paged) reference on the same weights."""

    def __init__(self, cfg: LabConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)
        self.reset_parameters(cfg.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(2 * len(self.layers))  # GPT-2's residual scaling
                p.copy_(torch.randn(p.shape, generator=g) * std)
        # no logit for the padded rows and the special tokens: random bytes only
        # (ends by max_tokens, as a model that never says EOS)
        self.lm_head.weight[256:].zero_()
        self.lm_head.weight[:256] *= 4.0  # peaked enough that a draft agrees often

    # ------------------------------------------------------------------ paged
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: Any,
        block_tables: torch.Tensor,
        query_lens: torch.Tensor,
        *,
        all_logits: bool = False,
        lora: LoraContext | None = None,
    ) -> torch.Tensor:
        """One step over a batch of sequences.

        ``input_ids``/``positions``: ``[B, T]`` (row b's first ``query_lens[b]``
        entries are real, the rest padding); ``kv_pool``: a
        :class:`rca.lab.kvcache.KVPool` (``k``/``v`` ``[layers, blocks,
        block_size, kv_heads, head_dim]``); ``block_tables``: ``[B, M]`` block ids.
        Returns the logits of each row's last real token ``[B, V]``, or of every
        token ``[B, T, V]`` with ``all_logits``.
        """
        b, t = input_ids.shape
        bs = kv_pool.block_size
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        valid = torch.arange(t)[None, :] < query_lens[:, None]  # [B, T]
        slot_block = torch.gather(block_tables, 1, positions // bs)
        slots = (slot_block * bs + positions % bs)[valid]  # flat slots of real tokens
        m = block_tables.shape[1]
        ctx = m * bs
        key_pos = torch.arange(ctx)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
        for layer in self.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.qkv(h, cos, sin, lora)
            kc = kv_pool.k[attn.index].view(-1, attn.num_kv_heads, attn.head_dim)
            vc = kv_pool.v[attn.index].view(-1, attn.num_kv_heads, attn.head_dim)
            kc.index_copy_(0, slots, k[valid].to(kc.dtype))
            vc.index_copy_(0, slots, v[valid].to(vc.dtype))
            keys = kv_pool.k[attn.index][block_tables].reshape(b, ctx, attn.num_kv_heads, -1)
            vals = kv_pool.v[attn.index][block_tables].reshape(b, ctx, attn.num_kv_heads, -1)
            x = x + attn.o_proj(attn.attend(q, keys.to(q.dtype), vals.to(q.dtype), mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if not all_logits:
            last = (query_lens - 1).clamp(min=0)
            x = x[torch.arange(b), last]
        return self.lm_head(self.norm(x))

    # ------------------------------------------------------------------ reference
    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal attention over ``input_ids`` ``[B, T]`` (no cache): the
        logits of every position ``[B, T, V]``. The reference for the paged path."""
        b, t = input_ids.shape
        pos = torch.arange(t)[None, :].expand(b, t)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.qkv(h, cos, sin, None)
            x = x + attn.o_proj(attn.attend(q, k, v, mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x))

    # ------------------------------------------------------------------ files
    def save_checkpoint(self, path: str | Path) -> None:
        """Write the weights: safetensors for a ``.safetensors`` path, else torch."""
        path = Path(path)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(path))
        else:
            torch.save({"config": self.config.to_dict(), "state_dict": state}, path)

    def load_checkpoint(self, path: str | Path) -> None:
        self.load_state_dict(read_state_dict(path))


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file (a truncated file raises the loader's error)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    data = torch.load(path, map_location="cpu", weights_only=True)
    return dict(data.get("state_dict", data))
