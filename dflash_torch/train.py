"""`dflash train`: train a DFlash drafter on the target's own replies and cached tap features.

The objective (DFlash): pick anchor positions inside replies. Each anchor gives one block
[anchor token, mask x (B - 1)] whose positions 1..B-1 predict the B - 1 tokens after the anchor in one
pass; the block's context is the fused target features of the tokens strictly before the anchor.
Blocks attend bidirectionally inside themselves and never to each other, so many anchors from several
concatenated sequences train in one forward pass through the drafter's `extra_mask`. The loss is
cross-entropy per block position k weighted by exp(-(k - 1) / gamma): early positions matter most,
since a draft is only accepted up to its first miss.

The target's embedding and LM head are shared and frozen (not part of the drafter's weights).

  python -m dflash_torch.data --out runs/data                  # replies + features (resumable)
  dflash train --data runs/data --out runs/d1 --steps 2000 --export dflash_torch/drafters/NAME
  dflash train --eval DRAFTER_DIR                              # held-out acceptance with the real loop
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import data as dataset
from . import loading, registry
from .decoding.dflash2 import ARCHITECTURE as DFLASH2
from .decoding.dflash2 import DFlash2Drafter, first_format_config
from .decoding.drafter import Blocks, DFlashDrafter, load_drafter, num_params

# --- the drafter ----------------------------------------------------------------------------------


def drafter_config(
    target_config: dict, *, layers: int, taps: list[int], block_size: int, mask_token_id: int,
    name: str, intermediate_size: int | None = None,
) -> dict:
    """A published-format drafter config shaped like the target's layers (so they can initialise it),
    recording the target it is trained for."""
    t = target_config
    heads = t["num_attention_heads"]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t["hidden_size"], "intermediate_size": intermediate_size or t["intermediate_size"],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads") or heads,
        "head_dim": t.get("head_dim") or t["hidden_size"] // heads,
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "hidden_act": t.get("hidden_act", "silu"),
        "vocab_size": t["vocab_size"], "num_target_layers": t["num_hidden_layers"],
        "max_position_embeddings": t.get("max_position_embeddings", 4096),
        "rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": t.get("rope_scaling"),
        "attention_bias": False, "tie_word_embeddings": False,
        "dflash_config": {
            "block_size": block_size, "mask_token_id": mask_token_id, "target_layer_ids": list(taps),
            "target": {"name": name, "fingerprint": registry.fingerprint(t)},
        },
    }


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target, norm_scale: float = 0.3) -> str:
    """Start the draft layers as copies of the target's top layers (q/k norms at ones), and `fc` +
    `hidden_norm` so that the context keys/values of the first draft layer are exactly what the copied
    target layer would compute (fc selects the tap feeding it). Returns a one-line description.

    The final norm starts as the target's times `norm_scale`: with the target's full scale an untrained
    block is confidently wrong (SmolLM2: CE 17 at 1.0, 9 at 0.3), and Adam moves a norm weight only
    ~lr per step, so shrinking it by training alone takes thousands of steps."""
    n, L = len(drafter.layers), target.num_layers
    src = list(range(L - n, L))
    for dl, i in zip(drafter.layers, src):
        tl = target.model.layers[i]
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            getattr(dl, name).load_state_dict(getattr(tl, name).state_dict())
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dl.self_attn, name).load_state_dict(getattr(tl.self_attn, name).state_dict())
        dl.self_attn.q_norm.weight.fill_(1.0)
        dl.self_attn.k_norm.weight.fill_(1.0)
    drafter.norm.weight.copy_(target.model.norm.weight * norm_scale)
    drafter.hidden_norm.weight.copy_(target.model.layers[src[0]].input_layernorm.weight)
    taps = drafter.target_layer_ids
    below = [t for t in taps if t < src[0]]
    feed = max(below) if below else taps[0]  # the tap closest to the first copied layer's input
    h = drafter.config["hidden_size"]
    drafter.fc.weight.zero_()
    j = taps.index(feed)
    drafter.fc.weight[:, j * h : (j + 1) * h] = torch.eye(h)
    return f"draft layers <- target layers {src}, fc <- tap {feed}"


@torch.no_grad()
def grow_from(drafter: DFlashDrafter, init: DFlashDrafter) -> str:
    """Load `init`'s weights into `drafter`, which may have more layers. Each added layer starts as a copy of
    init's last one with its two residual outputs (o_proj, down_proj) zeroed: it adds nothing, so the grown
    drafter drafts exactly what `init` does until training moves it. Returns "" or a note of the growth."""
    n = len(init.layers)
    state = init.state_dict()
    for i in range(n, len(drafter.layers)):
        for k, v in init.layers[n - 1].state_dict().items():
            zero = k in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"layers.{i}.{k}"] = torch.zeros_like(v) if zero else v.clone()
    drafter.load_state_dict(state)
    return f" (grown from {n} to {len(drafter.layers)} layers)" if len(drafter.layers) > n else ""


@torch.no_grad()
def init_random(drafter: DFlashDrafter, target, seed: int = 0, norm_scale: float = 0.3) -> None:
    """Random N(0, 0.02) matrices; the final norm as in `init_from_target`."""
    g = torch.Generator().manual_seed(seed)
    for p in drafter.parameters():
        if p.dim() > 1:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    drafter.norm.weight.copy_(target.model.norm.weight * norm_scale)


# --- batches --------------------------------------------------------------------------------------


def split_records(records: list[dict], val_every: int = 20, group_tokens: int = 96) -> tuple[list[dict], list[dict]]:
    """(train, validation) records by a fixed hash of the key (validation ~1/val_every).

    Records whose prompts share their first `group_tokens` tokens go to the same side: prompts ending at the
    third, fourth and fifth user turn of one conversation (`tools/sharegpt_turns.py`) are one conversation,
    and a reply to its fourth turn is no held-out test of a model trained on the reply to its third. The side
    of such a group is its smallest key's; a record alone keeps the side of its own key."""
    first: dict[tuple, str] = {}
    for r in records:
        g = tuple(r["prompt_ids"][:group_tokens])
        first[g] = min(first.get(g, r["key"]), r["key"])
    train, val = [], []
    for r in records:
        key = first[tuple(r["prompt_ids"][:group_tokens])]
        (val if int(key[:8], 16) % val_every == 0 else train).append(r)
    return train, val


