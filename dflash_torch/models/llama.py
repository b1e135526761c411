"""Llama family targets: Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Module and parameter names follow the Hugging Face checkpoint keys, so a checkpoint loads with a
plain `load_state_dict`. One `forward` serves prefill, decode and block verification.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import flat
from .cache import KVCache
from .layers import MLP, Linear, RMSNorm, attend, attend_each_query, attention_mask
from .quantize import BlockEmbedding, BlockLinear
from .rope import Rotary, apply_rotary, rope_parameters

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v only
    qk_norm: bool  # Qwen3
    rope: dict = field(default_factory=dict)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    model_type: str = "llama"

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        heads = d["num_attention_heads"]
        model_type = d.get("model_type", "llama")
        window = d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=rope_parameters(d),
            sliding_window=window,
            hidden_act=d.get("hidden_act", "silu"),
            model_type=model_type,
        )


EXACT_VERIFY_MAX_T = 32  # verify blocks are at most a drafter's block (16)

class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.n_heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.attention_bias)
        # Qwen2 puts a bias on q/k/v but never on o_proj; Llama's attention_bias covers all four.
        o_bias = c.attention_bias and c.model_type not in ("qwen2",)
        self.o_proj = Linear(self.n_heads * self.head_dim, c.hidden_size, bias=o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.qk_norm = c.qk_norm
        self.scale = self.head_dim**-0.5
        # Set by quantize.py: verify passes attend one query at a time, as decode does (see
        # layers.attend_each_query). Only up to EXACT_VERIFY_MAX_T queries (a prefill is shared by
        # every mode and stays fused), and not with a sliding window (decode masks there).
        self.exact_verify = False
        self.exact_max_t: int | None = EXACT_VERIFY_MAX_T  # None: prefills too (quantize.exact_prefill)
        # Set by quantize.quantize_blocks: every pass (decode, verify, prefill) attends through the
        # query-independent kernel (kernels/attention.cpp), so each position gets the same bits in any pass
        self.exact_kernel = False
        self.no_window = c.sliding_window is None
        self.qkv_proj = None  # [q; k; v] as one layer, set by quantize.fuse_projections

    def forward(self, x, cos, sin, cache: KVCache, start: int | torch.Tensor, mask):
        b, t, _ = x.shape
        h, hkv, d = self.n_heads, self.n_kv, self.head_dim
        if self.qkv_proj is not None and not self.qk_norm:
            qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) * D]
            # q and k heads side by side: rotated in one pass (elementwise, so exactly as apart)
            qk = apply_rotary(qkv[..., : (h + hkv) * d].view(b, t, h + hkv, d).transpose(1, 2), cos, sin)
            q, k = qk[:, :h], qk[:, h:]  # [B, H, T, D], [B, Hkv, T, D]
            v = qkv[..., (h + hkv) * d :].view(b, t, hkv, d)
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], -1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(b, t, h, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
            k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        if isinstance(start, torch.Tensor):  # static shapes (cudagraph.py): start = the T positions
            k, v = cache.write_at(self.layer, start, k, v.transpose(1, 2))  # the whole cache [B, Hkv, S, D]
            return self.o_proj(attend(q, k, v, mask, self.scale))
        k, v = cache.write(self.layer, start, k, v.transpose(1, 2))  # [B, Hkv, start + T, D]
        if self.exact_kernel and b == 1:
            o = torch.ops.dflash.causal_attention(q[0].transpose(0, 1), k[0], v[0], start, self.scale, -1)
            return self.o_proj(o[None])  # [1, T, H * D]
        if k.dtype != q.dtype:  # a float16 cache (block formats) read by PyTorch's attention: widened (exact)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if self.exact_verify and 1 < t and (self.exact_max_t is None or t <= self.exact_max_t) and self.no_window:
            return self.o_proj(attend_each_query(q, k, v, start, self.scale))
        return self.o_proj(attend(q, k, v, mask, self.scale))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, act=c.hidden_act)

    def forward(self, x, cos, sin, cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Output:
    """What a forward pass returns: logits [B, T', V] for the positions asked for, the concatenated tap
    hidden states [B, T, n_taps * H] (None when no taps were asked for), and with `logits="rows"` the last
    layer's output [T, H] for `Model.head` to take the logits of any rows of it later."""

    __slots__ = ("logits", "hidden", "final")

    def __init__(self, logits: torch.Tensor | None, hidden: torch.Tensor | None,
                 final: torch.Tensor | None = None) -> None:
        self.logits, self.hidden, self.final = logits, hidden, final


class Model(nn.Module):
    """A Llama-family causal LM over a static KV cache."""

    graphable = True  # its passes can be captured as CUDA graphs (cudagraph.py)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.flat = True  # decode and one-query-at-a-time passes through `_flat` (same bits; False: modules)
        self.script = True  # `_flat` compiled by TorchScript (same bits; False: FlatLayers in Python)
        # every linear layer in block formats (q4_0 / q4_1 / q8_0): the decoder layers in one C++ call
        # (kernels/layers.cpp; same bits; False: FlatLayers)
        self.native = True
        # the KV cache's dtype (None: the weights'); quantize.quantize_blocks sets float16 where every
        # attention layer reads the cache through kernels/attention.cpp
        self.cache_dtype: torch.dtype | None = None
        self._plan = None
        self.post_load()

    def post_load(self) -> None:
        """Tie the LM head and build the rotary tables (again after loading onto a real device)."""
        c = self.config
        if c.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # (a head of blocks is tied already)
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(c.rope, c.head_dim, c.max_position_embeddings).to(self.model.embed_tokens.weight.device)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """A cache for `max_len` positions on this model's device and dtype."""
        c, w = self.config, self.model.embed_tokens.weight  # (the LM head may be quantized)
        return KVCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len,
            batch=batch, dtype=self.cache_dtype or w.dtype, device=w.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        logits: str | None = "last",
        taps: tuple[int, ...] | list[int] = (),
        positions: torch.Tensor | None = None,
        parents: list[int] | None = None,
    ) -> Output:
        """Run `input_ids` [B, T] at positions [cache.length, cache.length + T) and advance the cache.

        `logits`: "all", "last" or None, or "rows" where `defers_head(T)`: no logits, the last layer's
        output in `Output.final` for `head`. `taps`: target layer ids whose outputs to return
        (the output of layer i, i.e. transformers' hidden_states[i + 1]).
        `positions` [T] (static shapes, for CUDA graphs): run at these positions instead, attending over
        the whole cache with a mask; nothing depends on a Python int and `cache.length` is left to the caller.
        `parents` [T] (where `verifies_trees(T)`): the rows are a tree of tokens, row i the child of row
        parents[i] (parents[0] = -1; each parent before its child): each row at position cache.length + its
        depth, attending to the cache and its own ancestors, with a decode step's bits. Row i's keys/values
        are left in slot cache.length + i (`KVCache.keep_rows` moves a kept path's into place).
        """
        start, t = cache.length, input_ids.shape[1]
        if parents is not None:
            if not self.verifies_trees(t) or input_ids.shape[0] != 1 or positions is not None:
                raise ValueError("this model cannot verify a tree of tokens (block-format weights, compiled kernels)")
            return self._flat(input_ids, cache, logits, taps, parents)
        window = self.config.sliding_window
        static = positions is not None
        if self.flat and not static and input_ids.shape[0] == 1 and (
                t == 1 and (not window or start < window) or t > 1 and self._each_query(t)):
            return self._flat(input_ids, cache, logits, taps)
        if static:
            k_pos = torch.arange(cache.max_len, device=input_ids.device)
            mask = attention_mask(positions, k_pos, causal=True, window=window)  # [T, S]
            start = positions  # the layers write the cache at these positions
        else:
            positions = torch.arange(start, start + t, device=input_ids.device)
            # Decode (T == 1) sees every cached key: no mask needed unless a window cuts them off.
            mask = None
            if t > 1 or (window is not None and start + t > window):
                k_pos = torch.arange(start + t, device=input_ids.device)
                mask = attention_mask(positions, k_pos, causal=True, window=window)
        cos, sin = self.rotary(positions, self.model.embed_tokens.weight.dtype)
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, start, mask)
            if i in taps:
                tapped[i] = x
        if not static:
            cache.length = start + t
        hidden = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        if logits == "rows":
            return Output(None, hidden, x[0])
        out = None
        if logits == "last":
            out = self.lm_head(self.model.norm(x[:, -1:]))
        elif logits == "all":
            out = self.lm_head(self.model.norm(x))
        return Output(out, hidden)

    def _apply(self, fn, recurse=True):
        self._plan = None  # .to() / .half() may replace tensors the decode plan holds
        return super()._apply(fn, recurse)

    def defers_head(self, t: int) -> bool:
        """Whether a pass of t tokens can leave its LM head for later (`logits="rows"`, then `head` on any
        rows): the same bits as `logits="all"` where the head is the block kernels, whose every output row
        is computed as if alone, and the pass takes the flat path."""
        norm, head = self.model.norm, self.lm_head
        return (self.flat and t > 1 and self._each_query(t) and type(head) is BlockLinear and head.bias is None
                and type(norm) is RMSNorm and norm.kernel and norm.weight.dtype == torch.float32
                and self.model.embed_tokens.weight.dtype == torch.float32)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The logits [T, V] of the last layer's output rows x [T, H]: the final norm, then the LM head."""
        norm, head = self.model.norm, self.lm_head
        if (type(head) is BlockLinear and head.bias is None and type(norm) is RMSNorm
                and norm.kernel and x.dtype == torch.float32 and norm.weight.dtype == torch.float32):
            # the final norm inside the LM head's matmul (block_mm_norm: the same bits, one call fewer)
            return torch.ops.dflash.block_mm_norm(x, norm.weight, norm.eps, head.packed, head.code,
                                                  head.out_features, -1)
        return head(norm(x))

    def flat_serves(self) -> bool:
        """Whether `forward` takes the flat path for every pass of one sequence (no window; every query through
        the attention kernel), so that a loop may call `_flat` itself: right after a pass's matmuls, with the
        caches cold, nn.Module's call and forward's checks cost tens of microseconds (docs/performance.md, "What a
        pass costs around its kernels")."""
        return self.flat and not self.config.sliding_window and self.model.layers[0].self_attn.exact_kernel

    def verifies_trees(self, t: int) -> bool:
        """Whether a pass of t tokens can take `parents` (a tree): the flat path on the native decoder stack."""
        return self.flat and t > 1 and self._each_query(t) and isinstance(self._flat_plan(), NativeLayers)

    def _each_query(self, t: int) -> bool:
        a = self.model.layers[0].self_attn  # quantize.py sets these on every layer alike
        if a.exact_kernel:
            return True
        return a.exact_verify and (a.exact_max_t is None or t <= a.exact_max_t) and a.no_window

    def _decode_plan(self) -> nn.Module:
        # The layers as plain tensors for FlatLayers, looked up once: nn.Module attribute lookups
        # and calls cost about a microsecond each, and a decode step makes hundreds of them. quantize.py
        # drops the plan when it replaces layers (`forget_plans`).
        c = self.config
        layers = self.model.layers
        a0, m0 = layers[0].self_attn, layers[0].mlp
        fused_qkv, fused_mlp = a0.qkv_proj is not None, m0.gate_up_proj is not None
        norms, lins, qk_norms = [], [], []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            if (a.qkv_proj is not None) != fused_qkv or (mlp.gate_up_proj is not None) != fused_mlp:
                raise TypeError("no flat path for layers fused differently (quantize.fuse_projections)")
            norms += [flat.norm_weight(layer.input_layernorm), flat.norm_weight(layer.post_attention_layernorm)]
            if a.qk_norm:
                qk_norms += [flat.norm_weight(a.q_norm), flat.norm_weight(a.k_norm)]
            qkv = [a.qkv_proj] if fused_qkv else [a.q_proj, a.k_proj, a.v_proj]
            mlp_in = [mlp.gate_up_proj] if fused_mlp else [mlp.gate_proj, mlp.up_proj]
            lins += [flat.linear_spec(m) for m in (*qkv, a.o_proj, *mlp_in, mlp.down_proj)]
        act = flat.ACTIVATIONS.index(c.hidden_act)
        layers = FlatLayers(norms, qk_norms, lins, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                            float(c.rms_norm_eps), float(a0.scale), act, fused_qkv, fused_mlp, a0.exact_kernel)
        # CPU only: on CUDA TorchScript fuses elementwise operators (other bits), and CUDA graphs serve there
        cpu = self.model.embed_tokens.weight.device.type == "cpu"
        plan = flat.script(layers) if self.script and cpu else layers
        return NativeLayers(layers, plan) if self.native and cpu and NativeLayers.applies(layers) else plan

    def _flat_plan(self):
        if self._plan is None:
            self._plan = {}
        key = (self.script, self.native)
        if key not in self._plan:
            self._plan[key] = self._decode_plan()
        return self._plan[key]

    def _flat(self, input_ids: torch.Tensor, cache: KVCache, logits: str | None, taps,
              parents: list[int] | None = None) -> Output:
        # T tokens of one sequence through exactly the kernels of the layer modules above, with their
        # calls, 4-D views, checks and attribute lookups flattened out: a decode step is a few hundred
        # small operators around the matmuls, so what surrounds them is a large share of its time
        # (docs/performance.md, "A flat decode step"). Taken for decode steps, and for passes that
        # attend one query at a time (quantized verify): there every query is a decode step's
        # attention call. Same bits as the module path (`flat = False`; tests/test_fast_flat.py).
        try:
            plan = self._flat_plan()
        except TypeError as e:  # a layer type the flat path does not know: the modules, as before
            warnings.warn(f"{e}: decode steps run through the layer modules", stacklevel=2)
            self.flat = False
            return self.forward(input_ids, cache, logits, taps)
        t, pos = input_ids.shape[1], cache.length
        end = pos + t
        if end > cache.max_len:
            raise ValueError(f"KV cache overflow: position {end} > capacity {cache.max_len}")
        emb = self.model.embed_tokens
        cos, sin, signed = self.rotary.rows(pos, end, emb.weight.dtype)  # [T, 1, D] each
        # a few tokens' rows as kept (a decode step's or verify pass's), else looked up
        x = emb.rows(input_ids[0].tolist()) if type(emb) is BlockEmbedding and t <= emb.SMALL_LOOKUP \
            else emb(input_ids[0])  # [T, H]
        if parents is not None:  # each row at position pos + its depth
            rows = torch.tensor(tree_depths(parents), device=cos.device)
            cos, sin, signed = cos.index_select(0, rows), sin.index_select(0, rows), signed.index_select(0, rows)
        if type(plan) is NativeLayers:
            x, tapped = plan.run(x, cos, sin, signed, pos, cache.k, cache.v, list(taps), list(parents or ()))
        else:
            x, tapped = plan(x, cos, sin, pos, cache.k, cache.v, list(taps))
        cache.length = end
        if taps:  # tapped in layer order; the features go in the order asked for
            by_layer = dict(zip(sorted(set(taps)), tapped))
            hidden = torch.cat([by_layer[i] for i in taps], dim=-1)[None]  # [1, T, n * H]
        else:
            hidden = None
        if logits == "rows":
            return Output(None, hidden, x)
        out = self.head(x[-1:] if logits == "last" else x)[None] if logits else None  # [1, T', V]
        return Output(out, hidden)


