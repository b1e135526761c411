"""Selectors trained where the loop drafts: the drafter's passes at every anchor of the target's own replies, then
only the anchors a loop of argmax chains visits (the first reply token, then anchor + drafts kept + 1), five
selectors (`train_selector.fit`, seeds 1-5) trained on those blocks and averaged, exported as a DFlash2 drafter.
Prints teacher-forced acceptance on the held-out records' visited and every-anchor blocks for the drafter's argmax,
the new selectors and optionally another exported selector (--other). The held-out records are those of the
split by each record's key that `dflash train --selector` used before `train.split_records` kept a conversation's
turns together (--val-every 10), so the figures compare with its runs of that time (runs/ens5).

    python tools/probes/loop_anchor_selector_probe.py --data runs/gen9,runs/gen10 --cache runs/ren/examples_all.pt \
        --out runs/sel19/drafter --other runs/ens5/drafter
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.train import block_hidden, load_data, position_weights
from dflash_torch.train_selector import SelectorEnsemble, chains, export_dflash2, fit, tf_accept

K, TOPK, CHUNK = 8, 8, 64


def batch(r: dict, feats, cols, chosen: list[int], B: int, mask_id: int) -> dict:
    """Blocks at the given anchors of one record, as `train.make_batch` builds them."""
    toks = r["prompt_ids"] + r["response_ids"]
    last, n = chosen[-1], len(chosen)
    tt = torch.tensor(toks + [-100] * B)
    blocks = torch.full((n, B), mask_id)
    blocks[:, 0] = torch.tensor([toks[a] for a in chosen])
    q_anchor = torch.tensor(chosen).repeat_interleave(B)
    blk_id = torch.arange(n).repeat_interleave(B)
    see_ctx = torch.arange(last)[None] < q_anchor[:, None]
    return {"ctx": feats[torch.arange(r["start"], r["start"] + last)][:, cols].unsqueeze(0),
            "ctx_pos": torch.arange(last), "block": blocks.view(1, -1),
            "q_pos": torch.cat([torch.arange(a, a + B) for a in chosen]),
            "mask": torch.cat([see_ctx, blk_id[:, None] == blk_id[None]], 1),
            "labels": torch.stack([tt[a + 1 : a + B] for a in chosen]),
            "ctx_start": torch.zeros(n, dtype=torch.long), "ctx_len": torch.tensor(chosen)}


@torch.no_grad()
def every_anchor(drafter, target, recs, feats, cols) -> dict:
    total = sum(len(r["response_ids"]) - 1 for r in recs)
    H = drafter.config["hidden_size"]
    d = {"hidden": torch.empty(total, K, H, dtype=torch.bfloat16),
         "cand": torch.empty(total, K, TOPK, dtype=torch.long), "unary": torch.empty(total, K, TOPK),
         "labels": torch.empty(total, K, dtype=torch.long),
         "anchor": torch.empty(total, dtype=torch.long), "rec": torch.empty(total, dtype=torch.long),
         "pos": torch.empty(total, dtype=torch.long)}
    n, bar = 0, tqdm(total=total, unit="block", dynamic_ncols=True)
    for ri, r in enumerate(recs):
        p = len(r["prompt_ids"])
        anchors = list(range(p, p + len(r["response_ids"]) - 1))
        for i in range(0, len(anchors), CHUNK):  # filled in place: appending views kept whole passes alive
            ch = anchors[i : i + CHUNK]
            b = batch(r, feats, cols, ch, drafter.block_size, drafter.mask_token_id)
            hid = block_hidden(drafter, drafter, target, b, torch.device("cpu"), K)  # [n, K, H]
            unary, idx = drafter.logits(hid, target.lm_head, full=False).float().topk(TOPK, dim=-1)
            m = n + len(ch)
            d["hidden"][n:m], d["unary"][n:m], d["labels"][n:m] = hid, unary, b["labels"][:, :K]
            d["cand"][n:m] = idx if drafter.draft_vocab is None else drafter.draft_vocab[idx]
            d["anchor"][n:m], d["rec"][n:m] = b["block"].view(len(ch), -1)[:, 0], ri
            d["pos"][n:m] = torch.tensor(ch) - p
            n = m
            bar.update(len(ch))
    bar.close()
    return d


def visited(x: dict) -> dict:
    """The blocks a loop of argmax chains drafts: from each reply's first token, anchor + kept + 1."""
    kept = (x["cand"][..., 0] == x["labels"]).int().cumprod(-1).sum(-1)  # [N]
    index = {(r, p): i for i, (r, p) in enumerate(zip(x["rec"].tolist(), x["pos"].tolist()))}
    keep = torch.zeros(len(kept), dtype=torch.bool)
    for r in x["rec"].unique().tolist():
        a = 0
        while (r, a) in index:
            keep[index[(r, a)]] = True
            a += int(kept[index[(r, a)]]) + 1
    return {k: v[keep] for k, v in x.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="replies of the target (no teacher-forced text), comma-separated")
    ap.add_argument("--draft", default="dflash_torch/drafters/smollm2-135m-instruct")
    ap.add_argument("--cache", required=True, help="the passes, written on the first run and read after")
    ap.add_argument("--out", required=True, help="where to export the averaged selectors' DFlash2 drafter")
    ap.add_argument("--other", help="another DFlash2 drafter of the same drafter: its selector scored alike")
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    records, feats, meta = load_data(a.data.split(","))
    target = loading.load_target(loading.resolve_model(meta["model"]), torch.device("cpu"), torch.float32)
    drafter = load_drafter(a.draft, device=torch.device("cpu"), dtype=torch.float32).eval()
    if Path(a.cache).is_file():
        x = torch.load(a.cache)
    else:
        h, taps = target.config.hidden_size, meta["taps"]
        cols = torch.cat([torch.arange(taps.index(t) * h, (taps.index(t) + 1) * h) for t in drafter.target_layer_ids])
        val = [not int(r["key"][:8], 16) % a.val_every for r in records]
        x = {"train": every_anchor(drafter, target, [r for r, v in zip(records, val) if not v], feats, cols),
             "val": every_anchor(drafter, target, [r for r, v in zip(records, val) if v], feats, cols)}
        torch.save(x, a.cache)
    ex, vx = visited(x["train"]), visited(x["val"])
    print(f"visited blocks: {len(ex['labels'])} of {len(x['train']['labels'])} (training), {len(vx['labels'])} of "
          f"{len(x['val']['labels'])} (held out)", flush=True)
    E = target.embed_tokens.weight.detach()
    base = tf_accept(chains(None, vx, torch.arange(len(vx["labels"]))), vx["labels"])
    s = types.SimpleNamespace(selector_rank=16, lr=1e-3, weight_decay=0.1, selector_epochs=4)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    log = Path(a.out).parent / "log.jsonl"
    sel = SelectorEnsemble([fit(s, E, ex, vx, position_weights(K + 1, 7.0), base, seed=i, log_file=log)[0]
                            for i in range(1, 6)])
    arms = {"argmax": None, "these selectors": sel}
    if a.other:
        arms[a.other] = load_drafter(a.other).candidate_selector.float()
    for name, vset in (("visited", vx), ("every anchor", x["val"])):
        rows = torch.arange(len(vset["labels"]))
        with torch.no_grad():
            drafts = {k: other_chains(v, vset, rows) if hasattr(v, "top_k") else chains(v, vset, rows)
                      for k, v in arms.items()}
        accs = {k: round(tf_accept(d, vset["labels"]), 4) for k, d in drafts.items()}
        print(f"held-out {name} blocks, teacher forced: {accs}", flush=True)
    export_dflash2(a.draft, sel, a.out, TOPK)
    print(f"wrote {a.out}", flush=True)


def other_chains(cs, x: dict, rows: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [n, K] of an exported `CandidateSelector` over cached blocks (its published tensors)."""
    cand, hidden, unary, pred = x["cand"][rows], x["hidden"][rows].float(), x["unary"][rows], x["anchor"][rows]
    proj = cs.hidden_projection(hidden)  # [n, K, r]
    picks = []
    for j in range(cand.shape[1]):
        inter = (cs.predecessor_codebook[pred] * proj[:, j])[:, None] * cs.successor_codebook[cand[:, j]]  # [n, k, r]
        m = (unary[:, j] + inter.sum(-1)).argmax(-1)
        pred = cand[:, j].gather(1, m[:, None])[:, 0]
        picks.append(pred)
    return torch.stack(picks, 1)


if __name__ == "__main__":
    main()