def make_batch(
    records: list[dict], feats: torch.Tensor, cols: torch.Tensor, gen: torch.Generator, *,
    seqs: int, anchors: int, block_size: int, mask_token_id: int,
) -> dict:
    """Blocks at random anchors inside the replies of `seqs` random records, as one concatenated pass.

    Returns ctx [1, Tc, F] features, ctx_pos [Tc], block [1, Tq] token ids, q_pos [Tq],
    mask [Tq, Tc + Tq] (True = may attend), labels [n_blocks, B - 1] (-100 past a reply's end), and
    ctx_start / ctx_len [n_blocks]: each block's context rows, the same visibility as the mask's.
    """
    B = block_size
    idx = torch.randint(len(records), (seqs,), generator=gen).tolist()
    ctx_rows, ctx_pos, ctx_seq, blocks, q_pos, q_seq, q_anchor, labels = [], [], [], [], [], [], [], []
    ctx_start, offset = [], 0  # per block: where its sequence's context rows begin
    for s, i in enumerate(idx):
        r = records[i]
        toks = r["prompt_ids"] + r["response_ids"]
        p, t = len(r["prompt_ids"]), len(toks)
        # anchors p .. t-2: each has at least one token to predict; a teacher-forced record (target_ids: the
        # target's own choice at each reply position) anchors only where the text's token is that choice
        pool = torch.arange(p, t - 1) if "target_ids" not in r else torch.tensor(
            [a for a in range(p, t - 1) if toks[a] == r["target_ids"][a - p]], dtype=torch.long)
        n_anchor = len(pool)
        if n_anchor <= 0:
            continue
        k = min(anchors, n_anchor)
        chosen = pool[torch.randperm(n_anchor, generator=gen)[:k]].sort().values.tolist()
        last = chosen[-1]  # context needed: tokens [0, last)
        ctx_rows.append(torch.arange(r["start"], r["start"] + last))
        ctx_pos.append(torch.arange(last))
        ctx_seq.append(torch.full((last,), s))
        tt = torch.tensor(toks + [-100] * B)
        for a in chosen:
            blk = torch.full((B,), mask_token_id)
            blk[0] = toks[a]
            blocks.append(blk)
            q_pos.append(torch.arange(a, a + B))
            q_seq.append(s)
            q_anchor.append(a)
            ctx_start.append(offset)
            labels.append(tt[a + 1 : a + B] if "target_ids" not in r else _target_labels(r, a, B))
        offset += last
    rows = torch.cat(ctx_rows)
    ctx = feats[rows][:, cols].unsqueeze(0)  # [1, Tc, F]
    ctx_pos_t, ctx_seq_t = torch.cat(ctx_pos), torch.cat(ctx_seq)
    n = len(blocks)
    q_seq_t = torch.tensor(q_seq).repeat_interleave(B)  # [Tq]
    q_anchor_t = torch.tensor(q_anchor).repeat_interleave(B)
    see_ctx = (ctx_seq_t[None] == q_seq_t[:, None]) & (ctx_pos_t[None] < q_anchor_t[:, None])  # [Tq, Tc]
    blk_id = torch.arange(n).repeat_interleave(B)
    see_blk = blk_id[:, None] == blk_id[None]  # [Tq, Tq]: bidirectional inside a block only
    return {
        "ctx": ctx, "ctx_pos": ctx_pos_t, "block": torch.stack(blocks).view(1, -1), "q_pos": torch.cat(q_pos),
        "mask": torch.cat([see_ctx, see_blk], dim=1), "labels": torch.stack(labels),
        # the same visibility block by block (drafter.Blocks): context rows [start, start + anchor)
        "ctx_start": torch.tensor(ctx_start), "ctx_len": torch.tensor(q_anchor),
    }


