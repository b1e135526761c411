"""The DFlash block-diffusion drafter, in the published checkpoint format.

A drafter is a few Qwen3-style layers. Its input is one block: the last committed token followed by
mask tokens, embedded with the target's embedding. Its context is the target's hidden states at a few
tap layers, fused by `fc` + `hidden_norm`. In every layer the block's queries attend to keys/values
computed from [fused context ; block], so one parallel pass predicts the whole block, and the target's
LM head turns the outputs at block positions 1.. into draft logits.

Checkpoint keys (no embedding, no LM head: the target's are shared):
  fc.weight [H, n_taps * H], hidden_norm.weight, norm.weight,
  layers.N.{input_layernorm,post_attention_layernorm}.weight, layers.N.self_attn.{q,k,v,o}_proj.weight,
  layers.N.self_attn.{q,k}_norm.weight, layers.N.mlp.{gate,up,down}_proj.weight

`dflash_config.draft_window` / `draft_sinks` (ours; other loaders ignore them): the context positions the
drafter attends to by default (`DFlashDrafter.set_window`), for a drafter trained on short contexts.

Optionally, beside them, `draft_vocab.json` ({"token_ids": [...]}, ours; other loaders ignore it): the
tokens the drafter may propose. Its logits then come from those rows of the target's LM head only
(a fraction of the head's cost); other tokens get -inf. Output is still the target's: only what is
proposed changes. And `datastore.npz` (ours): the target's stock phrases, a proposer beside prompt lookup
(datastore.py).

The second published format, DFlash2 (dynamic convolutions in every layer, a candidate selector), builds
on these classes in dflash2.py; `load_drafter` loads either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..models import flat, layers, quantize
from ..models.cache import KVCache
from ..models.layers import MLP, Linear, RMSNorm, attend, attention_mask, linear
from ..models.rope import Rotary, apply_rotary, rope_parameters
from .datastore import load_beside
from .draft_pass import FlatDraft, NativeDraft

VOCAB_FILE = "draft_vocab.json"
WINDOW_SLACK = 128  # a windowed cache is compacted when it holds this many positions past sinks + window


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Tap layers when the checkpoint does not list them: spread from layer 1 to L - 3, one per
    draft layer (the rule of the reference implementation)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_value(config: dict, name: str, default=None):
    """A setting from `dflash_config`, falling back to the top level of the config."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


class Blocks:
    """Training blocks laid out for attention block by block (an `extra_mask` for `DFlashDrafter.forward`).

    A training pass concatenates n blocks of B positions from several sequences, with all their context
    features. A dense mask over [n * B, context + n * B] scores every block against every context token
    and every other block, and hides most of it again: with 4 sequences of 32 blocks, about 95% of the
    scores. Here each block attends only to its own context (the first `ctx_len[i]` context rows from
    `ctx_start[i]`: its sequence's tokens before its anchor) and to its own B positions, bidirectionally,
    which is what the dense mask allows (`train.make_batch`; tests/test_train.py checks the two agree).
    Full-attention layers only (the published drafters'); causal or windowed layers take the dense mask.
    """

    def __init__(self, ctx_start: torch.Tensor, ctx_len: torch.Tensor, block_size: int) -> None:
        n_ctx = int(ctx_len.max()) if len(ctx_len) else 0
        span = torch.arange(n_ctx, device=ctx_start.device)
        self.valid = span[None] < ctx_len[:, None]  # [n, Lmax]
        self.index = torch.where(self.valid, ctx_start[:, None] + span[None], 0)  # [n, Lmax] context rows
        self.block_size = block_size

    def attend(self, q, k_blk, v_blk, k_ctx, v_ctx, scale: float) -> torch.Tensor:
        """q [1, H, n * B, D], block k/v [1, Hkv, n * B, D], context k/v [1, Hkv, Tc, D] -> [1, n * B, H * D]."""
        _, h, t, d = q.shape
        hkv, n, bs = k_blk.shape[1], t // self.block_size, self.block_size

        def per_block(x):  # [1, heads, n * B, D] -> [n, heads, B, D]
            return x[0].view(x.shape[1], n, bs, d).transpose(0, 1)

        def context(x):  # [1, Hkv, Tc, D] -> [n, Hkv, Lmax, D]: each block's own context rows
            return x[0][:, self.index].transpose(0, 1)

        k = torch.cat([context(k_ctx), per_block(k_blk)], dim=2)  # [n, Hkv, Lmax + B, D]
        v = torch.cat([context(v_ctx), per_block(v_blk)], dim=2)
        mask = torch.cat([self.valid, self.valid.new_ones(n, bs)], dim=1)[:, None, None]  # [n, 1, 1, Lmax + B]
        out = F.scaled_dot_product_attention(per_block(q), k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=hkv != h)  # [n, H, B, D]
        return out.transpose(1, 2).reshape(1, t, h * d)


