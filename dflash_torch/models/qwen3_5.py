"""Qwen3.5 / Qwen3.6 dense text targets: Gated DeltaNet (linear attention) layers interleaved with gated
full-attention layers (transformers `qwen3_5_text`, and the language model of the multimodal `qwen3_5`).

Module and parameter names follow the Hugging Face checkpoint keys. One `forward` serves prefill, decode
and block verification. What differs from the Llama family:

* Most layers are Gated DeltaNet: a causal depthwise conv over the q/k/v projections, then the gated
  delta rule, whose state is a [Dk, Dv] matrix per value head. Its state has no position axis, so it
  cannot be rolled back by setting a length: `HybridCache` records what a forward pass needs to restore
  it exactly (see `HybridCache` for how, and for the measurement that chose how).
* Every 4th layer is full attention with a sigmoid output gate folded into q_proj, q/k RMSNorm and
  rotary embedding on the first quarter of each head only (partial rotary).
* RMSNorms are zero-centred: they scale by (1 + weight), computed in float32 before the cast back.

The delta rule has a plain recurrent form (one step per token: the reference, used for decode and
verify, and the only form that yields the state after every token) and a chunked form for long
prefills (matrix products over chunks of 64 tokens; flash-linear-attention's kernel when it is
installed and the model is on CUDA). `test_families.py` checks that the forms agree.

The mixture-of-experts variants (`qwen3_5_moe`) are this stack with sparse MLPs: `qwen3_5_moe.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .layers import ACTIVATIONS, MLP, Linear, attend, attention_mask
from .llama import Output
from .rope import Rotary, apply_rotary, rope_parameters

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

# Passes of at most this many tokens run the recurrent form, which keeps what rollback needs; longer
# passes (prefill) run the chunked form and can only be cropped to their start or end.
RECURRENT_MAX_TOKENS = 64
CHUNK = 64  # chunk length of the chunked form (the value transformers and fla use)

# How `HybridCache.crop` restores the recurrent state inside the last pass. Measured on CPU (torch 2.13,
# float32, 1 thread, 2 cores shared with other jobs) on a 12-layer config (9 Gated DeltaNet layers, hidden
# 256, 4 key / 8 value heads of 64 dims): a 16-token verify pass, then crop to a random accepted length in
# 0..16, 200 cycles per mode, interleaved; medians of two runs:
#   "keep"   (retain the state after every step; crop picks one)        62.6 / 74.2 ms per cycle, crop 0.05 ms
#   "replay" (retain the state before the pass; crop re-runs the steps)  65.2 / 76.2 ms per cycle, crop 5.9 / 7.5 ms
# The recurrent form computes every per-step state anyway, so keeping them costs no arithmetic, only memory
# while the pass is the last one (a slightly slower verify: the allocator cannot reuse those buffers): T
# states per layer, 16 x 128 KiB x 9 = 18 MiB here, but about 2.4 GB in float32 for a 27B model at T = 16,
# where "replay" keeps only the step inputs. "keep" is cheaper in time, so it is the default; "replay" stays
# as the low-memory choice (`new_cache(..., rollback="replay")`), and a test checks both give the same bits.
ROLLBACK = "keep"


@dataclass
class Qwen35Config:
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
    attention_bias: bool
    layer_types: list[str]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rotary_dim: int
    rope: dict = field(default_factory=dict)
    hidden_act: str = "silu"
    model_type: str = "qwen3_5_text"

    @classmethod
    def from_dict(cls, d: dict) -> Qwen35Config:
        """From a config.json: text-only (`qwen3_5_text`) or multimodal (`qwen3_5`, settings in text_config)."""
        model_type = d.get("model_type", "qwen3_5_text")
        text = d.get("text_config") or d
        n_layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
            interval = text.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        rope = rope_parameters(text)
        # mrope (mrope_section, mrope_interleaved) only matters for image/video positions: for text every
        # section sees the same position, which is plain rotary on the first `rotary_dim` dims.
        if rope.get("rope_type") == "mrope":  # the older spelling of the same thing
            rope["rope_type"] = "default"
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        # The multimodal model ties its LM head by the top-level flag (transformers reads that config).
        tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text.get("intermediate_size") or 0,  # 0: MoE models have none
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
            layer_types=list(layer_types),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_num_key_heads=text.get("linear_num_key_heads", 16),
            linear_num_value_heads=text.get("linear_num_value_heads", 32),
            rotary_dim=int(head_dim * partial),
            rope=rope,
            hidden_act=text.get("hidden_act", "silu"),
            model_type=model_type,
        )


# --- norms --------------------------------------------------------------------------------------


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5 RMSNorm: the weight is stored zero-centred and applied as (1 + weight), in float32,
    before the cast back (Llama casts first, then scales)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: RMSNorm (plain weight) per value head, then times silu(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


# --- the gated delta rule -----------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the normalisation fla and transformers use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_delta_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """To the layout both forms use: float32, heads first, q/k L2-normalised and repeated to the value
    heads (each key head serves Hv / Hk consecutive value heads), q scaled by Dk^-0.5.

    q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g/beta [B, T, Hv] -> q, k [B, Hv, T, Dk], v [B, Hv, T, Dv], g/beta [B, Hv, T]
    """
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def delta_rule_recurrent(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule one token at a time (the reference form). Inputs as `prepare_delta_inputs`
    returns them; state [B, Hv, Dk, Dv] float32 (not modified).

    Per token: S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
    Returns the outputs [B, T, Hv, Dv] float32 (None when q is None: replaying the state only), the
    final state, and the state after every token when `keep_states`.
    """
    outs, states = [], []
    for t in range(k.shape[2]):
        k_t = k[:, :, t]  # [B, H, Dk]
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = torch.matmul(k_t.unsqueeze(-2), state).squeeze(-2)  # [B, H, Dv]: what S already predicts for k
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)  # [B, H, Dk, Dv]
        if q is not None:
            outs.append(torch.matmul(q[:, :, t].unsqueeze(-2), state).squeeze(-2))
        if keep_states:
            states.append(state)
    out = torch.stack(outs, dim=1) if q is not None else None
    return out, state, states


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over chunks of `CHUNK` tokens (the WY / UT-transform form of transformers' torch path):
    within a chunk the T sequential rank-1 updates become one triangular solve and a few matmuls.
    Inputs as `delta_rule_recurrent`; returns outputs [B, T, Hv, Dv] float32 and the final state."""
    b, h, t, dk = k.shape
    pad = (CHUNK - t % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))  # padded steps: g = 0 (no decay), beta = 0 (no write)
    n = (t + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v_beta, k_beta = (x.reshape(b, h, n, CHUNK, x.shape[-1]) for x in (q, k, v_beta, k_beta))
    g = g.reshape(b, h, n, CHUNK).cumsum(-1)  # log of the decay from the chunk start to each position
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [.., i, j]: j -> i
    # Solve (I + strictly_lower(beta K K^T decay)) [u, w] = [beta V, beta K exp(g)]: u are the values the
    # chunk writes (before correcting for the incoming state), w the decayed keys that read that state.
    # (unitriangular: the solver reads only the strictly lower part and takes the diagonal as 1)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # causal q.k inside the chunk (decay is 0 above the diagonal)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # the part of each write the incoming state does not predict
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * CHUNK, -1)[:, :, :t]
    return out.transpose(1, 2), state


_FLA = None  # fla's chunk kernel once imported; False when it is not installed


def _fla_chunk():
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            _FLA = chunk_gated_delta_rule
        except Exception:  # not installed, or installed without a working triton
            _FLA = False
    return _FLA or None


# --- layers -------------------------------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer: in_proj_qkv -> causal depthwise conv + silu -> gated delta rule ->
    gated RMSNorm (gate = in_proj_z) -> out_proj. beta = sigmoid(in_proj_b), the per-token write strength;
    g = -exp(A_log) softplus(in_proj_a + dt_bias), the per-token log decay of the state."""

    def __init__(self, c: Qwen35Config, slot: int) -> None:
        super().__init__()
        self.slot = slot  # index among the Gated DeltaNet layers (its conv/recurrent state in the cache)
        self.n_k, self.n_v = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = c.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)  # only its weight [C, 1, K] is used
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)
        self.in_proj_qkv = Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(c.hidden_size, self.n_v, bias=False)
        self.in_proj_a = Linear(c.hidden_size, self.n_v, bias=False)
        self.act = ACTIVATIONS[c.hidden_act]

    def conv(self, window: torch.Tensor, t: int) -> torch.Tensor:
        """Causal depthwise conv of the last t steps of window [B, K - 1 + t, C] -> [B, t, C], tap by tap:
        each output is the same K products summed in the same order whatever t is. Accumulated in float32
        and rounded once, like a conv kernel (this matters in bfloat16 only)."""
        w = self.conv1d.weight[:, 0, :].float()  # [C, K]
        x = window.float()
        out = x[:, 0:t] * w[:, 0]
        for j in range(1, self.kernel):
            out = out + x[:, j : j + t] * w[:, j]
        return self.act(out.to(window.dtype))

    def forward(self, x: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        b, t, _ = x.shape
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        z = self.in_proj_z(x).view(b, t, self.n_v, self.dv)
        beta = self.in_proj_b(x).sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [B, T, Hv]
        window = torch.cat([cache.conv[self.slot], mixed], dim=1)  # [B, K - 1 + T, C]: conv state, then the new
        qkv = self.conv(window, t)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.n_k, self.dk)
        k = k.reshape(b, t, self.n_k, self.dk)
        v = v.reshape(b, t, self.n_v, self.dv)
        state = cache.recurrent[self.slot]  # [B, Hv, Dk, Dv] float32
        fla = _fla_chunk() if x.is_cuda and t > RECURRENT_MAX_TOKENS else None
        if fla is not None:
            groups = self.n_v // self.n_k
            out, final = fla(
                q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2), v, g=g, beta=beta,
                initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
            cache.record(self.slot, window, state, final.float(), t)
        else:
            qf, kf, vf, gf, bf = prepare_delta_inputs(q, k, v, g, beta)
            if t > RECURRENT_MAX_TOKENS:
                out, final = delta_rule_chunked(qf, kf, vf, gf, bf, state)
                cache.record(self.slot, window, state, final, t)
            else:
                keep = cache.rollback == "keep"
                out, final, states = delta_rule_recurrent(qf, kf, vf, gf, bf, state, keep_states=keep)
                cache.record(self.slot, window, state, final, t, states if keep else (kf, vf, gf, bf))
        out = self.norm(out.to(x.dtype), z)  # [B, T, Hv, Dv]
        return self.out_proj(out.reshape(b, t, self.value_dim))