def _target_labels(r: dict, a: int, B: int) -> torch.Tensor:
    """Labels [B - 1] of a block anchored at `a` in a teacher-forced record: block position k's label is the
    target's choice for token a + k, kept while the text between the anchor and it is the target's own choices
    (after the first disagreement the target's greedy continuation is unknown: -100, as past a reply's end)."""
    p, tid, resp = len(r["prompt_ids"]), r["target_ids"], r["response_ids"]
    out = [-100] * (B - 1)
    for k in range(1, B):
        i = a + k - p  # reply index of the token block position k predicts
        if i >= len(resp):
            break
        out[k - 1] = tid[i]
        if resp[i] != tid[i]:  # the next label would follow a token the target would not have written
            break
    return torch.tensor(out)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for block positions k = 1 .. B - 1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def block_logits(
    model, drafter: DFlashDrafter, target, batch: dict, device, positions: int | None = None, dense: bool = False,
) -> torch.Tensor:
    """Draft logits [n_blocks, K, V] at block positions 1..K (K = `positions`, default B - 1) for a
    batch (`model` is the drafter or its DDP wrapper). The LM head is most of a step's cost, so K < B - 1
    trains faster at the price of untrained late positions (the block itself stays B wide). Blocks attend
    block by block (`drafter.Blocks`); `dense` takes the batch's dense mask instead (the reference)."""
    hidden = block_hidden(model, drafter, target, batch, device, positions, dense)  # [n_blocks, K, H]
    # with a draft vocabulary: its rows of the head only (labels through drafter.draft_labels)
    return drafter.logits(hidden, target.lm_head, full=False)


