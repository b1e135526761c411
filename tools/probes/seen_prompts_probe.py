"""How far a drafter's acceptance on the prompts it was trained on is from its acceptance on new ones.

Three sets of prompts, the same real speculative loop for each (greedy, block 16, the drafter alone,
float32 target, the drafter's whole context: what `dflash train --eval DIR --draft-window 0` runs):
  trained   ShareGPT training-split prompts from --skip on that training kept (key outside the 1/20
            validation split, at most --max-prompt-tokens tokens): replies the drafter has seen
  val       the same range's validation-split prompts (the records `tf_accept` is measured on)
  heldout   the held-out ShareGPT prompts `dflash train --eval` uses for "chat"
Per prompt it also replays the loop from teacher-forced drafts: the drafter's block at every anchor of
the generated reply, with the context features of one target pass over prompt + reply, then the cycles
the loop would run (anchor -> anchor + accepted + 1). Equal to the real loop's figure, it shows that
inference computes what training measures, so a gap between the sets is the drafter's, not the loop's.

    python tools/probes/seen_prompts_probe.py --per-set 4
    python tools/probes/seen_prompts_probe.py --drafter runs/export-s5 --skip 3000
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflash_torch import data, loading
from dflash_torch import train as T
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens


@torch.no_grad()
def anchor_logits(target, drafter, toks: list[int], p: int):
    """The drafter's blocks at every anchor of reply toks[p:], teacher-forced (the context features of one target
    pass over toks): yields (anchors, logits [A, B - 1, V']) for 64 anchors at a time."""
    B, n = drafter.block_size, len(toks)
    feats = target(torch.tensor([toks]), target.new_cache(n), logits=None, taps=drafter.target_layer_ids).hidden[0]
    anchors = list(range(p, n - 1))
    for i in range(0, len(anchors), 64):  # blocks at 64 anchors per pass, each seeing the context before it
        part = anchors[i : i + 64]
        block = torch.full((len(part), B), drafter.mask_token_id)
        block[:, 0] = torch.tensor([toks[a] for a in part])
        batch = {"ctx": feats[: part[-1]].unsqueeze(0).float(), "ctx_pos": torch.arange(part[-1]),
                 "block": block.view(1, -1), "q_pos": torch.cat([torch.arange(a, a + B) for a in part]),
                 "ctx_start": torch.zeros(len(part), dtype=torch.long), "ctx_len": torch.tensor(part), "mask": None}
        yield part, T.block_logits(drafter, drafter, target, batch, torch.device("cpu"))


def load_float32(drafter_path: str):
    """(target, tokenizer, stop ids, drafter) as `dflash train --eval --draft-window 0` loads them: the default
    model in float32, the drafter over its whole context."""
    path = loading.resolve_model(None)
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    tok = loading.load_tokenizer(path)
    drafter = load_drafter(drafter_path, device=torch.device("cpu"), dtype=torch.float32)
    drafter.set_window(None)
    return target, tok, loading.stop_token_ids(path, tok), drafter


@torch.no_grad()
def replayed(target, drafter, toks: list[int], p: int) -> tuple[float, float]:
    """(acceptance of the loop replayed from teacher-forced drafts, mean teacher-forced acceptance over
    all anchors) of reply toks[p:]."""
    B, n = drafter.block_size, len(toks)
    tt = torch.tensor(toks + [-100] * B)
    accept = {}
    for part, logits in anchor_logits(target, drafter, toks, p):
        labels = drafter.draft_labels(torch.stack([tt[a + 1 : a + B] for a in part]))
        hit = (logits.argmax(-1) == labels).int().cumprod(-1)
        accept.update(zip(part, (1 + hit.sum(-1)).tolist()))
    a, cycles = p, 0
    while a < n - 1:
        a += accept[a]
        cycles += 1
    return (n - 1 - p) / cycles, statistics.mean(accept.values())


def prompt_sets(tok, per_set: int, skip: int, max_prompt_tokens: int) -> dict[str, list]:
    sets: dict[str, list] = {"trained": [], "val": []}
    for msgs in data.sharegpt_prompts("train")[skip:]:
        kind = "val" if int(data.chat_key(msgs)[:8], 16) % 20 == 0 else "trained"
        if len(sets[kind]) < per_set and len(data.encode_chat(tok, msgs)) <= max_prompt_tokens:
            sets[kind].append(msgs)
        if all(len(v) >= per_set for v in sets.values()):
            break
    sets["heldout"] = data.sharegpt_prompts("heldout", limit=per_set, max_chars=600)
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="dflash_torch/drafters/smollm2-135m-instruct")
    ap.add_argument("--per-set", type=int, default=4)
    ap.add_argument("--skip", type=int, default=300, help="training-split prompts before the trained range")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok, stops, drafter = load_float32(args.drafter)
    for name, chats in prompt_sets(tok, args.per_set, args.skip, args.max_prompt_tokens).items():
        real = []
        for msgs in chats:
            ids = data.encode_chat(tok, msgs)
            stats = Stats()
            out = [int(t) for t in generate_tokens(target, ids, max_new_tokens=args.tokens, drafter=drafter,
                                                   stop_token_ids=stops, stats=stats)]
            loop, tf = replayed(target, drafter, ids + out, len(ids))
            real.append(stats.acceptance_length_mean)
            print(f"{name:8s} loop {stats.acceptance_length_mean:.3f}  replayed {loop:.3f}  "
                  f"teacher-forced (all anchors) {tf:.3f}  tokens {len(out)}", flush=True)
        print(f"{name:8s} mean loop acceptance {statistics.mean(real):.3f} over {len(real)} prompts", flush=True)


if __name__ == "__main__":
    main()