class FlatLayers(nn.Module):
    """The decoder layers for x [T, H] of one sequence at positions pos.., writing keys/values into the
    cache and attending one query at a time: the same kernels, in the same order, as the layer modules
    (same bits), from a plan of plain tensors (`Model._decode_plan`). Runs as Python or, compiled by
    TorchScript, from its graph interpreter (`script`)."""

    def __init__(self, norms, qk_norms, lins, h: int, hkv: int, d: int, eps: float, scale: float, act: int,
                 fused_qkv: bool, fused_mlp: bool, exact_kernel: bool = False) -> None:
        super().__init__()
        self.exact_kernel = exact_kernel  # attention through kernels/attention.cpp (Attention.exact_kernel)
        self.norms, self.qk_norms, self.lins = norms, qk_norms, lins
        self.h, self.hkv, self.d, self.eps, self.scale, self.act = h, hkv, d, eps, scale, act
        self.fused_qkv, self.fused_mlp = fused_qkv, fused_mlp
        self.per_layer = (1 if fused_qkv else 3) + 1 + (1 if fused_mlp else 2) + 1  # linear layers per layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int, keys: torch.Tensor,
                values: torch.Tensor, taps: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # x [T, H]; cos/sin [T, 1, Dr]; keys/values: the cache [L, 1, Hkv, S, D]
        h, hkv, d, eps, n = self.h, self.hkv, self.d, self.eps, self.per_layer
        signed_sin = flat.signed(sin)  # [T, 1, Dr]
        tapped: list[torch.Tensor] = []
        for i in range(keys.shape[0]):
            ls = self.lins[i * n : (i + 1) * n]
            y = flat.norm(x, self.norms[2 * i], eps, self.exact_kernel)
            if self.exact_kernel and self.fused_qkv and len(self.qk_norms) == 0 and cos.shape[-1] == d:
                # rotation, cache writes and attention in one call (kernels/attention.cpp), the same bits
                # as the operators of the other branch
                attn = torch.ops.dflash.rope_attention(flat.linear(y, ls[0]), cos, signed_sin, keys[i][0],
                                                       values[i][0], pos, h, hkv, self.scale)  # [T, H * D]
            else:
                attn = self._attention(i, y, ls, cos, sin, signed_sin, pos, keys, values)
            x = flat.add_linear(x, attn, ls[-3] if self.fused_mlp else ls[-4])
            y = flat.norm(x, self.norms[2 * i + 1], eps, self.exact_kernel)
            x = flat.add_mlp(x, y, ls[-2:-1] if self.fused_mlp else ls[-3:-1], ls[-1], self.act)
            if i in taps:
                tapped.append(x)
        return x, tapped

    def _attention(self, i: int, y: torch.Tensor, ls: list[flat.LinearSpec], cos: torch.Tensor, sin: torch.Tensor,
                   signed_sin: torch.Tensor, pos: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Layer i's attention output [T, H * D] from its normed input y [T, H], writing the cache."""
        t, h, hkv, d, eps = y.shape[0], self.h, self.hkv, self.d, self.eps
        nqk = (h + hkv) * d
        if self.fused_qkv and len(self.qk_norms) == 0:  # q and k heads rotated in one pass, as Attention does
            qkv = flat.linear(y, ls[0])  # [T, (H + 2 Hkv) * D]
            qk = flat.rotate(qkv[:, :nqk].view(t, h + hkv, d), cos, sin, signed_sin)  # [T, H + Hkv, D]
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, nqk:].view(t, hkv, d)
        else:
            if self.fused_qkv:
                parts = flat.linear(y, ls[0]).split([h * d, hkv * d, hkv * d], -1)
                q, k, v = parts[0], parts[1], parts[2]
            else:
                q, k, v = flat.linear(y, ls[0]), flat.linear(y, ls[1]), flat.linear(y, ls[2])
            q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if len(self.qk_norms) > 0:
                q, k = (flat.norm(q, self.qk_norms[2 * i], eps, self.exact_kernel),
                        flat.norm(k, self.qk_norms[2 * i + 1], eps, self.exact_kernel))
            q, k = flat.rotate(q, cos, sin, signed_sin), flat.rotate(k, cos, sin, signed_sin)
        layer_k, layer_v = keys[i], values[i]  # [1, Hkv, S, D]
        layer_k.narrow(2, pos, t).copy_(k.transpose(0, 1))
        layer_v.narrow(2, pos, t).copy_(v.transpose(0, 1))
        if self.exact_kernel:
            attn = torch.ops.dflash.causal_attention(q, layer_k[0], layer_v[0], pos, self.scale, -1)  # [T, H * D]
        else:
            q1 = q.unsqueeze(2)  # [T, H, 1, D]: query j is a [1, H, 1, D] slice, as a decode step's query
            o = [F.scaled_dot_product_attention(q1.narrow(0, j, 1), layer_k.narrow(2, 0, pos + j + 1),
                                                layer_v.narrow(2, 0, pos + j + 1), scale=self.scale,
                                                enable_gqa=hkv != h)
                 for j in range(t)]  # T x [1, H, 1, D]
            attn = o[0].view(1, h * d) if t == 1 else torch.cat(o, dim=2).transpose(1, 2).reshape(t, h * d)
        return attn