class DraftAttention(nn.Module):
    def __init__(self, c: dict, layer: int) -> None:
        super().__init__()
        h = c["hidden_size"]
        self.n_heads, self.n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or h // self.n_heads
        bias = bool(c.get("attention_bias", False))
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias)
        eps = c.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
        sliding = types[layer] == "sliding_attention"
        # Full-attention layers are bidirectional inside the block; sliding layers are causal + windowed.
        self.causal = sliding if c.get("is_causal") is None else bool(c["is_causal"])
        self.window = c.get("sliding_window") if sliding else None
        self.layer = layer
        self.scale = self.head_dim**-0.5
        # kernels/attention.cpp's full attention for a cached float32 pass of one block (drafter_blocks sets it with the
        # norms' kernels): PyTorch's attention cost 2.7-4x the tiles at a few-row draft's shapes (docs/performance.md)
        self.kernel = False

    def kv(self, k: torch.Tensor, v: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k and v [B, T, Hkv * D] -> normed, rotated keys and values [B, Hkv, T, D]."""
        b, t, _ = k.shape
        k = self.k_norm(k.view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, ctx, q_rope, ctx_rope, q_pos, k_pos, cache: KVCache | None, extra_mask, ctx_kv=None):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *q_rope)
        k_blk, v_blk = self.kv(self.k_proj(x), self.v_proj(x), *q_rope)
        # ctx_kv: this layer's context k/v projections, when the drafter made all layers' in one matmul
        k_ctx, v_ctx = self.kv(*(ctx_kv or (self.k_proj(ctx), self.v_proj(ctx))), *ctx_rope)
        if isinstance(extra_mask, Blocks):  # training: each block against its own context only
            if self.causal or self.window is not None:
                raise ValueError("Blocks serve full-attention draft layers; give this one the dense mask")
            return self.o_proj(extra_mask.attend(q, k_blk, v_blk, k_ctx, v_ctx, self.scale))
        if cache is not None:
            # Context keys are kept for later cycles; the block's go into the scratch slots right after
            # them and are overwritten next cycle (the cache length never covers them).
            start = cache.length
            cache.write(self.layer, start, k_ctx, v_ctx)
            k, v = cache.write(self.layer, start + k_ctx.shape[2], k_blk, v_blk)
        else:
            k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        mask = None
        if self.causal or self.window is not None:
            mask = attention_mask(q_pos, k_pos, causal=self.causal, window=self.window)
        if extra_mask is not None:
            mask = extra_mask if mask is None else mask & extra_mask
        if self.kernel and mask is None and cache is not None and b == 1 and q.dtype == torch.float32:
            o = torch.ops.dflash.full_attention(q[0].transpose(0, 1), k[0], v[0], k.shape[2], self.scale, -1)
            return self.o_proj(o[None])  # [1, T, H * D]
        return self.o_proj(attend(q, k, v, mask, self.scale))


class DraftLayer(nn.Module):
    def __init__(self, c: dict, layer: int) -> None:
        super().__init__()
        eps = c.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.self_attn = DraftAttention(c, layer)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)
        self.mlp = MLP(c["hidden_size"], c["intermediate_size"], act=c.get("hidden_act", "silu"))

    def forward(self, x, ctx, q_rope, ctx_rope, q_pos, k_pos, cache, extra_mask, ctx_kv=None):
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, ctx, q_rope, ctx_rope, q_pos, k_pos, cache, extra_mask, ctx_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """A DFlash drafter. Build it from a config dict; load one with `load_drafter`."""

    layer_class: type[nn.Module] = DraftLayer  # a format's layer (dflash2.DFlash2Layer adds its convolutions)

    def __init__(self, config: dict) -> None:
        super().__init__()
        c = self.config = dict(config)
        n_layers = c["num_hidden_layers"]
        self.layers = nn.ModuleList(self.layer_class(c, i) for i in range(n_layers))
        ids = dflash_value(c, "target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(c["num_target_layers"], n_layers)
        self.target_layer_ids = [int(i) for i in ids]
        h = c["hidden_size"]
        eps = c.get("rms_norm_eps", 1e-6)
        self.fc = Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)
        self.block_size = int(dflash_value(c, "block_size", 16))
        self.mask_token_id = int(dflash_value(c, "mask_token_id"))
        self.input_scale = float(dflash_value(c, "input_embedding_scale", 1.0))
        self.output_multiplier = float(dflash_value(c, "output_multiplier", 1.0))
        self.softcap = dflash_value(c, "final_logit_softcapping")
        head_dim = c.get("head_dim") or h // c["num_attention_heads"]
        self.rotary = Rotary(rope_parameters(c), head_dim, c.get("max_position_embeddings", 4096))
        # every layer's context k/v projections stacked (fuse_context_kv); not saved with the weights
        self.register_buffer("ctx_kv_weight", None, persistent=False)
        self.register_buffer("ctx_kv_bias", None, persistent=False)
        self.ctx_kv_blocks: nn.Module | None = None  # the same projections in their blocks, where they have them
        self.skinny = layers.SKINNY_ROWS  # the stacked context k/v matmul's (layers.linear)
        # the tokens it may propose (draft_vocab.json), ascending; None: the whole vocabulary
        self.register_buffer("draft_vocab", None, persistent=False)
        self._head = None  # (the target's LM head, its draft-vocabulary rows as a head of the same kind)
        self.window: tuple[int, int] | None = None  # (sinks, size): the context positions attended (set_window)
        if dflash_value(c, "draft_window") is not None:
            self.set_window(int(dflash_value(c, "draft_window")), int(dflash_value(c, "draft_sinks", 64)))
        self.flat = True  # draft passes through FlatDraft where it applies (same bits; False: the modules)
        self.script = True  # FlatDraft compiled by TorchScript on a CPU (same bits; False: in Python)
        # block-format layers: the draft pass's layers in one C++ call (NativeDraft; same bits; False: FlatDraft)
        self.native = True
        self._plan = None

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # a norm: never quantized (fc may be, whose .weight reads back bf16)

    def fuse_context_kv(self) -> DFlashDrafter:
        """Compute the context keys/values of all draft layers with one matmul instead of two per layer
        (inference only: a copy of the k/v weights, so call it again after changing them). The context is
        the same for every layer; only the block's own k/v differ per layer."""
        parts = [p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        # (quantized layers read back their dequantized weights: the context's k/v match the block's)
        self.ctx_kv_weight = torch.cat([p.weight.detach().to(self.dtype) for p in parts])  # [L * 2 * Hkv * D, H]
        self.ctx_kv_bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        # Block-format projections: their blocks stacked as they are, on the block kernels like the block's own
        # k/v (a quarter of the float copy's bytes; the float matmul was most of a few-row draft pass's context)
        blocks, fmts = None, {getattr(p, "fmt", None) for p in parts}
        if all(isinstance(p, quantize.BlockLinear) for p in parts) and len(fmts) == 1:
            blocks = quantize.BlockLinear(None, fmts.pop(), torch.cat([p.raw() for p in parts]), self.ctx_kv_bias)
        object.__setattr__(self, "ctx_kv_blocks", blocks)  # not a submodule: never saved, like ctx_kv_weight
        self._plan = None
        return self

    def context_kv(self, ctx: torch.Tensor) -> torch.Tensor:
        """Every layer's context keys and values [..., L * 2 * Hkv * D] of fused context features ctx
        [..., H] (after `fuse_context_kv`): k, v of layer 0, k, v of layer 1, ..."""
        if self.ctx_kv_blocks is not None:
            return self.ctx_kv_blocks(ctx).to(ctx.dtype)
        return linear(ctx, self.ctx_kv_weight, self.ctx_kv_bias, self.skinny)

    def _apply(self, fn, recurse=True):
        self._plan = self._head = None  # .to() / .half() may replace tensors the flat plan holds
        return super()._apply(fn, recurse)

    def set_window(self, size: int | None, sinks: int = 64) -> None:
        """Attend to the first `sinks` context positions and the last `size` (at least; up to WINDOW_SLACK
        more, as the cache is compacted in steps) instead of the whole context (None: all of it). Long
        contexts then cost the drafter a fixed amount per cycle, and it sees context lengths like those it
        was trained on. Only what is proposed changes; the output is the target's either way."""
        if size is not None:
            if size < 1 or sinks < 0:
                raise ValueError(f"a draft window needs size >= 1 and sinks >= 0, got {size} and {sinks}")
            if any(layer.self_attn.causal or layer.self_attn.window is not None for layer in self.layers):
                raise ValueError("a draft window needs full-attention draft layers")
        self.window = None if size is None else (int(sinks), int(size))

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """Context keys/values of every draft layer, plus room for one block of scratch."""
        a = self.layers[0].self_attn
        if self.window is not None:  # never more than the window holds (set_window, _slide)
            max_len = min(max_len, sum(self.window) + WINDOW_SLACK)
        return KVCache(
            len(self.layers), a.n_kv, a.head_dim, max_len + self.block_size,
            batch=batch, dtype=self.dtype, device=self.norm.weight.device,
        )

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        q_pos: torch.Tensor,
        ctx_pos: torch.Tensor,
        cache: KVCache | None = None,
        extra_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Drafter hidden states [B, Tq, H] (after the final norm) for the block.

        noise_embedding [B, Tq, H]: embedded block tokens; target_hidden [B, Tc, n_taps * H]: raw tap
        features of the new context tokens; q_pos [Tq] / ctx_pos [Tc]: their absolute positions.
        With a cache, the new context is appended to it (cache.length += Tc) and the block attends to
        all cached context; `extra_mask` [Tq, Tk] further restricts attention (training).
        """
        ctx = self.hidden_norm(self.fc(target_hidden))  # [B, Tc, H]
        dtype = noise_embedding.dtype
        q_rope = self.rotary(q_pos, dtype)
        ctx_rope = self.rotary(ctx_pos, dtype)
        if cache is not None:
            k_pos = torch.cat([torch.arange(cache.length + ctx.shape[1], device=q_pos.device), q_pos])
        else:
            k_pos = torch.cat([ctx_pos, q_pos])
        ctx_kv = [None] * len(self.layers)
        if self.ctx_kv_weight is not None:
            kv = self.context_kv(ctx)  # [B, Tc, L * 2 * Hkv * D]
            parts = kv.chunk(2 * len(self.layers), dim=-1)  # k, v of layer 0, k, v of layer 1, ...: all Hkv * D
            ctx_kv = [parts[2 * i : 2 * i + 2] for i in range(len(self.layers))]
        x = noise_embedding
        for layer, layer_kv in zip(self.layers, ctx_kv):
            x = layer(x, ctx, q_rope, ctx_rope, q_pos, k_pos, cache, extra_mask, layer_kv)
        if cache is not None:
            cache.length += ctx.shape[1]
        return self.norm(x)

    def set_draft_vocab(self, token_ids: list[int] | torch.Tensor | None) -> None:
        """Restrict proposals to these token ids (None: the whole vocabulary)."""
        if token_ids is not None:
            ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
            if ids.numel() == 0 or int(ids.min()) < 0 or ids.unique().numel() != ids.numel():
                raise ValueError("a draft vocabulary needs distinct, non-negative token ids")
            token_ids = ids.sort().values.to(self.norm.weight.device)
        self.draft_vocab, self._head = token_ids, None

    def draft_head(self, lm_head: nn.Module) -> nn.Module:
        """The target's LM head, or its draft-vocabulary rows as a head of the same kind (a quantized head
        stays quantized the same way), built once per head."""
        if self.draft_vocab is None:
            return lm_head
        if self._head is None or self._head[0] is not lm_head:
            if isinstance(lm_head, quantize.BlockLinear):  # its rows' blocks as they are
                self._head = (lm_head, lm_head.rows(self.draft_vocab))
                return self._head[1]
            rows = self.draft_vocab.to(lm_head.weight.device)
            w = lm_head.weight.detach()[rows]  # quantized heads read back their dequantized weight
            bias = getattr(lm_head, "bias", None)
            sub = Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
            sub.weight.data.copy_(w)
            if bias is not None:
                sub.bias.data.copy_(bias.detach()[rows])
            sub.requires_grad_(False)
            sub.skinny = self.skinny  # as the drafter's other float32 matmuls (layers.set_skinny_rows)
            if isinstance(lm_head, quantize.Int4Linear) and quantize.int4_fits(sub, lm_head.group_size):
                sub = quantize.Int4Linear(sub, lm_head.group_size)
            elif isinstance(lm_head, (quantize.Int4Linear, quantize.Int8Linear)):
                sub = quantize.Int8Linear(sub)
            self._head = (lm_head, sub)
        return self._head[1]

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Token ids -> their index in the draft vocabulary (-100, ignored, outside it or for -100)."""
        if self.draft_vocab is None:
            return labels
        top = max(int(self.draft_vocab.max()), int(labels.max()) if labels.numel() else 0)
        index = torch.full((top + 2,), -100, dtype=torch.long, device=labels.device)  # last slot: for -100
        index[self.draft_vocab.to(labels.device)] = torch.arange(len(self.draft_vocab), device=labels.device)
        return index[labels.where(labels >= 0, -1)]

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module, full: bool = True) -> torch.Tensor:
        """Draft logits from drafter hidden states through the target's LM head: [..., V], or with a
        draft vocabulary and full=False [..., len(draft_vocab)] (its rows only)."""
        out = self.draft_head(lm_head)(hidden)
        if self.output_multiplier != 1.0:
            out = out * self.output_multiplier
        if self.softcap:
            out = torch.tanh(out / float(self.softcap)) * float(self.softcap)
        if self.draft_vocab is not None and full:  # the other tokens cannot be proposed
            full_out = out.new_full((*out.shape[:-1], lm_head.out_features), float("-inf"))
            out = full_out.index_copy_(-1, self.draft_vocab.to(out.device), out)
        return out

    def propose(self, target: nn.Module, block: torch.Tensor, ctx: torch.Tensor, cache: KVCache,
                full: bool = True) -> torch.Tensor:
        """Draft logits [B, bs - 1, V] for block [B, bs] (token then masks) given new context
        features ctx [B, Tc, F] at the positions after the cache's (cache.length + cache.dropped onwards);
        with a draft vocabulary and full=False [B, bs - 1, len(draft_vocab)] (see `logits`)."""
        hidden = self.draft_hidden(target, block, ctx, cache)  # [B, bs, H]
        return self.logits(hidden[:, 1:].to(target.embed_tokens.weight.dtype), target.lm_head, full=full)

    def draft_hidden(self, target: nn.Module, block: torch.Tensor, ctx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The drafter's hidden states [B, bs, H] after the final norm for block [B, bs] (see `propose`);
        the new context goes into the cache."""
        dev = block.device
        chunks = list(ctx) if isinstance(ctx, (list, tuple)) else [ctx]  # ctx, or its parts in order
        base = cache.length + cache.dropped  # position of ctx's first row
        start = base + sum(c.shape[1] for c in chunks)  # position of the block's first token
        q_pos = torch.arange(start, start + block.shape[1], device=dev)
        ctx_pos = span = torch.arange(base, start, device=dev)
        if self.window is not None:
            ctx, ctx_pos = self._slide(chunks, ctx_pos, cache)
        else:
            ctx = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        emb = target.embed_tokens(block)
        if self.input_scale != 1.0:
            emb = emb * self.input_scale
        plan = self._flat_plan() if self.flat and block.shape[0] == 1 else None
        if plan is None:
            hidden = self(emb.to(self.dtype), ctx.to(self.dtype), q_pos, ctx_pos, cache)
        else:  # the same kernels as the line above, without the modules around them (flat.py)
            end = cache.length + ctx.shape[1] + block.shape[1]  # slots, as positions where nothing was dropped
            if end > cache.max_len:
                raise ValueError(f"KV cache overflow: position {end} > capacity {cache.max_len}")
            # rows of the rotary table where the positions are one range (the same values as computing them),
            # with the signed sine the kernels take (flat.signed of the same rows)
            q_cos, q_sin, q_signed = self.rotary.rows(start, start + block.shape[1], self.dtype)  # [T, 1, D]
            if ctx_pos is span:
                c_cos, c_sin, c_signed = self.rotary.rows(base, start, self.dtype)
            else:
                c_cos, c_sin = (r[:, None] for r in self.rotary(ctx_pos, self.dtype))
                c_signed = None
            hidden = plan(emb[0].to(self.dtype), ctx[0].to(self.dtype), q_cos, q_sin, c_cos, c_sin, cache.length,
                          cache.k, cache.v, q_signed, c_signed)[None]  # [1, T, H]
            cache.length += ctx.shape[1]
        return hidden

    def _slide(self, chunks: list[torch.Tensor], ctx_pos: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
        """Keep the drafter's context to the sinks and the window: new rows (ctx_pos, given in `chunks` of
        [B, t, F] in order) that would fall out of it at once are not taken in, nor copied (after a long
        prompt they are most of its features), and once the cache holds WINDOW_SLACK positions more than it
        needs, the recent positions move down next to the sinks (their keys keep their own positions'
        rotation)."""
        sinks, size = self.window
        tc = ctx_pos.shape[0]
        need = max(0, sinks - cache.length)  # new rows that become sinks
        if tc > need + size:
            ctx = _rows(chunks, [(0, need), (tc - size, tc)])
            ctx_pos = torch.cat([ctx_pos[:need], ctx_pos[tc - size:]])
            cache.dropped += tc - need - size
        else:
            ctx = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        n, old = ctx.shape[1], cache.length - sinks  # old: cached positions past the sinks
        if old > 0 and cache.length + n > sinks + size + WINDOW_SLACK:
            stay = min(old, max(0, size - n))  # old positions still inside the window after the new rows
            for buf in (cache.k, cache.v):  # [L, B, Hkv, S, D]
                buf[:, :, :, sinks : sinks + stay] = buf[:, :, :, cache.length - stay : cache.length].clone()
            cache.dropped += old - stay
            cache.length = sinks + stay
        return ctx, ctx_pos

    def _flat_plan(self) -> nn.Module | None:
        # FlatDraft for this drafter (built once per script setting), or None where it does not apply:
        # causal or windowed layers, no stacked context k/v, or a layer type it does not know.
        if self._plan is None:
            self._plan = {}
        key = (self.script, self.native)
        if key not in self._plan:
            plan = None
            attns = [layer.self_attn for layer in self.layers]
            if self.ctx_kv_weight is not None and not any(a.causal or a.window is not None for a in attns):
                try:
                    plan = FlatDraft(self)
                except TypeError:
                    plan = None
            cpu = self.norm.weight.device.type == "cpu"
            if plan is not None and self.native and cpu and NativeDraft.applies(plan):
                plan = NativeDraft(plan)
            elif plan is not None and self.script and cpu:
                plan = flat.script(plan)
            self._plan[key] = plan
        return self._plan[key]

    @staticmethod
    def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensor names -> this module's (the first format: as they are)."""
        return state

    def check_target(self, target_config: dict, num_target_layers: int, vocab_size: int) -> None:
        """Fail early, with a message a user can act on, when this drafter cannot serve the target."""
        h = self.config["hidden_size"]
        th = target_config.get("hidden_size")
        if th != h:
            raise ValueError(f"drafter hidden size {h} does not match the target's hidden size {th}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(
                f"drafter taps target layers {self.target_layer_ids}, but the target has only "
                f"{num_target_layers} layers"
            )
        if not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(f"drafter mask_token_id {self.mask_token_id} is outside the target vocab ({vocab_size})")
        dv = self.config.get("vocab_size")
        if dv is not None and dv != vocab_size:
            raise ValueError(f"drafter was built for a vocab of {dv} tokens; the target has {vocab_size}")
        if self.draft_vocab is not None and int(self.draft_vocab.max()) >= vocab_size:
            raise ValueError(f"the drafter's draft_vocab.json names token {int(self.draft_vocab.max())}, outside "
                             f"the target vocab ({vocab_size})")

    def saved_settings(self) -> dict:
        """What `save` writes into `dflash_config` (beside whatever the config already held there)."""
        return dict(block_size=self.block_size, mask_token_id=self.mask_token_id,
                    target_layer_ids=self.target_layer_ids)

    def save(self, path: str | Path, extra_config: dict | None = None) -> None:
        """Write config.json + model.safetensors in the published format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        config.setdefault("architectures", ["DFlashDraftModel"])
        config.setdefault("model_type", "qwen3")
        dc = dict(config.get("dflash_config") or {})
        dc.update(self.saved_settings())
        config["dflash_config"] = dc
        config["block_size"] = self.block_size
        config.update(extra_config or {})
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        vocab_file = path / VOCAB_FILE
        if self.draft_vocab is not None:
            vocab_file.write_text(json.dumps({"token_ids": self.draft_vocab.tolist()}) + "\n")
        elif vocab_file.is_file():  # an earlier drafter's, not this one's
            vocab_file.unlink()


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, skip: set = frozenset()
) -> DFlashDrafter:
    """Load a drafter directory (config.json + *.safetensors) in a published format: the first DFlash
    format, or DFlash2 (`architectures` ["DFlash2DraftModel"]: a `dflash2.DFlash2Drafter`). `skip`:
    checkpoint names not to read, left on the meta device for the caller to replace (drafter_blocks.py)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is not a drafter directory (no config.json)")
    config = json.loads(cfg_file.read_text())
    if "dflash_config" not in config and "mask_token_id" not in config:
        raise ValueError(f"{path} does not look like a DFlash drafter (no dflash_config in config.json)")
    cls = DFlashDrafter
    if "DFlash2DraftModel" in config.get("architectures", []):
        # The second format (dynamic convolutions, a candidate selector) names its taps: none are derived.
        if dflash_value(config, "target_layer_ids") is None:
            raise ValueError(f"{path}: a DFlash2 drafter's config must name its target_layer_ids (in dflash_config)")
        from .dflash2 import DFlash2Drafter

        cls = DFlash2Drafter
    state = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    from ..loading import iter_tensors

    for f in files:  # read, not mapped (see iter_tensors)
        state.update({name: t for name, t, _ in iter_tensors(f, skip={f"model.{k}" for k in skip} | set(skip))})
    state = cls.map_state({k.removeprefix("model."): v for k, v in state.items()})
    with layers.skeleton():
        drafter = cls(config)
    drafter.rotary = Rotary(
        rope_parameters(config), drafter.layers[0].self_attn.head_dim, config.get("max_position_embeddings", 4096)
    )
    dtype = dtype or next(t.dtype for k, t in state.items() if t.is_floating_point())
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = drafter.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k not in skip]
    if missing:
        raise ValueError(f"drafter checkpoint {path} is missing weights: {sorted(missing)[:8]}")
    unexpected = [k for k in unexpected if not k.startswith(("embed_tokens", "lm_head", "rotary"))]
    if unexpected:
        raise ValueError(f"drafter checkpoint {path} has weights this drafter does not use: {unexpected[:8]}")
    vocab_file = path / VOCAB_FILE
    if vocab_file.is_file():
        try:
            ids = json.loads(vocab_file.read_text())["token_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError("token_ids is not a list of integers")
            drafter.set_draft_vocab(ids)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{vocab_file}: not a draft vocabulary ({e})") from None
    drafter.datastore = load_beside(path)  # the target's stock phrases, where the drafter ships them (lookup)
    return (drafter if skip else drafter.to(device)).eval()  # (skipped: still on meta, for the caller)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _rows(chunks: list[torch.Tensor], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Rows [a, b) for each span, in order, of the concatenation of chunks [B, t_i, F] along dim 1, without
    building the concatenation."""
    parts, at = [], 0
    for c in chunks:
        n = c.shape[1]
        for a, b in spans:
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                parts.append((a, c[:, lo - at : hi - at]))
        at += n
    parts.sort(key=lambda p: p[0])  # stable: within a span, the chunks' order
    return torch.cat([p for _, p in parts], dim=1)
