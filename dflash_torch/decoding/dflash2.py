"""DFlash2 drafters, in the published checkpoint format (`architectures` ["DFlash2DraftModel"]).

DFlash2 is the first DFlash format (drafter.py) plus two things:

- a grouped dynamic causal convolution before and after the attention and the MLP of every layer
  (`DynamicConv`): along the block only, K taps (the current position and the K - 1 before it), each
  channel's kernel a learned base plus a value computed from the sublayer's input, shared by a group
  of G channels;
- a candidate selector (`CandidateSelector`) that picks the drafted tokens from the top k of each
  position's logits, one position after the other: a token's score is its logit plus a low-rank
  interaction between the previous drafted token, the position's hidden state and the candidate.

The context path (fc, hidden_norm, the context keys/values), the attention, the cache and the LM head
are the first format's. Extra checkpoint keys (H hidden, K kernel size, G group size, r rank, V vocab):
  layers.N.{attention_conv,mlp_conv}.base_kernel [2, K, H], layers.N.{...}.kernel_projection.weight
  [2 * K * H / G, H], candidate_selector.hidden_projection.weight [r, H],
  candidate_selector.{predecessor,successor}_codebook [V, r] (bare tensors, no `.weight`)
with `dflash_config` keys conv_kernel_size, conv_group_size, selector_rank, selector_top_k (required)
and the target_layer_ids (required: none are derived).

The speculative loop calls `DFlash2Drafter.select` instead of `Sampler.draft`: greedy, the selector's
sequential argmax; sampling, a draw from the softmax of the selector's scores at each position, whose
distribution (scattered onto the vocabulary) is the q of rejection sampling, so output stays exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from .. import kernels
from ..models.cache import KVCache
from ..models.layers import Linear
from .drafter import Blocks, DFlashDrafter, DraftLayer, dflash_value

ARCHITECTURE = "DFlash2DraftModel"
SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


class DynamicConv(nn.Module):
    """The grouped dynamic causal convolution around one sublayer (`prepare` before it, `finish` after).

    For the sublayer input u [.., L, H], `kernel_projection(u)` viewed [.., L, 2, K, H / G] holds two
    dynamic kernels per position: [:, 0] for `prepare`, [:, 1] kept for `finish` (so the post-sublayer
    kernel comes from the sublayer's input, not its output). Applied to a signal v with base kernel b:
        out[t, ch] = sum over o < K of (b[o, ch] + dyn[t, o, ch // G]) * v[t - o, ch]
    with v before the first position (of the block, or of each `segment` positions) taken as 0.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden % group_size:
            raise ValueError(f"a DFlash2 convolution needs kernel size >= 1 and a group size dividing the hidden "
                             f"size {hidden}, got {kernel_size} and {group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))  # [2, K, H]
        self.base_kernel.data[:, 0] = 1.0  # a fresh convolution passes the current position through
        self.kernel_projection = Linear(hidden, 2 * kernel_size * hidden // group_size, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, u: torch.Tensor, segment: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, L, H] -> (its convolution [B, L, H], the dynamic kernel `finish` takes [B, L, K, H / G])."""
        k, groups = self.kernel_size, u.shape[-1] // self.group_size
        dyn = self.kernel_projection(u).view(*u.shape[:-1], 2, k, groups)  # [B, L, 2, K, H / G]
        return self._convolve(u, self.base_kernel[0], dyn[..., 0, :, :], segment), dyn[..., 1, :, :]

    def finish(self, v: torch.Tensor, dyn: torch.Tensor, segment: int | None = None) -> torch.Tensor:
        """The sublayer's output v [B, L, H] convolved with `prepare`'s second kernel dyn [B, L, K, H / G]."""
        return self._convolve(v, self.base_kernel[1], dyn, segment)

    def _convolve(self, v: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, segment: int | None) -> torch.Tensor:
        # v [B, L, H]; base [K, H]; dyn [B, L, K, H / G]. Channels as [H / G, G]: a group's G channels
        # share one dynamic value, which then broadcasts instead of being repeated.
        b, length, h = v.shape
        groups, g = h // self.group_size, self.group_size
        v4 = v.view(b, length, groups, g)
        kernel = base.view(self.kernel_size, groups, g) + dyn.unsqueeze(-1)  # [B, L, K, H / G, G]
        out = kernel[:, :, 0] * v4
        for o in range(1, min(self.kernel_size, length)):
            before = torch.cat([v4.new_zeros(b, o, groups, g), v4[:, : length - o]], dim=1)  # v[t - o]
            if segment is not None and segment < length:  # training: blocks side by side, none sees another
                first = torch.arange(length, device=v.device) % segment < o
                before = before.masked_fill(first[None, :, None, None], 0.0)
            out = out + kernel[:, :, o] * before
        return out.view(b, length, h)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers (its children's too), as `.parameters()` and `.buffers()` list them."""
    if module._modules:
        return [*module.parameters(), *module.buffers()]
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _is_identity(conv: DynamicConv) -> bool:
    """Whether `conv` passes its input through unchanged: out = 1 * v[t] + 0 * v[t - o], exactly v."""
    base = conv.base_kernel.detach()
    return bool((base[:, 0] == 1).all() and (base[:, 1:] == 0).all() and (conv.kernel_projection.weight == 0).all())


def first_format_config(config: dict) -> dict:
    """A DFlash2 drafter's config.json as the first format's: its architecture, without the convolutions' and the
    selector's settings."""
    config = {k: v for k, v in config.items() if k not in SETTINGS}
    config["architectures"] = ["DFlashDraftModel"]
    config["dflash_config"] = {k: v for k, v in (config.get("dflash_config") or {}).items() if k not in SETTINGS}
    return config


class DFlash2Layer(DraftLayer):
    """A first-format draft layer with a `DynamicConv` around its attention and one around its MLP:
        x, d = attention_conv.prepare(input_layernorm(h));  h = h + attention_conv.finish(attn(x, c), d)
        y, e = mlp_conv.prepare(post_attention_layernorm(h));  h = h + mlp_conv.finish(mlp(y), e)
    The context c reaches the attention's keys/values as in the first format: never convolved."""

    def __init__(self, c: dict, layer: int) -> None:
        super().__init__(c, layer)
        k, g = int(dflash_value(c, "conv_kernel_size")), int(dflash_value(c, "conv_group_size"))
        self.attention_conv = DynamicConv(c["hidden_size"], k, g)
        self.mlp_conv = DynamicConv(c["hidden_size"], k, g)

    def forward(self, x, ctx, q_rope, ctx_rope, q_pos, k_pos, cache, extra_mask, ctx_kv=None):
        # The convolutions run along each block: a training pass of blocks side by side (Blocks) restarts
        # them every block_size positions; a dense training mask does not say where blocks start.
        segment = extra_mask.block_size if isinstance(extra_mask, Blocks) else None
        if extra_mask is not None and segment is None:
            raise ValueError("a DFlash2 drafter's convolutions need to know where blocks start: pass Blocks")
        u, post = self.attention_conv.prepare(self.input_layernorm(x), segment)
        a = self.self_attn(u, ctx, q_rope, ctx_rope, q_pos, k_pos, cache, extra_mask, ctx_kv)
        x = x + self.attention_conv.finish(a, post, segment)
        y, post = self.mlp_conv.prepare(self.post_attention_layernorm(x), segment)
        return x + self.mlp_conv.finish(self.mlp(y), post, segment)


class Selection(NamedTuple):
    """What the selector chose for K positions from k candidates each."""

    tokens: torch.Tensor  # [K] the drafted tokens
    candidates: torch.Tensor  # [K, k] token ids, in descending logit order
    scores: torch.Tensor  # [K, k] float32: each candidate's score given the tokens chosen before it
    probs: torch.Tensor | None  # [K, k] float32: the distribution each token was drawn from (sampling)


class CandidateSelector(nn.Module):
    """Picks the drafted tokens from the top k logits of each position, one position after the other.

    With P = predecessor_codebook, S = successor_codebook [V, r] and p_j = hidden_projection(h_j) [r]
    for the drafter's hidden state h_j at position j, candidate m of position j scores
        score[j, m] = logit[j, cand[j, m]] + sum over r of P[pred, r] * p_j[r] * S[cand[j, m], r]
    where pred is the token chosen at position j - 1 (the block's anchor for the first).
    """

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int) -> None:
        super().__init__()
        if rank < 1 or top_k < 1:
            raise ValueError(f"a DFlash2 selector needs rank >= 1 and top_k >= 1, got {rank} and {top_k}")
        self.top_k = top_k
        self.hidden_projection = Linear(hidden, rank, bias=False)
        # Stored as bare tensors in the published checkpoints (embedding tables, looked up by token id);
        # zeros: a fresh selector adds nothing to the logits, so it drafts their argmax.
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: int, temperature: float = 0.0,
                draw=None) -> Selection:
        """Choose K tokens from logits [K, V] given the drafter's hidden states hidden [K, H] at those
        positions and the token before the first. temperature 0: the argmax of each score; else each
        token is drawn by `draw` (probs [1, k] -> index [1]) from softmax(score / temperature)."""
        n = logits.shape[0]
        unary, cand = logits.float().topk(min(self.top_k, logits.shape[-1]), dim=-1)  # [K, k], descending
        if n == 0:
            return Selection(cand[:, 0], cand, unary, unary if temperature > 0 else None)
        proj = self.hidden_projection(hidden).float()  # [K, r]
        succ = self.successor_codebook[cand].float() * proj[:, None]  # [K, k, r]: p_j * S[cand[j, m]]
        # The interaction for every pair (candidate m' of position j - 1, candidate m of position j) in one
        # batched matmul; the sequential pass below then only picks rows of it.
        first = succ[0] @ self.predecessor_codebook[anchor].float()  # [k]
        pairs = self.predecessor_codebook[cand[:-1]].float() @ succ[1:].transpose(1, 2)  # [K - 1, k, k]
        score = unary[0] + first
        scores, picks, probs = [], [], []
        for j in range(n):
            scores.append(score)
            if temperature > 0:
                pj = (score / temperature).softmax(-1)  # [k]
                probs.append(pj)
                m = draw(pj[None])[0]
            else:
                m = score.argmax()
            picks.append(m)
            if j + 1 < n:
                score = unary[j + 1] + pairs[j, m]
        index = torch.stack(picks)[:, None]  # [K, 1]
        return Selection(cand.gather(1, index)[:, 0], cand, torch.stack(scores),
                         torch.stack(probs) if probs else None)

    @torch.no_grad()
    def transitions(self, probs: torch.Tensor, cand: torch.Tensor, hidden: torch.Tensor,
                    anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's chances for a tree of candidates (trees.best_shape): probs [K, k] the drafter's own
        softmax at candidates cand [K, k] (token ids, best first), hidden [K, H] -> (first [k]: each candidate
        of position 1 given the anchor, trans [K - 1, k, k]: candidate m of position j + 1 given candidate q
        of position j). Each row is the selector's softmax over the candidates, times the drafter's mass on
        them (the chance that the target's token is one of them), so that without an interaction term
        (a fresh selector) they are the drafter's own probabilities."""
        # kernels/selector.cpp (kernels/reference.py: the same in torch operators), position 1's rows all given the
        # anchor: one call where a dozen operators cost a drafter cycle ~0.2 ms of dispatch (docs/performance.md)
        proj = self.hidden_projection(hidden).float()  # [K, r]
        chances = kernels.selector_chances(probs.float(), cand, proj, self.predecessor_codebook,
                                           self.successor_codebook, int(anchor))  # [K, k (prev), k]
        return chances[0, 0], chances[1:]


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter: the first format's drafter with `DFlash2Layer`s and a `CandidateSelector`.
    Load one with `drafter.load_drafter`; the loop-facing API is DFlashDrafter's, plus `select`."""

    layer_class = DFlash2Layer

    def __init__(self, config: dict) -> None:
        missing = [k for k in (*SETTINGS, "target_layer_ids") if dflash_value(config, k) is None]
        if missing or config.get("vocab_size") is None:
            raise ValueError(f"a DFlash2 drafter's config must name {', '.join(missing or ['vocab_size'])} "
                             "(in dflash_config)")
        super().__init__(config)
        c = self.config
        self.candidate_selector = CandidateSelector(c["hidden_size"], int(c["vocab_size"]),
                                                    int(dflash_value(c, "selector_rank")),
                                                    int(dflash_value(c, "selector_top_k")))
        self.last_hidden: torch.Tensor | None = None  # [bs - 1, H] of the latest `propose`, for `select`

    def _flat_plan(self) -> nn.Module | None:
        # FlatDraft has no convolutions, but where every one computes the identity (base kernel 1 on the
        # current position, 0 before it, no dynamic part: a selector trained onto a first-format drafter,
        # `train_selector.py`) the layers are the first format's and it computes the same bits.
        # Keyed on the tensors the convolutions store (a quantized projection's blocks included): reading
        # `.weight` dequantizes a quantized projection, too slow for every draft, so it is
        # read only when one of them changed. Inference tensors keep no version counter: loaded for inference.
        # (A leaf projection's tensors read from its dicts: walking the modules with .parameters() and .buffers() on
        # every draft was most of this check's time.)
        convs = self._convs()
        version = tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for c in convs
                        for t in (c.base_kernel, *_tensors(c.kernel_projection)))
        if getattr(self, "_identity", (None,))[0] != version:
            plain = all(isinstance(getattr(c.kernel_projection, "weight", None), torch.Tensor) for c in convs)
            self._identity = (version, plain and all(_is_identity(c) for c in convs))
        return super()._flat_plan() if self._identity[1] else None

    def _convs(self) -> list[DynamicConv]:
        return [c for layer in self.layers for c in (layer.attention_conv, layer.mlp_conv)]

    def first_format(self) -> DFlashDrafter:
        """The drafter without its selector, as a first-format drafter that drafts each position's argmax. Only
        where every convolution computes the identity (a selector trained onto a first-format drafter,
        `train_selector.py`): then the layers compute exactly the first format's. `dflash train` continues
        training such a drafter, or trains it a new selector, from this."""
        convs = self._convs()
        if not all(isinstance(getattr(c.kernel_projection, "weight", None), torch.Tensor) and _is_identity(c)
                   for c in convs):
            raise ValueError("this DFlash2 drafter's convolutions are not the identity, so its layers are not the "
                             "first format's: dflash train can continue only first-format drafters or DFlash2 "
                             "drafters whose convolutions compute the identity")
        plain = DFlashDrafter(first_format_config(self.config))
        plain.load_state_dict({k: v for k, v in self.state_dict().items()
                               if not k.startswith("candidate_selector.") and "_conv." not in k})
        plain.set_draft_vocab(self.draft_vocab)
        return plain

    @staticmethod
    def map_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The codebooks under their published names (bare, as this module keeps them), also when a
        checkpoint stores them as embedding weights (`....predecessor_codebook.weight`)."""
        state = dict(state)
        for name in CODEBOOKS:
            if f"{name}.weight" in state:
                if name in state:
                    raise ValueError(f"the checkpoint holds both {name} and {name}.weight")
                state[name] = state.pop(f"{name}.weight")
        return state

    def propose(self, target: nn.Module, block: torch.Tensor, ctx: torch.Tensor, cache: KVCache,
                full: bool = True) -> torch.Tensor:
        """Draft logits [B, bs - 1, V], as `DFlashDrafter.propose` (full=False: over a draft vocabulary's
        rows); the hidden states of block positions 1.. stay for `select` and `transitions` (their p_j)."""
        hidden = self.draft_hidden(target, block, ctx, cache)  # [B, bs, H]
        self.last_hidden = hidden[0, 1:]
        return self.logits(hidden[:, 1:].to(target.embed_tokens.weight.dtype), target.lm_head, full=full)

    @torch.no_grad()  # a choice of tokens: nothing to differentiate
    def select(self, draft_logits: torch.Tensor, anchor: int, sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted tokens [K] for the latest `propose`'s logits draft_logits [K, V] (as the loop has
        them: after penalties and a draft vocabulary's -inf) and the block's first token `anchor`, and
        when sampling q [K, V]: the distribution each token was drawn from, zero off its k candidates.

        Greedy: the selector's sequential argmax. Sampling: a draw from softmax(score / temperature) over
        the candidates at each position, with the sampler's seeded generator; the drawn token is the next
        position's predecessor. The sampler's top-k / top-p / min-p shape the target's p only: rejection
        sampling is exact for any q the tokens were truly drawn from (a candidate the target's filters
        drop has p = 0 and is rejected), and this q is the published implementations'."""
        hidden = self.last_hidden
        if hidden is None or hidden.shape[0] != draft_logits.shape[0]:
            raise ValueError("select() takes the logits of the latest propose() (one per drafted position)")
        if sampler.greedy:
            return self.candidate_selector(draft_logits, hidden, int(anchor)).tokens, None
        sel = self.candidate_selector(draft_logits, hidden, int(anchor), sampler.temperature, sampler._draw)
        q = torch.zeros(draft_logits.shape, dtype=torch.float32, device=draft_logits.device)
        return sel.tokens, q.scatter_(1, sel.candidates, sel.probs)

    def check_target(self, target_config: dict, num_target_layers: int, vocab_size: int) -> None:
        """As `DFlashDrafter.check_target`, and the selector's codebooks must cover the target's vocabulary."""
        super().check_target(target_config, num_target_layers, vocab_size)
        rows = self.candidate_selector.predecessor_codebook.shape[0]
        if rows != vocab_size:
            raise ValueError(f"the drafter's selector has codebooks of {rows} tokens; the target has {vocab_size}")

    def saved_settings(self) -> dict:
        sel = self.candidate_selector
        conv = self.layers[0].attention_conv
        return {**super().saved_settings(), "conv_kernel_size": conv.kernel_size, "conv_group_size": conv.group_size,
                "selector_rank": sel.hidden_projection.out_features, "selector_top_k": sel.top_k}

    def save(self, path: str | Path, extra_config: dict | None = None) -> None:
        """Write config.json + model.safetensors in the published DFlash2 layout (the codebooks bare)."""
        super().save(path, {"architectures": [ARCHITECTURE], **(extra_config or {})})