class NativeLayers:
    """FlatLayers' path for layers whose linear layers are all block formats, fused q/k/v and gate/up, full
    rotary, no q/k norms and float32 activations, in one call of kernels/layers.cpp: the same operators in
    the same order (same bits, tests/test_fast_flat.py), without the few microseconds of dispatch each of a
    decode step's few hundred operators costs from Python or TorchScript. `fallback` (FlatLayers, maybe
    scripted) serves any other pass."""

    def __init__(self, layers: FlatLayers, fallback) -> None:
        self.layers, self.fallback = layers, fallback
        self.norms = list(layers.norms)
        self.packed = [spec[1] for spec in layers.lins]
        self.codes = [spec[4] for spec in layers.lins]  # 8 * out_features + format
        self.biases = [spec[3] for spec in layers.lins]

    @staticmethod
    def applies(layers: FlatLayers) -> bool:
        from .. import kernels

        return (layers.exact_kernel and layers.fused_qkv and layers.fused_mlp and not layers.qk_norms
                and all(spec[0] == flat.BLOCK for spec in layers.lins) and kernels.ensure() == "compiled")

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int, keys: torch.Tensor,
                 values: torch.Tensor, taps: list[int],
                 parents: list[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.run(x, cos, sin, flat.signed(sin), pos, keys, values, taps, list(parents))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed_sin: torch.Tensor, pos: int,
            keys: torch.Tensor, values: torch.Tensor, taps: list[int],
            parents: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`__call__` with the signed sine given (`Rotary.rows` keeps it)."""
        f = self.layers
        if x.dtype != torch.float32 or cos.shape[-1] != f.d:
            if parents:
                raise ValueError("a tree pass takes float32 activations and full rotary")
            return self.fallback(x, cos, sin, pos, keys, values, taps)
        return torch.ops.dflash.decoder_stack(x, cos, signed_sin, pos, keys, values, taps, self.norms, self.packed,
                                              self.codes, self.biases, f.eps, f.h, f.hkv, f.scale, f.act, parents)


def tree_depths(parents: list[int]) -> list[int]:
    """Each row's depth in a tree given by its parents (parents[0] = -1, each parent before its child)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        if not 0 <= parents[i] < i:
            raise ValueError(f"row {i}'s parent {parents[i]} does not come before it")
        depth[i] = depth[parents[i]] + 1
    return depth


# For TorchScript, which cannot read string annotations (this file's are) nor infer the type of an empty
# list or an Optional from a list that holds no None.
FlatLayers.__annotations__ = {"lins": list[flat.LinearSpec],
                              "norms": list[torch.Tensor], "qk_norms": list[torch.Tensor]}


def from_config(config: dict) -> Model:
    return Model(LlamaConfig.from_dict(config))


def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> ours (they are the same; rotary tables are recomputed, never loaded)."""
    return {k: v for k, v in state.items() if "rotary_emb" not in k}