def block_hidden(
    model, drafter: DFlashDrafter, target, batch: dict, device, positions: int | None = None, dense: bool = False,
) -> torch.Tensor:
    """The drafter's hidden states [n_blocks, K, H] at block positions 1..K (see `block_logits`)."""
    B = drafter.block_size
    with torch.no_grad():
        emb = target.embed_tokens(batch["block"].to(device))  # frozen, shared
        if drafter.input_scale != 1.0:
            emb = emb * drafter.input_scale
    if dense or any(layer.self_attn.causal or layer.self_attn.window is not None for layer in drafter.layers):
        mask = batch["mask"].to(device)  # [Tq, Tc + Tq]: the reference
    else:  # the same visibility, scored block by block (most of the dense mask's scores are hidden)
        mask = Blocks(batch["ctx_start"].to(device), batch["ctx_len"].to(device), B)
    hidden = model(
        emb, batch["ctx"].to(device, torch.float32), batch["q_pos"].to(device), batch["ctx_pos"].to(device),
        extra_mask=mask,
    )  # [1, Tq, H]
    k = positions or B - 1
    return hidden.view(-1, B, hidden.shape[-1])[:, 1 : 1 + k]  # [n_blocks, K, H]


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Position-weighted CE over valid labels, and the teacher-forced acceptance of these blocks
    (1 + number of leading draft tokens equal to the label = the target's greedy token)."""
    labels = labels[:, : logits.shape[1]].to(logits.device)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none")
    valid = (labels != -100).float()
    w = weights[: logits.shape[1]].to(logits.device)[None] * valid  # [n, B - 1]
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp_min(1e-12)  # a batch may have no label in the vocab
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).int().cumprod(-1)
        accept = 1.0 + hit.sum(-1).float().mean().item()
        acc1 = hit[:, 0].float().mean().item()
    return loss, {"accept": accept, "acc1": acc1}


@torch.no_grad()
def tf_acceptance(drafter, target, records, feats, cols, device, *, n_blocks: int = 256, seed: int = 1234,
                  bf16: bool = False) -> float:
    """Teacher-forced acceptance length on held-out records: blocks at fixed random anchors, draft =
    argmax, accepted = leading drafts equal to the reply (the target's own greedy tokens), plus the
    bonus. Exact for a greedy target whose replies are in the data; no target pass needed."""
    gen = torch.Generator().manual_seed(seed)
    total, n = 0.0, 0
    was = drafter.training
    drafter.eval()
    while n < n_blocks:
        b = make_batch(records, feats, cols, gen, seqs=4, anchors=16, block_size=drafter.block_size,
                       mask_token_id=drafter.mask_token_id)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = block_logits(drafter, drafter, target, b, device)
        labels = drafter.draft_labels(b["labels"].to(device))
        hit = (logits.argmax(-1) == labels).int().cumprod(-1)
        total += (1 + hit.sum(-1)).sum().item()
        n += labels.shape[0]
    drafter.train(was)
    return total / n


def heldout_eval(target, tokenizer, stop_ids, drafter, *, per_kind: int = 8, max_new_tokens: int = 256,
                 kinds: tuple[str, ...] = ("chat", "code", "math")) -> dict:
    """Mean acceptance length (tokens per verify pass, bonus included) of the real speculative loop,
    greedy, on held-out chat / code / math prompts: {"chat": x, "code": y, "math": z, "all": mean},
    each the mean over prompts of `Stats.acceptance_length_mean` (what `dflash generate --json` reports)."""
    from .decoding.speculative import Stats, generate_tokens

    out, every = {}, []
    for kind, chats in dataset.heldout_prompts(per_kind, per_kind, per_kind).items():
        if kind not in kinds:
            continue
        vals = []
        for msgs in chats:
            ids = dataset.encode_chat(tokenizer, msgs)
            stats = Stats()
            for _ in generate_tokens(target, ids, max_new_tokens=max_new_tokens, drafter=drafter,
                                     stop_token_ids=stop_ids, stats=stats):
                pass
            vals.append(stats.acceptance_length_mean)
        out[kind] = round(sum(vals) / len(vals), 4) if vals else None
        every += vals
    out["all"] = round(sum(every) / len(every), 4) if every else None
    return out


# --- training -------------------------------------------------------------------------------------


