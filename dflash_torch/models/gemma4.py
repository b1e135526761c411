"""Gemma 4 text targets (transformers `gemma4_text`, and the language model of the multimodal `gemma4`),
and Gemma 3 text (`gemma3_text` / `gemma3`), which is the same skeleton with fewer parts.

Module and parameter names follow the Hugging Face checkpoint keys. One `forward` serves prefill, decode
and block verification. What differs from the Llama family, all as in transformers' modeling code:

* Sliding-window and global (full) attention layers interleave (`layer_types`). Every layer keeps the full
  static cache; a sliding layer masks keys older than its window, which is simplest and exact, and makes
  rollback a length for every layer.
* Global layers may have their own head dim (`global_head_dim`) and KV head count, use "proportional"
  rotary (full-width rotate-half, only the first `partial_rotary_factor` of the frequencies non-zero), and
  with `attention_k_eq_v` take values from the key projection.
* q/k RMSNorm with the attention scale folded in (scale 1), and a weightless RMSNorm on values.
* Four norms per layer (around attention and around the MLP), the embedding scaled by sqrt(hidden) inside
  `forward` (`embed_tokens` itself stays the raw table, as the drafter needs), a learned per-layer output
  scalar, and tanh soft-capping of the final logits.
* Per-layer inputs (PLE): a second embedding table gives every layer a small token-identity vector, mixed
  with a projection of the input embedding, and fed into the residual after the MLP through a gate.
* KV sharing: the last `num_kv_shared_layers` layers have no k/v projections and attend to the keys/values
  of the last earlier layer of the same type.
* Optional mixture-of-experts block (Gemma 4 26B-A4B): a router and experts beside the dense MLP.

Gemma 3 drops PLE, KV sharing, v norm, the layer scalar and MoE, stores norm weights zero-centred
(applied as 1 + weight) and scales attention by query_pre_attn_scalar^-0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .layers import ACTIVATIONS, MLP, Linear, attend, attention_mask
from .llama import Output
from .moe import Experts
from .rope import apply_rotary, inv_freq

MODEL_TYPES = ("gemma4", "gemma4_text", "gemma3", "gemma3_text")

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class LayerSpec:
    """What one decoder layer is: its attention type and shape, and where its keys/values come from."""

    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    kv_source: int  # the layer whose cache it attends to: itself, or the producer it shares with
    intermediate_size: int


@dataclass
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    hidden_activation: str
    layers: list[LayerSpec]
    rope: dict  # layer type -> rope parameters
    attention_scale: float  # Gemma 4: 1 (q_norm does the scaling); Gemma 3: query_pre_attn_scalar^-0.5
    gemma3: bool = False  # zero-centred norms, no v norm, no layer scalar
    attention_k_eq_v: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    model_type: str = "gemma4_text"

    @classmethod
    def from_dict(cls, d: dict) -> Gemma4Config:
        """From a config.json: text-only or multimodal (the language model's settings in text_config)."""
        model_type = d.get("model_type", "gemma4_text")
        text = d.get("text_config") or d
        gemma3 = model_type.startswith("gemma3")
        n = text["num_hidden_layers"]
        if text.get("use_bidirectional_attention") in ("all", True):
            raise ValueError(f"{model_type}: use_bidirectional_attention={text['use_bidirectional_attention']!r} "
                             "makes the text model non-causal; it cannot be a speculative decoding target")
        types = list(text.get("layer_types") or [])
        if not types:  # transformers' default: 5 sliding layers, then 1 global
            pattern = text.get("sliding_window_pattern", 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        if not gemma3:
            types[-1] = FULL  # transformers forces the last Gemma 4 layer to global attention
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        n_kv = text.get("num_key_value_heads") or heads
        k_eq_v = bool(text.get("attention_k_eq_v", False))
        overrides = {int(i): o for i, o in (text.get("per_layer_config") or {}).items()}
        if not overrides and not gemma3:
            # Older Gemma 4 config files name the global layers' shape at the top level (transformers turns
            # it into per_layer_config); the KV head override applies only with attention_k_eq_v.
            o = {"head_dim": text.get("global_head_dim", 512)}
            if k_eq_v and text.get("num_global_key_value_heads") is not None:
                o["num_key_value_heads"] = text["num_global_key_value_heads"]
            overrides = {i: o for i, kind in enumerate(types) if kind == FULL}
        n_shared = text.get("num_kv_shared_layers", 0) or 0
        first_shared = n - n_shared
        if n_shared and not first_shared:
            raise ValueError(f"{model_type}: all {n} layers share keys/values, so none produces them")
        intermediate = text["intermediate_size"]
        layers = []
        for i, kind in enumerate(types):
            o = overrides.get(i, {})
            source = i
            if i >= first_shared:
                producers = [j for j in range(first_shared) if types[j] == kind]
                if not producers:
                    raise ValueError(f"{model_type}: shared layer {i} ({kind}) has no earlier {kind} layer to share")
                source = producers[-1]
            wide = 2 if text.get("use_double_wide_mlp") and i >= first_shared else 1
            layers.append(LayerSpec(
                kind=kind,
                head_dim=o.get("head_dim", head_dim),
                num_kv_heads=o.get("num_key_value_heads", n_kv),
                kv_source=source,
                intermediate_size=o.get("intermediate_size", intermediate) * wide,
            ))
        moe = bool(text.get("enable_moe_block"))
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            max_position_embeddings=text.get("max_position_embeddings", 131072),
            # The multimodal model ties its LM head by the top-level flag (transformers reads that config).
            tie_word_embeddings=bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            attention_bias=bool(text.get("attention_bias", False)),
            sliding_window=text.get("sliding_window"),
            final_logit_softcapping=text.get("final_logit_softcapping"),
            attn_logit_softcapping=text.get("attn_logit_softcapping") if gemma3 else None,
            hidden_activation=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh",
            layers=layers,
            rope=_rope_by_type(text, gemma3),
            attention_scale=text.get("query_pre_attn_scalar", 256) ** -0.5 if gemma3 else 1.0,
            gemma3=gemma3,
            attention_k_eq_v=k_eq_v,
            hidden_size_per_layer_input=0 if gemma3 else text.get("hidden_size_per_layer_input", 256) or 0,
            vocab_size_per_layer_input=text.get("vocab_size_per_layer_input", 262144) or 0,
            num_experts=(text.get("num_experts") or 0) if moe else 0,
            top_k_experts=(text.get("top_k_experts") or 0) if moe else 0,
            moe_intermediate_size=(text.get("moe_intermediate_size") or 0) if moe else 0,
            model_type=model_type,
        )


def _rope_by_type(text: dict, gemma3: bool) -> dict:
    """Rope parameters per layer type, as transformers resolves them (with its defaults)."""
    params = text.get("rope_parameters") or {}
    if SLIDING in params or FULL in params:
        out = {k: dict(v or {}) for k, v in params.items()}
    elif gemma3:  # older Gemma 3 files: rope_theta (global), rope_local_base_freq (sliding), rope_scaling
        out = {FULL: dict(text.get("rope_scaling") or {}), SLIDING: {"rope_type": "default"}}
        out[FULL].setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
        out[SLIDING]["rope_theta"] = text.get("rope_local_base_freq", 10_000.0)
    else:
        out = {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
    for p in out.values():
        if "type" in p and "rope_type" not in p:
            p["rope_type"] = p.pop("type")
        p.setdefault("rope_type", "default")
        p.setdefault("rope_theta", 10_000.0)
    return out


def rope_frequencies(params: dict, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and cos/sin scale for one layer type.

    "proportional" (Gemma 4 global layers) rotates the whole head with rotate-half pairing, but only the
    first partial_rotary_factor * head_dim / 2 frequencies are non-zero (base^(-2i / head_dim), the same as
    full rotary); the rest are 0, i.e. those pairs are left as they are."""
    if params.get("rope_type") != "proportional":
        return inv_freq(params, head_dim, max_positions)
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    base = float(params["rope_theta"])
    freqs = torch.zeros(head_dim // 2, dtype=torch.float32)
    freqs[:angles] = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / head_dim))
    return freqs / float(params.get("factor", 1.0)), 1.0


# --- layers -------------------------------------------------------------------------------------


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm, computed in float32 and cast back at the end. Gemma 4: x * (mean(x^2) + eps)^-0.5
    * weight (transformers writes pow(., -0.5), kept here), or no weight at all (`with_scale=False`, the
    v norm and the router norm). Gemma 3: rsqrt and a zero-centred weight, applied as (1 + weight)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True, zero_centred: bool = False) -> None:
        super().__init__()
        self.eps, self.with_scale, self.zero_centred = eps, with_scale, zero_centred
        if with_scale:
            self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        if self.zero_centred:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        else:
            y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
            if self.with_scale:
                y = y * self.weight.float()
        return y.type_as(x)


class Attention(nn.Module):
    def __init__(self, c: Gemma4Config, layer: int) -> None:
        super().__init__()
        spec = c.layers[layer]
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.shared = spec.kv_source != layer
        self.window = c.sliding_window if spec.kind == SLIDING else None
        self.scale = c.attention_scale
        self.softcap = c.attn_logit_softcapping
        norm = dict(eps=c.rms_norm_eps, zero_centred=c.gemma3)
        bias = c.attention_bias
        self.q_proj = Linear(c.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, **norm)
        if not self.shared:  # shared layers have no k/v weights at all
            self.k_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
            self.k_norm = GemmaRMSNorm(self.head_dim, **norm)
            # attention_k_eq_v: global layers take values from the key projection (before k_norm and rope)
            self.k_eq_v = c.attention_k_eq_v and spec.kind == FULL
            if not self.k_eq_v:
                self.v_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
            self.v_norm = None if c.gemma3 else GemmaRMSNorm(self.head_dim, c.rms_norm_eps, with_scale=False)
        self.o_proj = Linear(self.n_heads * self.head_dim, c.hidden_size, bias=bias)

    def forward(self, x, cos, sin, cache: Gemma4Cache, start: int, mask):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        if self.shared:
            k, v = cache.read(self.layer, start + t)  # written by the producer layer earlier in this pass
        else:
            k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
            v = k if self.k_eq_v else self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
            k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
            if self.v_norm is not None:
                v = self.v_norm(v)
            k, v = cache.write(self.layer, start, k, v.transpose(1, 2))  # [B, Hkv, start + T, D]
        return self.o_proj(attend(q, k, v, mask, self.scale, softcap=self.softcap))


class Router(nn.Module):
    """MoE router: weightless RMSNorm, a learned per-dim scale and hidden^-0.5, softmax over experts in
    float32, top-k renormalised to sum 1, then a learned per-expert scale."""

    def __init__(self, c: Gemma4Config) -> None:
        super().__init__()
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, with_scale=False)
        self.proj = Linear(c.hidden_size, c.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(c.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(c.num_experts))
        self.top_k = c.top_k_experts
        self.root = c.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> weights [N, k] (float32), expert ids [N, k]."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class DecoderLayer(nn.Module):
    def __init__(self, c: Gemma4Config, layer: int) -> None:
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        norm = dict(eps=eps, zero_centred=c.gemma3)
        self.kind = c.layers[layer].kind
        self.self_attn = Attention(c, layer)
        self.mlp = MLP(h, c.layers[layer].intermediate_size, act=c.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(h, **norm)
        self.post_attention_layernorm = GemmaRMSNorm(h, **norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, **norm)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, **norm)
        self.moe = c.num_experts > 0
        if self.moe:
            self.router = Router(c)
            self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.hidden_activation)
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.ple = c.hidden_size_per_layer_input
        if self.ple:
            self.act = ACTIVATIONS[c.hidden_activation]
            self.per_layer_input_gate = Linear(h, self.ple, bias=False)
            self.per_layer_projection = Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps)
        if not c.gemma3:
            self.register_buffer("layer_scalar", torch.ones(1))  # in the checkpoint (a persistent buffer)

    def forward(self, x, per_layer, cos, sin, cache, start, mask):
        h = self.self_attn(self.input_layernorm(x), cos, sin, cache, start, mask)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:  # the experts see the residual stream, not the MLP's input norm
            flat = x.reshape(-1, x.shape[-1])  # [B * T, H]
            weights, index = self.router(flat)
            e = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index).reshape(x.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            h = self.act(self.per_layer_input_gate(x)) * per_layer  # [B, T, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        if hasattr(self, "layer_scalar"):
            x = x * self.layer_scalar
        return x


class TextModel(nn.Module):
    def __init__(self, c: Gemma4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # raw: the sqrt(H) scale is in forward
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=c.gemma3)
        p = c.hidden_size_per_layer_input
        if p:
            self.embed_tokens_per_layer = nn.Embedding(c.vocab_size_per_layer_input, c.num_hidden_layers * p)
            self.per_layer_model_projection = Linear(c.hidden_size, c.num_hidden_layers * p, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(p, c.rms_norm_eps)


# --- cache --------------------------------------------------------------------------------------


class Gemma4Cache:
    """Static keys/values for every layer that computes its own (shared layers read their producer's).
    Layers are grouped by KV shape (sliding and global layers may differ in head dim and KV heads), one
    `KVCache` per shape. Every layer keeps all positions, so rollback is setting the length."""

    def __init__(self, config: Gemma4Config, max_len: int, rope: dict, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, spec in enumerate(config.layers):
            if spec.kv_source == i:
                shapes.setdefault((spec.num_kv_heads, spec.head_dim), []).append(i)
        self.groups = {
            shape: KVCache(len(ids), *shape, max_len, batch=batch, dtype=dtype, device=device)
            for shape, ids in shapes.items()
        }
        # layer -> (its group's cache, slot in it); a shared layer maps to its producer's
        self.where = {}
        for shape, ids in shapes.items():
            for slot, i in enumerate(ids):
                self.where[i] = (self.groups[shape], slot)
        for i, spec in enumerate(config.layers):
            self.where[i] = self.where[spec.kv_source]
        self.rope = rope  # layer type -> (cos, sin) [n >= max_len, head_dim] for this cache's positions
        self.max_len = max_len
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache, slot = self.where[layer]
        return cache.write(slot, start, k, v)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache, slot = self.where[layer]
        return cache.k[slot, :, :, :end], cache.v[slot, :, :, :end]

    def crop(self, length: int) -> None:
        """Forget every position at or after `length` (rollback)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot crop cache of capacity {self.max_len} to {length}")
        self.length = length


# --- model --------------------------------------------------------------------------------------


class Model(nn.Module):
    """A Gemma 4 (or Gemma 3) causal LM over a static KV cache."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_load()

    def post_load(self) -> None:
        """Tie the LM head and build the rotary frequencies (again after loading onto a real device)."""
        c = self.config
        if c.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # (a head of blocks is tied already)
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_freqs = {}  # layer type -> (inverse frequencies [head_dim / 2], scale)
        for kind in sorted({s.kind for s in c.layers}):
            head_dim = next(s.head_dim for s in c.layers if s.kind == kind)
            freqs, scale = rope_frequencies(c.rope[kind], head_dim, c.max_position_embeddings)
            self.rope_freqs[kind] = (freqs.to(self.model.embed_tokens.weight.device), scale)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The raw embedding table (no sqrt(hidden) scale): what the drafter embeds block tokens with."""
        return self.model.embed_tokens

    def new_cache(self, max_len: int, batch: int = 1) -> Gemma4Cache:
        """A cache for `max_len` positions on this model's device and dtype, with the rotary tables for
        those positions (computed once, over a length rounded up to 64 so every position's cos/sin come
        from the same vectorised code path whatever the cache size)."""
        w = self.model.embed_tokens.weight  # (the LM head may be quantized)
        pos = torch.arange(-(-max_len // 64) * 64, device=w.device).float()
        rope = {}
        for kind, (freqs, scale) in self.rope_freqs.items():
            angles = pos[:, None] * freqs[None, :]
            emb = torch.cat([angles, angles], dim=-1)  # [n, head_dim]
            rope[kind] = ((emb.cos() * scale).to(w.dtype), (emb.sin() * scale).to(w.dtype))
        return Gemma4Cache(self.config, max_len, rope, batch=batch, dtype=w.dtype, device=w.device)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE [B, T, L, P]: (token-identity embedding * sqrt(P) + RMSNorm(projection of the scaled input
        embedding * hidden^-0.5)) / sqrt(2)."""
        m, c = self.model, self.config
        b, t = input_ids.shape
        p = c.hidden_size_per_layer_input
        scale = torch.tensor(p**0.5, dtype=x.dtype, device=x.device)
        token = (m.embed_tokens_per_layer(input_ids) * scale).reshape(b, t, c.num_hidden_layers, p)
        proj = m.per_layer_model_projection(x) * c.hidden_size**-0.5
        proj = m.per_layer_projection_norm(proj.reshape(b, t, c.num_hidden_layers, p))
        return (proj + token) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Gemma4Cache,
        logits: str | None = "last",
        taps: tuple[int, ...] | list[int] = (),
    ) -> Output:
        """Run `input_ids` [B, T] at positions [cache.length, cache.length + T) and advance the cache.

        `logits`: "all", "last" or None (soft-capped when the config says so). `taps`: target layer ids
        whose outputs to return (the output of layer i, i.e. transformers' hidden_states[i + 1]).
        """
        c = self.config
        start, t = cache.length, input_ids.shape[1]
        dev = input_ids.device
        positions = torch.arange(start, start + t, device=dev)
        k_pos = torch.arange(start + t, device=dev)
        masks = {}
        for kind in self.rope_freqs:
            window = c.sliding_window if kind == SLIDING else None
            # Decode (T == 1) sees every cached key, unless a window cuts the oldest off.
            need = t > 1 or (window is not None and start + t > window)
            masks[kind] = attention_mask(positions, k_pos, causal=True, window=window) if need else None
        rope = {kind: (cos[start : start + t], sin[start : start + t]) for kind, (cos, sin) in cache.rope.items()}
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        # As transformers: the scale is a tensor in the weights' dtype (sqrt(3072) becomes 55.5 in bfloat16).
        x = x * torch.tensor(c.hidden_size**0.5, dtype=x.dtype, device=dev)
        per_layer = self.per_layer_inputs(input_ids, x) if c.hidden_size_per_layer_input else None
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            ple = per_layer[:, :, i] if per_layer is not None else None
            x = layer(x, ple, *rope[layer.kind], cache, start, masks[layer.kind])
            if i in taps:
                tapped[i] = x
        cache.length = start + t
        hidden = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        out = None
        if logits == "last":
            out = self.lm_head(self.model.norm(x[:, -1:]))
        elif logits == "all":
            out = self.lm_head(self.model.norm(x))
        if out is not None and c.final_logit_softcapping:
            cap = float(c.final_logit_softcapping)
            out = torch.tanh(out / cap) * cap
        return Output(out, hidden)


def from_config(config: dict) -> Model:
    return Model(Gemma4Config.from_dict(config))


_NOT_TEXT = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
             "model.multi_modal_projector.")


def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> ours. A multimodal checkpoint keeps the language model under
    `model.language_model.` (older Gemma 3 files: `language_model.model.`); the vision and audio towers and
    their projectors are not used."""
    out = {}
    for key, value in state.items():
        if key.startswith(_NOT_TEXT) or key.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        if "rotary_emb" in key or key.endswith(".embed_scale"):
            continue
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("language_model.model."):
            key = "model." + key.removeprefix("language_model.model.")
        elif key.startswith("language_model.lm_head."):
            key = key.removeprefix("language_model.")
        out[key] = value
    return out