class Attention(nn.Module):
    """Full attention with q/k RMSNorm, partial rotary, and an output gate: q_proj emits [query; gate]
    per head, and the attention output is multiplied by sigmoid(gate) before o_proj."""

    def __init__(self, c: Qwen35Config, slot: int) -> None:
        super().__init__()
        self.slot = slot  # index among the attention layers (its slice of the KV cache)
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = Linear(c.hidden_size, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, cache: HybridCache, start: int, mask):
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, t, self.n_heads * self.head_dim)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rotary(self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        k, v = cache.kv.write(self.slot, start, k, v)  # [B, Hkv, start + T, D]
        out = attend(q, k, v, mask, self.scale)  # [B, T, H * D]
        return self.o_proj(out * torch.sigmoid(gate))


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen35Config, layer: int, slot: int) -> None:
        super().__init__()
        self.is_linear = c.layer_types[layer] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, slot)
        else:
            self.self_attn = Attention(c, slot)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, act=c.hidden_act)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start, mask):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, cache) if self.is_linear else self.self_attn(h, cos, sin, cache, start, mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, c: Qwen35Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        slots = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(c.layer_types):
            if kind not in slots:
                raise ValueError(f"unknown Qwen3.5 layer type {kind!r}")
            layers.append(DecoderLayer(c, i, slots[kind]))
            slots[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)


# --- cache --------------------------------------------------------------------------------------


class _PassRecord:
    """What one Gated DeltaNet layer's last forward pass leaves for rollback."""

    __slots__ = ("window", "before", "final", "steps", "per_step")

    def __init__(self, window, before, final, steps, per_step) -> None:
        self.window = window  # [B, K - 1 + T, C]: the conv state before the pass, then the pass's conv inputs
        self.before = before  # recurrent state before the pass
        self.final = final  # ... and after it
        self.steps = steps  # T
        self.per_step = per_step  # list of T states ("keep"), (k, v, g, beta) ("replay"), or None (chunked)


class HybridCache:
    """The cache of a Qwen3.5 model: static keys/values for the full-attention layers (rolled back by
    length, like `KVCache`), and for each Gated DeltaNet layer its conv state (the last K - 1 conv inputs)
    and recurrent state (float32, as transformers and fla keep it).

    The conv and recurrent states have no position axis, so each forward pass records, per layer, what
    `crop` needs to put them back exactly as they were after any number of the pass's tokens: the conv
    window (old state + new inputs; the state after `a` tokens is a slice of it) and the recurrent state
    before the pass plus either every per-step state (rollback="keep") or the step inputs to replay the
    first `a` steps ("replay"). Rollback is therefore possible to any length inside the last pass (one of
    at most RECURRENT_MAX_TOKENS tokens; a longer, chunked pass only to its start or end), not further back.
    """

    def __init__(
        self,
        config: Qwen35Config,
        max_len: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rollback: str | None = None,
    ) -> None:
        c = config
        n_attn = sum(t == "full_attention" for t in c.layer_types)
        n_lin = len(c.layer_types) - n_attn
        self.kv = KVCache(n_attn, c.num_key_value_heads, c.head_dim, max_len, batch=batch, dtype=dtype, device=device)
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim
        conv_dim += c.linear_num_value_heads * c.linear_value_head_dim
        self.conv = [
            torch.zeros(batch, c.linear_conv_kernel_dim - 1, conv_dim, dtype=dtype, device=device) for _ in range(n_lin)
        ]  # [B, K - 1, C] each
        state = (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.recurrent = [torch.zeros(state, dtype=torch.float32, device=device) for _ in range(n_lin)]
        self.cos, self.sin = cos, sin  # [max_len, rotary_dim] rotary tables for this cache's positions
        self.max_len = max_len
        self.length = 0
        self.rollback = rollback or ROLLBACK
        if self.rollback not in ("keep", "replay"):
            raise ValueError(f"rollback must be 'keep' or 'replay', not {self.rollback!r}")
        self._pass = (0, 0)  # (start, T) of the last forward pass
        self._records: list[_PassRecord | None] = [None] * n_lin

    def begin(self, start: int, t: int) -> None:
        """Called by the model before a pass over positions [start, start + t)."""
        if start + t > self.max_len:
            raise ValueError(f"cache overflow: position {start + t} > capacity {self.max_len}")
        self._pass = (start, t)

    def record(self, slot: int, window, before, final, steps: int, per_step=None) -> None:
        """Called by a Gated DeltaNet layer after its pass: new states, and what rollback needs."""
        k1 = window.shape[1] - steps
        self.conv[slot] = window[:, steps : steps + k1]
        self.recurrent[slot] = final
        self._records[slot] = _PassRecord(window, before, final, steps, per_step)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions: keys/values by length, the conv and recurrent states as a
        pass over exactly those positions leaves them. `length` must lie inside the last pass."""
        if length == self.length:
            return
        start, steps = self._pass
        a = length - start
        if length > self.length or not 0 <= a <= steps:
            raise ValueError(
                f"cannot crop to {length}: a hybrid cache rolls back only within its last forward pass "
                f"(lengths {start}..{start + steps})"
            )
        for slot, r in enumerate(self._records):
            if r is None:
                continue
            k1 = r.window.shape[1] - r.steps
            self.conv[slot] = r.window[:, a : a + k1]
            self.recurrent[slot] = self._state_after(r, a)
        self.length = length

    def can_crop(self, length: int) -> bool:
        """Whether `crop(length)` can put the state back exactly (without doing it)."""
        if length == self.length:
            return True
        start, steps = self._pass
        a = length - start
        if length > self.length or not 0 <= a <= steps:
            return False
        return all(r is None or a in (0, r.steps) or r.per_step is not None for r in self._records)

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the conv and recurrent states (no position axis): what `restore` needs to come back
        to this length later, after other passes (a prefix cache keeps one per prompt)."""
        return [c.clone() for c in self.conv], [r.clone() for r in self.recurrent]

    def restore(self, length: int, state: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        """Go back to `length` positions, with the conv/recurrent `state` that `state()` saved there."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot restore to {length}: the cache holds {self.length} positions")
        self.conv = [c.clone() for c in state[0]]  # copies: the saved state may be restored again
        self.recurrent = [r.clone() for r in state[1]]
        self._pass = (length, 0)
        self._records = [None] * len(self._records)
        self.length = length

    def _state_after(self, r: _PassRecord, a: int) -> torch.Tensor:
        if a == 0:
            return r.before
        if a == r.steps:
            return r.final
        if r.per_step is None:
            raise ValueError(
                f"cannot roll back into a pass of {r.steps} tokens: only passes of at most "
                f"{RECURRENT_MAX_TOKENS} tokens keep their per-token recurrent states"
            )
        if isinstance(r.per_step, list):  # "keep"
            return r.per_step[a - 1]
        k, v, g, beta = r.per_step  # "replay": the same steps, from the same state, so the same bits
        return delta_rule_recurrent(None, k[:, :, :a], v[:, :, :a], g[:, :, :a], beta[:, :, :a], r.before)[1]


# --- model --------------------------------------------------------------------------------------


class Model(nn.Module):
    """A Qwen3.5 / Qwen3.6 dense causal LM over a `HybridCache`."""

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_load()

    def post_load(self) -> None:
        """Tie the LM head and build the rotary frequencies (again after loading onto a real device)."""
        c = self.config
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(c.rope, c.rotary_dim, c.max_position_embeddings).to(self.model.embed_tokens.weight.device)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def new_cache(self, max_len: int, batch: int = 1, rollback: str | None = None) -> HybridCache:
        """A cache for `max_len` positions on this model's device and dtype. The rotary table for those
        positions is computed here once, over a length rounded up to 64 so that every position's cos/sin
        come out of the same vectorised code path (the same bits, whatever the pass length)."""
        w = self.model.embed_tokens.weight  # (the LM head may be quantized)
        n = -(-max_len // 64) * 64
        cos, sin = self.rotary(torch.arange(n, device=w.device), w.dtype)  # [n, rotary_dim]
        return HybridCache(self.config, max_len, cos, sin, batch=batch, dtype=w.dtype, device=w.device,
                           rollback=rollback)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HybridCache,
        logits: str | None = "last",
        taps: tuple[int, ...] | list[int] = (),
    ) -> Output:
        """Run `input_ids` [B, T] at positions [cache.length, cache.length + T) and advance the cache.

        `logits`: "all", "last" or None. `taps`: target layer ids whose outputs to return
        (the output of layer i, i.e. transformers' hidden_states[i + 1]).
        """
        start, t = cache.length, input_ids.shape[1]
        cache.begin(start, t)
        positions = torch.arange(start, start + t, device=input_ids.device)
        cos, sin = cache.cos[start : start + t], cache.sin[start : start + t]
        mask = None  # decode (T == 1) sees every cached key
        if t > 1:
            mask = attention_mask(positions, torch.arange(start + t, device=input_ids.device), causal=True)
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, start, mask)
            if i in taps:
                tapped[i] = x
        cache.length = start + t
        hidden = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        out = None
        if logits == "last":
            out = self.lm_head(self.model.norm(x[:, -1:]))
        elif logits == "all":
            out = self.lm_head(self.model.norm(x))
        return Output(out, hidden)


def from_config(config: dict) -> Model:
    text = config.get("text_config") or config
    if text.get("num_experts") or not text.get("intermediate_size"):
        raise ValueError(f"{config.get('model_type')!r} with experts: a mixture-of-experts model (qwen3_5_moe)")
    return Model(Qwen35Config.from_dict(config))


def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> ours. A multimodal checkpoint keeps the language model under
    `model.language_model.`; its vision tower (`model.visual.`) and the multi-token-prediction head
    (`mtp.`) are not used."""
    out = {}
    for key, value in state.items():
        if key.startswith(("mtp.", "model.visual.")) or "rotary_emb" in key:
            continue
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        out[key] = value
    return out
