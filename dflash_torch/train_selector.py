"""`dflash train --selector`: a DFlash2 candidate selector on top of a trained DFlash drafter.

A DFlash drafter drafts every block position independently (the argmax of its logits). DFlash2's
candidate selector picks each drafted token among the top-k of that position's logits with a score
that depends on the token chosen before it (`decoding/dflash2.py`):

    score[j, m] = unary[j, m] + sum_r P[pred, r] * p_j[r] * S[cand[j, m], r],   p_j = W h_j

with P, S two [V, r] codebooks and W an [r, H] projection of the drafter's hidden state h_j. The
drafter itself stays frozen here, so the cost is one pass of the drafter over the training blocks:
their hidden states, top-k candidates and logits are computed once, and the selector (its codebooks
projections of the target's token embedding: `Selector`) trains on them for many epochs in seconds.

Objective: cross-entropy over the k candidates of each block position along the teacher-forced path
(the predecessor is the reply's own previous token, the anchor at position 1; a greedy draft is kept
only while it equals the reply, so that is the path that matters), weighted exp(-(j - 1) / gamma) as
the drafter's own loss. Positions whose reply token is not among the candidates teach nothing (no
choice of the selector can draft it).

The export is a DFlash2 drafter: the drafter's weights, convolutions that compute the identity
(base kernel 1 on the current token, 0 on the one before, no dynamic part: the drafter's hidden states
stay exactly what they were), and the selector.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from . import loading
from .decoding.dflash2 import DFlash2Drafter
from .decoding.drafter import VOCAB_FILE, load_drafter
from .train import block_hidden, load_data, log_line, make_batch, position_weights, split_records

CONV_KERNEL, CONV_GROUP = 2, 64  # the identity convolutions of the export: any size computes the same


class Selector(nn.Module):
    """The candidate selector, its codebooks factored through the target's token embedding.

    The published format stores two free [V, r] codebooks. Trained free, they learn only the token pairs
    the training blocks contain (1.6M parameters for SmolLM2's vocabulary at rank 16) and overfit within an
    epoch. Here each codebook row is a learned projection of the token's embedding in the target,
    P[t] = A_p e(t) and S[t] = A_s e(t) ([r, H] each), so tokens that the target embeds alike score alike
    and pairs never seen in training still get a score. `codebooks()` writes them out in the published
    form (`export_dflash2`)."""

    def __init__(self, hidden: int, embed: torch.Tensor, rank: int) -> None:
        super().__init__()
        self.register_buffer("embed", embed.detach().float(), persistent=False)  # [V, H_target]
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_projection = nn.Linear(embed.shape[1], rank, bias=False)
        self.successor_projection = nn.Linear(embed.shape[1], rank, bias=False)

    def reset(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (self.hidden_projection, self.predecessor_projection):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5)
            self.successor_projection.weight.zero_()  # scores start as the drafter's own logits: argmax drafting

    def scores(self, hidden: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], pred [...] (token ids), cand / unary [..., k] -> scores [..., k]."""
        p = self.hidden_projection(hidden) * self.predecessor_projection(self.embed[pred])  # [..., r]
        return unary + torch.einsum("...r,...kr->...k", p, self.successor_projection(self.embed[cand]))

    @torch.no_grad()
    def codebooks(self) -> dict[str, torch.Tensor]:
        """The selector's tensors under the published names (`candidate_selector.*`, codebooks [V, r])."""
        return {"hidden_projection.weight": self.hidden_projection.weight.detach().clone(),
                "predecessor_codebook": self.predecessor_projection(self.embed),
                "successor_codebook": self.successor_projection(self.embed)}


class SelectorEnsemble(nn.Module):
    """Selectors trained alike from different seeds, their interaction terms averaged:
    score = logit + mean_i interaction_i. Each one alone is noisy (its gain over the argmax moves with the seed);
    the mean of a few keeps more of the reply than any of them (docs/training.md). It is itself a selector of
    the published form: a sum of rank-r interactions is one interaction of rank n r, so `codebooks()` stacks the
    members' hidden projections (each scaled by 1/n) and concatenates their codebooks' columns."""

    def __init__(self, members: list[Selector]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def scores(self, hidden: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros_like(unary)
        return unary + sum(m.scores(hidden, pred, cand, zero) for m in self.members) / len(self.members)

    @torch.no_grad()
    def codebooks(self) -> dict[str, torch.Tensor]:
        books = [m.codebooks() for m in self.members]
        return {"hidden_projection.weight": torch.cat([b["hidden_projection.weight"] for b in books]) / len(books),
                "predecessor_codebook": torch.cat([b["predecessor_codebook"] for b in books], 1),
                "successor_codebook": torch.cat([b["successor_codebook"] for b in books], 1)}


@torch.no_grad()
def examples(drafter, target, records, feats, cols, device, *, blocks: int, positions: int, top_k: int,
             seed: int) -> dict:
    """The frozen drafter's view of `blocks` random training blocks: hidden [N, K, H] (bfloat16),
    candidates [N, K, k] (token ids, best logit first), unary [N, K, k] (their logits), labels [N, K]
    (the reply's tokens, -100 past its end) and anchor [N]."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    out = {k: [] for k in ("hidden", "cand", "unary", "labels", "anchor")}
    n, bar = 0, tqdm(total=blocks, desc="drafter passes", unit="block", dynamic_ncols=True)
    B = drafter.block_size
    while n < blocks:
        b = make_batch(records, feats, cols, gen, seqs=4, anchors=16, block_size=B, mask_token_id=drafter.mask_token_id)
        hidden = block_hidden(drafter, drafter, target, b, device, positions)  # [n, K, H]
        logits = drafter.logits(hidden, target.lm_head, full=False).float()  # [n, K, V or draft vocab]
        unary, idx = logits.topk(top_k, dim=-1)
        cand = idx if drafter.draft_vocab is None else drafter.draft_vocab.to(idx.device)[idx]
        out["hidden"].append(hidden.to(torch.bfloat16).cpu())
        out["cand"].append(cand.cpu())
        out["unary"].append(unary.cpu())
        out["labels"].append(b["labels"][:, :positions])
        out["anchor"].append(b["block"].view(-1, B)[:, 0])
        n += hidden.shape[0]
        bar.update(min(hidden.shape[0], blocks - bar.n))
    bar.close()
    return {k: torch.cat(v)[:blocks] for k, v in out.items()}


def chains(sel: Selector | SelectorEnsemble | None, ex: dict, rows: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [n, K] of the examples `rows`: the selector's sequential choice (its own previous
    choice as the predecessor), or without a selector the drafter's argmax."""
    cand = ex["cand"][rows]
    if sel is None:
        return cand[..., 0]
    hidden, unary, pred = ex["hidden"][rows].float(), ex["unary"][rows], ex["anchor"][rows]
    picks = []
    for j in range(cand.shape[1]):
        m = sel.scores(hidden[:, j], pred, cand[:, j], unary[:, j]).argmax(-1)  # [n]
        pred = cand[:, j].gather(1, m[:, None])[:, 0]
        picks.append(pred)
    return torch.stack(picks, 1)


def tf_accept(drafts: torch.Tensor, labels: torch.Tensor) -> float:
    """Teacher-forced acceptance length: 1 + leading drafts equal to the reply, mean over blocks."""
    return 1.0 + (drafts == labels).int().cumprod(-1).sum(-1).float().mean().item()


def loss_of(sel: Selector, ex: dict, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    hidden, cand, unary, labels = ex["hidden"][rows].float(), ex["cand"][rows], ex["unary"][rows], ex["labels"][rows]
    pred = torch.cat([ex["anchor"][rows][:, None], labels[:, :-1]], 1)  # [n, K]: teacher forced
    hit = cand == labels[..., None]  # [n, K, k]
    valid = hit.any(-1) & (pred >= 0)
    s = sel.scores(hidden, pred.clamp_min(0), cand, unary)  # [n, K, k]
    ce = F.cross_entropy(s.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none").view_as(valid)
    w = weights[: labels.shape[1]][None] * valid
    return (ce * w).sum() / w.sum().clamp_min(1e-12)


def train_selector(a: argparse.Namespace) -> dict:
    """Train a selector for the drafter `a.init_from` on `a.data`; write a DFlash2 drafter to `a.export`."""
    if not a.init_from:
        raise ValueError("dflash train --selector needs --init-from DRAFTER_DIR (the drafter it selects for)")
    if a.selector_ensemble < 1:
        raise ValueError(f"--selector-ensemble must be at least 1, got {a.selector_ensemble}")
    device = loading.pick_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    records, feats, meta = load_data(a.data.split(","))
    model_path = loading.resolve_model(a.model or meta["model"])
    target = loading.load_target(model_path, device, torch.float32)
    drafter = load_drafter(a.init_from, device=device, dtype=torch.float32).eval()
    if isinstance(drafter, DFlash2Drafter):  # a new selector in place of its own (convolutions the identity only)
        drafter = drafter.first_format().to(device).eval()
        print(f"selector: {a.init_from} has a candidate selector; training a new one in its place", file=sys.stderr)
    cached, h = meta["taps"], target.config.hidden_size
    missing = [t for t in drafter.target_layer_ids if t not in cached]
    if missing:
        raise ValueError(f"the drafter taps layers {missing}, which {a.data} does not cache (cached: {cached})")
    cols = torch.cat([torch.arange(cached.index(t) * h, (cached.index(t) + 1) * h) for t in drafter.target_layer_ids])
    train_recs, val_recs = split_records(records, val_every=10)  # its own split: a tenth held out
    K = min(a.loss_positions or 8, drafter.block_size - 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "log.jsonl"
    cache_file = out / "examples.pt"  # the drafter passes are most of the time: kept for a rerun
    if cache_file.is_file():
        ex, vx = torch.load(cache_file)
    else:
        kw = dict(positions=K, top_k=a.selector_top_k, seed=a.seed)
        ex = examples(drafter, target, train_recs, feats, cols, device, blocks=a.selector_blocks, **kw)
        vx = examples(drafter, target, val_recs, feats, cols, device, blocks=max(256, a.selector_blocks // 10), **kw)
        tmp = cache_file.with_name(cache_file.name + ".part")
        try:  # written whole or not at all: a full disk must not cost the passes already made
            torch.save((ex, vx), tmp)
            tmp.replace(cache_file)
        except (OSError, RuntimeError) as e:
            tmp.unlink(missing_ok=True)
            print(f"selector: could not keep the drafter passes in {cache_file} ({e}); training on without "
                  "keeping them", file=sys.stderr)
    weights = position_weights(K + 1, a.gamma)
    val_rows = torch.arange(len(vx["labels"]))
    base = round(tf_accept(chains(None, vx, val_rows), vx["labels"]), 4)
    log_line(log_file, {"event": "start", "train_blocks": len(ex["labels"]), "val_blocks": len(vx["labels"]),
                        "positions": K, "argmax_tf_accept": base})
    print(f"selector: {len(ex['labels'])} training blocks, {len(vx['labels'])} held out; argmax drafts keep "
          f"{base} tokens per block (teacher forced)", file=sys.stderr)
    members, best_epochs = [], []
    for i in range(a.selector_ensemble):
        sel, epoch = fit(a, target.embed_tokens.weight, ex, vx, weights, base, seed=a.seed + i, log_file=log_file)
        members.append(sel)
        best_epochs.append(epoch)
    sel = members[0] if len(members) == 1 else SelectorEnsemble(members)
    with torch.no_grad():
        acc = round(tf_accept(chains(sel, vx, val_rows), vx["labels"]), 4)
    if len(members) > 1:
        log_line(log_file, {"event": "ensemble", "members": len(members), "tf_accept": acc})
        print(f"selector: the {len(members)} selectors averaged: tf_accept {acc}", file=sys.stderr)
    result = {"argmax_tf_accept": base, "selector_tf_accept": acc,
              "best_epoch": best_epochs[0] if len(best_epochs) == 1 else best_epochs}
    if a.export:
        export_dflash2(a.init_from, sel, a.export, a.selector_top_k, a.export_dtype)
        result["export"] = str(a.export)
        print(f"selector: wrote the DFlash2 drafter {a.export} (epochs {best_epochs})", file=sys.stderr)
    log_line(log_file, {"event": "done", **result})
    return result


def fit(a: argparse.Namespace, embed: torch.Tensor, ex: dict, vx: dict, weights: torch.Tensor, base: float, *,
        seed: int, log_file: Path) -> tuple[Selector, int]:
    """One selector trained from `seed` on the cached passes `ex`; returns it at its best epoch by teacher-forced
    acceptance on `vx` (epoch 0: the untrained selector, which drafts the argmax), and that epoch."""
    sel = Selector(ex["hidden"].shape[-1], embed, a.selector_rank)
    sel.reset(seed)
    opt = torch.optim.AdamW(sel.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    val_rows = torch.arange(len(vx["labels"]))
    best = {"epoch": 0, "tf_accept": base, "state": {k: v.clone() for k, v in sel.state_dict().items()}}
    gen, t0, batch = torch.Generator().manual_seed(seed), time.time(), 256
    for epoch in range(1, a.selector_epochs + 1):
        order = torch.randperm(len(ex["labels"]), generator=gen)
        for i in range(0, len(order), batch):
            loss = loss_of(sel, ex, order[i : i + batch], weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            acc = round(tf_accept(chains(sel, vx, val_rows), vx["labels"]), 4)
            val_loss = round(loss_of(sel, vx, val_rows, weights).item(), 4)
        log_line(log_file, {"seed": seed, "epoch": epoch, "val_loss": val_loss, "tf_accept": acc,
                            "elapsed": round(time.time() - t0, 1)})
        print(f"selector (seed {seed}): epoch {epoch}: held-out loss {val_loss}, tf_accept {acc} (argmax {base})",
              file=sys.stderr)
        if acc > best["tf_accept"]:
            best = {"epoch": epoch, "tf_accept": acc, "state": {k: v.clone() for k, v in sel.state_dict().items()}}
    sel.load_state_dict(best["state"])
    return sel, best["epoch"]


def export_dflash2(drafter_dir: str | Path, sel: Selector | SelectorEnsemble, path: str | Path, top_k: int,
                   dtype: str = "bfloat16") -> Path:
    """The drafter of `drafter_dir` with identity convolutions and the selector, in the published DFlash2
    layout (config.json with architectures DFlash2DraftModel, model.safetensors; the codebooks without
    `.weight`)."""
    src, path = Path(drafter_dir), Path(path)
    config = json.loads((src / "config.json").read_text())
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    h, n_layers = config["hidden_size"], config["num_hidden_layers"]
    if h % CONV_GROUP:
        raise ValueError(f"hidden size {h} is not a multiple of the convolution group {CONV_GROUP}")
    for i in range(n_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, CONV_KERNEL, h)
            base[:, 0] = 1.0  # the current token times one, the one before times zero: the identity
            state[f"layers.{i}.{conv}.base_kernel"] = base
            state[f"layers.{i}.{conv}.kernel_projection.weight"] = torch.zeros(2 * CONV_KERNEL * h // CONV_GROUP, h)
    books = sel.codebooks()
    for k, v in books.items():
        state[f"candidate_selector.{k}"] = v
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}
    config["architectures"] = ["DFlash2DraftModel"]
    dc = config.setdefault("dflash_config", {})
    dc.update(conv_kernel_size=CONV_KERNEL, conv_group_size=CONV_GROUP,
              selector_rank=books["hidden_projection.weight"].shape[0], selector_top_k=top_k)
    config["dtype"] = dtype
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / VOCAB_FILE).is_file():
        shutil.copyfile(src / VOCAB_FILE, path / VOCAB_FILE)
    return path