def load_data(dirs: list[str], mapped: bool = True) -> tuple[list[dict], torch.Tensor, dict]:
    """Records and features of several data directories (same target and taps), as one set; a prompt
    present in more than one directory is kept once. The features stay memory-mapped on disk
    (`data.MappedFeatures`) unless `mapped` is False, so a run may use more data than fits in RAM."""
    records, files, meta, n, seen = [], [], None, 0, set()
    for d in dirs:
        r, f, m = dataset.shard_index(d)
        if not f:
            continue
        if meta is not None and m["taps"] != meta["taps"]:
            raise ValueError(f"{d} caches taps {m['taps']}, others {meta['taps']}")
        meta = m
        for x in r:
            x["start"] += n
            if "target_ids" in x and len(x["target_ids"]) != len(x["response_ids"]):
                raise ValueError(f"{d}: record {x['key']} has {len(x['target_ids'])} target_ids for "
                                 f"{len(x['response_ids'])} reply tokens (one target choice per reply token)")
            if x["key"] not in seen:
                seen.add(x["key"])
                records.append(x)
        files += f
        n += sum(rows for _, rows in f)
    if not files:
        raise ValueError(f"no shard with features yet in {', '.join(dirs)}")
    return records, dataset.read_features(files, mapped), meta


def lr_at(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio (a multiplier of the peak learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def export(drafter: DFlashDrafter, path: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the drafter in the published format (config.json + model.safetensors)."""
    d = DFlashDrafter(drafter.config)
    d.load_state_dict(drafter.state_dict())
    d.set_draft_vocab(drafter.draft_vocab)
    d = d.to(getattr(torch, dtype))
    d.save(path)
    return Path(path)


def top_tokens(records: list[dict], n: int) -> list[int]:
    """The n most frequent tokens of the replies (ties: lower id first): a draft vocabulary."""
    counts = torch.bincount(torch.tensor([t for r in records for t in r["response_ids"]], dtype=torch.long))
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))
    return sorted(t for t in order[:n] if counts[t] > 0)


def log_line(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def train(a: argparse.Namespace) -> dict:
    """Run (or resume) one training run; returns the last logged metrics."""
    from tqdm import tqdm

    if a.draft_vocab is not None and a.draft_vocab < 1:
        raise ValueError(f"--draft-vocab needs a positive number of tokens, got {a.draft_vocab}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # torchrun: one process per device, gradients averaged by DDP
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = loading.pick_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    main = rank == 0

    records, feats, meta = load_data(a.data.split(","))
    model_path = loading.resolve_model(a.model or meta["model"])
    tcfg = json.loads((model_path / "config.json").read_text())
    target = loading.load_target(model_path, device, torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    cached = meta["taps"]
    taps = [int(t) for t in a.taps.split(",")] if a.taps else cached
    missing = [t for t in taps if t not in cached]
    if missing:
        raise ValueError(f"taps {missing} are not cached in {a.data} (cached: {cached})")
    h = tcfg["hidden_size"]
    cols = torch.cat([torch.arange(cached.index(t) * h, (cached.index(t) + 1) * h) for t in taps])
    train_recs, val_recs = split_records(records)
    if not val_recs:  # too few records for the hash split: hold out the last one
        train_recs, val_recs = train_recs[:-1], train_recs[-1:]
    val_keys = {r["key"] for r in val_recs}  # fixed for the run, so evals stay comparable as data grows

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_file, log_file = out / "checkpoint.pt", out / "log.jsonl"
    ckpt = torch.load(ckpt_file, map_location="cpu", weights_only=False) if a.resume and ckpt_file.is_file() else None
    if ckpt is not None:
        config = ckpt["config"]
    elif a.init_from:
        config = json.loads((Path(a.init_from) / "config.json").read_text())  # same shape, continue training
        if DFLASH2 in config.get("architectures", []):
            config = first_format_config(config)  # its drafter trains on; its selector would no longer fit it
        have = config["num_hidden_layers"]
        if a.layers is not None and a.layers < have:
            raise ValueError(f"--layers {a.layers}: {a.init_from} has {have} draft layers; "
                             "a drafter can grow, not shrink")
        config["num_hidden_layers"] = a.layers or have
    else:
        mask_id = a.mask_token_id if a.mask_token_id is not None else tcfg["vocab_size"] - 1
        name = a.name or tcfg.get("converted_from") or model_path.name
        name = registry.base_name(name)
        config = drafter_config(tcfg, layers=a.layers or 2, taps=taps, block_size=a.block_size, mask_token_id=mask_id,
                                name=name, intermediate_size=a.intermediate_size)
    drafter = DFlashDrafter(config).to(device)
    how = "resumed"
    if ckpt is not None:
        drafter.load_state_dict(ckpt["drafter"])
        drafter.set_draft_vocab(ckpt.get("draft_vocab"))
    elif a.init_from:
        init = load_drafter(a.init_from, dtype=torch.float32)
        how = f"weights from {a.init_from}"
        if isinstance(init, DFlash2Drafter):
            init = init.first_format()
            how += " (its drafter without the candidate selector; `dflash train --selector` trains one for the result)"
        how += grow_from(drafter, init)
        drafter.set_draft_vocab(init.draft_vocab)
    elif a.init == "target":
        how = init_from_target(drafter, target, a.norm_scale)
    else:
        init_random(drafter, target, a.seed, a.norm_scale)
        how = "random init"
    if ckpt is None and a.draft_vocab is not None:  # from the training replies only: the held-out ones stay unseen
        drafter.set_draft_vocab(top_tokens(train_recs, a.draft_vocab) if a.draft_vocab < tcfg["vocab_size"] else None)
    if drafter.draft_vocab is not None:
        how += f"; draft vocabulary of {len(drafter.draft_vocab)} tokens"
    model = drafter
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)
    decay = [p for p in drafter.parameters() if p.dim() > 1]
    no_decay = [p for p in drafter.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95))
    step, tokens = 0, 0
    if ckpt is not None:
        opt.load_state_dict(ckpt["optim"])
        step, tokens = ckpt["step"], ckpt["tokens"]
    weights = position_weights(drafter.block_size, a.gamma)
    n_tok = sum(len(r["response_ids"]) for r in train_recs)
    if main:
        print(f"train: {len(train_recs)} replies ({n_tok} reply tokens) for training, {len(val_recs)} held out; "
              f"drafter {num_params(drafter) / 1e6:.2f}M params, {len(drafter.layers)} layers, taps {taps}; {how}; "
              f"device {device}, world {world}", file=sys.stderr)
        log_line(log_file, {"event": "start", "step": step, "params": num_params(drafter),
                            "layers": len(drafter.layers), "taps": taps, "train_replies": len(train_recs),
                            "train_reply_tokens": n_tok,
                            "args": {k: v for k, v in vars(a).items() if k != "func"}})

    def save_ckpt() -> None:
        vocab = None if drafter.draft_vocab is None else drafter.draft_vocab.tolist()
        torch.save({"step": step, "tokens": tokens, "config": config, "drafter": drafter.state_dict(),
                    "optim": opt.state_dict(), "draft_vocab": vocab}, ckpt_file.with_suffix(".tmp"))
        ckpt_file.with_suffix(".tmp").rename(ckpt_file)

    def evaluate() -> dict:
        row = {"step": step, "tokens": tokens,
               "tf_accept": round(tf_acceptance(drafter, target, val_recs, feats, cols, device,
                                                n_blocks=a.eval_blocks, bf16=a.bf16), 4)}
        if a.spec_eval_every and (step % a.spec_eval_every == 0 or step == a.steps):
            tok = loading.load_tokenizer(model_path)
            drafter.eval()
            row["heldout_accept"] = heldout_eval(target, tok, loading.stop_token_ids(model_path, tok), drafter,
                                                 per_kind=a.spec_eval_prompts, max_new_tokens=a.spec_eval_tokens)
            drafter.train()
        return row

    last = {}
    bar = tqdm(total=a.steps, initial=step, disable=not main, dynamic_ncols=True)
    drafter.train()
    t_start = time.time()
    while step < a.steps:
        if a.reload_every and step and step % a.reload_every == 0:
            # Pick up shards written since (generation still running); the held-out records stay the same.
            records, feats, _ = load_data(a.data.split(","))
            val_recs = [r for r in records if r["key"] in val_keys]
            # New records of the held-out hash split are not trained on either (they stay held out).
            train_recs = [r for r in split_records(records)[0] if r["key"] not in val_keys]
            if main:
                log_line(log_file, {"event": "reload", "step": step, "train_replies": len(train_recs),
                                    "train_reply_tokens": sum(len(r["response_ids"]) for r in train_recs)})
        # The batch of a step depends only on (seed, rank, step): a resumed run sees the same data.
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + rank * 7919 + step)
        t0 = time.time()
        batch = make_batch(train_recs, feats, cols, gen, seqs=a.seqs, anchors=a.anchors,
                           block_size=drafter.block_size, mask_token_id=drafter.mask_token_id)
        for g in opt.param_groups:
            g["lr"] = a.lr * lr_at(step, a.steps, a.warmup, a.min_lr_ratio)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
            logits = block_logits(model, drafter, target, batch, device, a.loss_positions)
            loss, m = block_loss(logits, drafter.draft_labels(batch["labels"]), weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), a.clip).item()
        opt.step()
        step += 1
        n_lab = int((batch["labels"] != -100).sum())
        tokens += n_lab * world
        dt = time.time() - t0
        last = {"step": step, "loss": round(loss.item(), 4), "accept": round(m["accept"], 3),
                "acc1": round(m["acc1"], 3), "lr": opt.param_groups[0]["lr"], "grad_norm": round(gnorm, 3),
                "tokens": tokens, "tok_s": round(n_lab * world / dt, 1), "elapsed": round(time.time() - t_start, 1)}
        if main:
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['accept']:.2f}", tok_s=f"{last['tok_s']:.0f}")
            if step % a.log_every == 0 or step == a.steps:
                log_line(log_file, last)
            if a.eval_every and (step % a.eval_every == 0 or step == a.steps):
                row = evaluate()
                row["elapsed"] = round(time.time() - t_start, 1)
                log_line(log_file, {"event": "eval", **row})
                tqdm.write(f"eval step {step}: {json.dumps(row)}", file=sys.stderr)
                last.update(row)
            if step % a.save_every == 0 or step == a.steps or step == a.stop_after:
                save_ckpt()
        if step == a.stop_after:
            break  # as if interrupted: the run continues with --resume
        if a.max_minutes and time.time() - t_start > 60 * a.max_minutes:
            if main:
                save_ckpt()
                row = evaluate()
                log_line(log_file, {"event": "eval", **row, "elapsed": round(time.time() - t_start, 1)})
                last.update(row)
            a.steps = step  # out of time: finish here (export included)
            break
    bar.close()
    if main and a.export and step == a.steps:
        export(drafter, a.export, a.export_dtype)
        print(f"train: exported the drafter to {a.export} ({a.export_dtype})", file=sys.stderr)
    if world > 1:
        torch.distributed.destroy_process_group()
    return last


def cmd_train(a: argparse.Namespace) -> int:
    if a.eval:
        if a.threads:
            torch.set_num_threads(a.threads)
        path = loading.resolve_model(a.model)
        target = loading.load_target(path, loading.pick_device(a.device), torch.float32)
        tok = loading.load_tokenizer(path)
        drafter = load_drafter(a.eval, device=target.lm_head.weight.device, dtype=torch.float32)
        if a.draft_window is not None:
            drafter.set_window(a.draft_window or None, a.draft_sinks)
        t0 = time.time()
        res = heldout_eval(target, tok, loading.stop_token_ids(path, tok), drafter, per_kind=a.spec_eval_prompts,
                           max_new_tokens=a.spec_eval_tokens, kinds=tuple(a.eval_kinds.split(",")))
        print(json.dumps({"drafter": str(a.eval), "heldout_accept": res, "seconds": round(time.time() - t0, 1)}))
        return 0
    if not a.data or not a.out:
        raise ValueError("dflash train needs --data DIR and --out DIR (or --eval DRAFTER_DIR)")
    if a.selector:
        from .train_selector import train_selector

        print(json.dumps(train_selector(a)))
        return 0
    print(json.dumps(train(a)))
    return 0


def add_parser(sub) -> None:
    """Register `dflash train`."""
    p = sub.add_parser("train", help="train a DFlash drafter on cached target replies and features")
    p.add_argument("--data", default=None,
                   help="data directory written by `python -m dflash_torch.data` (comma-separated: several)")
    p.add_argument("--out", default=None, help="run directory: checkpoint.pt, log.jsonl")
    p.add_argument("--model", default=None, help="target (default: the one recorded in the data)")
    p.add_argument("--name", default=None, help="target name recorded in the drafter (default: from the model)")
    p.add_argument("--layers", type=int, default=None,
                   help="draft layers (default 2; with --init-from: as it has, or more to grow it)")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP size (default: the target's)")
    p.add_argument("--taps", default=None, help="comma-separated tap layers (default: all cached)")
    p.add_argument("--init", choices=("target", "random"), default="target",
                   help="target = copy the target's top layers (default)")
    p.add_argument("--init-from", default=None, metavar="DRAFTER_DIR",
                   help="start from an exported drafter (its config and weights) instead of --init")
    p.add_argument("--norm-scale", type=float, default=0.3, help="initial final norm = target's x this")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None, help="default: vocab_size - 1")
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block positions")
    p.add_argument("--loss-positions", type=int, default=None,
                   help="train block positions 1..K only (default: all B - 1); saves LM-head compute")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seqs", type=int, default=4, help="sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="anchors (blocks) per sequence")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100, help="teacher-forced held-out acceptance every N steps")
    p.add_argument("--eval-blocks", type=int, default=256)
    p.add_argument("--spec-eval-every", type=int, default=0, help="real speculative held-out eval every N steps")
    p.add_argument("--spec-eval-prompts", type=int, default=8, help="held-out prompts per kind (chat, code, math)")
    p.add_argument("--spec-eval-tokens", type=int, default=256)
    p.add_argument("--eval-kinds", default="chat,code,math", help="held-out prompt kinds for --eval")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--reload-every", type=int, default=0,
                   help="reload the data directories every N steps (data still being generated)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--max-minutes", type=float, default=None, help="finish (eval, save, export) after this long")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step (checkpointed; resume later)")
    p.add_argument("--export", default=None, help="write the final drafter here (published format)")
    p.add_argument("--export-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="propose only the N most frequent reply tokens: the LM head's cost in training and "
                        "draft passes drops to N rows (saved as draft_vocab.json; default: as --init-from, "
                        "else the whole vocabulary)")
    p.add_argument("--eval", default=None, metavar="DRAFTER_DIR",
                   help="only measure a drafter's held-out acceptance with the real speculative loop")
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="with --eval: the drafter attends to its first --draft-sinks and last N context positions "
                        "(0: all; default: as its config says)")
    p.add_argument("--draft-sinks", type=int, default=64, metavar="N")
    p.add_argument("--selector", action="store_true",
                   help="train a DFlash2 candidate selector for the drafter --init-from (kept frozen) and export a "
                        "DFlash2 drafter (train_selector.py); --loss-positions: block positions trained (default 8)")
    p.add_argument("--selector-rank", type=int, default=16, help="with --selector: rank of its codebooks")
    p.add_argument("--selector-top-k", type=int, default=4, help="with --selector: candidates per position")
    p.add_argument("--selector-blocks", type=int, default=20000, help="with --selector: training blocks")
    p.add_argument("--selector-epochs", type=int, default=20, help="with --selector: epochs over those blocks")
    p.add_argument("--selector-ensemble", type=int, default=1,
                   help="with --selector: train this many selectors (seeds --seed, --seed + 1, ...) on the same "
                        "drafter passes and export their average, one selector of rank N x --selector-rank")
    p.set_defaults(func=cmd_train)
