"""Drafter-training data from ShareGPT's own assistant text, teacher-forced through the target: no generation.

`python -m dflash_torch.data` has the target write every reply (a decode step per token); here one prefill per
record runs the target over a ShareGPT conversation as written (history, user turn, the assistant turn as ShareGPT
has it) and keeps, beside the tap features of every token, the target's own greedy choice at every reply position
(`target_ids`: `target_ids[j]` is the target's argmax for reply token j given every token before it). Those are
the labels a drafter needs, wherever they are the target's: `train.make_batch` anchors blocks only where the
text's token is the target's own choice (as a real anchor, the target's bonus token, always is) and keeps block
position k's label only while the text before it agrees with the target's choices, so every label is exactly
what the target's greedy decoding would write after that context.

Runs on the weights `dflash generate` runs (`--quantize auto`: the GGUF's blocks), so the features and labels are
those of the served target. Shards are written as in `python -m dflash_torch.data` (rerun to resume); `dflash
train --data DIR` reads them. Left out: conversations whose first user turn is in the held-out split and those the
replay bench and the long-context suite read first.

    python tools/teacher_forced_data.py --out runs/tf-data --limit 4000 [--skip 0] [--turns 3] [--threads 2]

With `--prompts FILE` (a JSONL as `python -m dflash_torch.data --prompts` reads) the replies are the target's own:
`dflash generate`'s loop writes each one greedily (drafter, prompt lookup, adaptive width, fallback: output equal
to target-only decoding, at its speed), then the same prefill gives the features, and every label is valid.

    python tools/teacher_forced_data.py --out runs/gen --prompts runs/turn3.jsonl [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from sharegpt_turns import REPLAY_RESERVE  # (tools/, beside this script) the conversations the replay bench reads

from dflash_torch import data
from dflash_torch.bench_longctx import conversations, sharegpt_multiturn
from dflash_torch.generate import generate, load


def records_of(tok, turns: list[tuple[str, str]], n_turns: int, max_prompt: int, max_reply: int, end: int):
    """(messages, prompt ids, reply ids) of a conversation's first `n_turns` assistant turns, each after its
    history as ShareGPT has it; stops at the first turn whose prompt is longer than `max_prompt` tokens."""
    msgs: list[dict] = []
    out = []
    for role, text in turns:
        text = text.strip()
        if not text:
            return out
        if role == "assistant" and msgs and msgs[-1]["role"] == "user":
            prompt = data.encode_chat(tok, msgs)
            if len(prompt) > max_prompt:
                return out
            reply = tok.encode(text, add_special_tokens=False)[:max_reply]
            if len(reply) < max_reply:
                reply.append(end)  # the whole turn: the drafter also learns to end
            out.append((list(msgs), prompt, reply))
            if len(out) == n_turns:
                return out
        elif msgs and msgs[-1]["role"] == role:
            return out
        msgs.append({"role": role, "content": text})
    return out


def controllers(p):
    """A new controller per reply, `dflash generate`'s default for a greedy run: the fallback around the adaptive
    width, from the costs calibrated once for this machine."""
    from dflash_torch.decoding.adaptive import AdaptiveBlockSize, WithFallback, calibrated
    from dflash_torch.decoding.fallback import FallbackController

    costs = calibrated(p)
    return lambda: WithFallback(FallbackController(), AdaptiveBlockSize(costs, p.drafter.block_size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", type=int, default=0, help="conversations (after the ones left out) to pass over")
    ap.add_argument("--limit", type=int, default=2000, help="conversations to use")
    ap.add_argument("--turns", type=int, default=3, help="assistant turns per conversation")
    ap.add_argument("--max-prompt-tokens", type=int, default=640)
    ap.add_argument("--max-reply-tokens", type=int, default=320)
    ap.add_argument("--shard-size", type=int, default=128, help="records per shard")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default=None, help="JSONL of prompts: the target writes the replies (see above)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="with --prompts: the longest reply")
    args = ap.parse_args()
    if args.prompts and not Path(args.prompts).is_file():
        sys.exit(f"teacher_forced_data: --prompts {args.prompts}: no such file")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = load(draft="auto" if args.prompts else None, quantize="auto", quiet=True)
    tok, target = p.tokenizer, p.target
    taps = data.default_taps(target.num_layers)
    end = p.stop_token_ids[0]
    meta = {"model": str(p.model_path), "taps": taps, "hidden_size": target.config.hidden_size,
            "source": f"replies generated for {args.prompts}" if args.prompts else "sharegpt teacher-forced",
            "quantize": p.quantize, "labels": "target_ids"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    done = {r["key"] for s in data.shard_paths(out) for r in data.read_records(s)}
    reserved = {c["id"].removeprefix("sharegpt:") for c in sharegpt_multiturn(REPLAY_RESERVE)}

    def wanted():
        n = 0
        for cid, turns in conversations():
            users = [t.strip() for r, t in turns if r == "user"]
            if cid in reserved or not users or data.heldout_key(users[0]):
                continue
            n += 1
            if n <= args.skip:
                continue
            if n > args.skip + args.limit:
                return
            yield from records_of(tok, turns, args.turns, args.max_prompt_tokens, args.max_reply_tokens, end)

    def generated():
        """The prompts of --prompts with the target's greedy replies (the stop token kept, as the data tool does)."""
        new_controller = controllers(p)
        for msgs in data.jsonl_prompts(args.prompts)[args.skip : args.skip + args.limit]:
            if data.chat_key(msgs) in done:
                continue
            prompt = data.encode_chat(tok, msgs)
            if len(prompt) > args.max_prompt_tokens:
                continue
            yield msgs, prompt, generate(p, prompt, args.max_new_tokens, controller=new_controller()).token_ids

    shard = len(data.shard_paths(out))
    recs, feats, t0, n_tok, agree = [], [], time.time(), 0, [0, 0]

    def flush() -> None:
        nonlocal shard, recs, feats
        if not recs:
            return
        path = out / f"shard-{shard:05d}.jsonl"
        save_file({"features": torch.cat(feats)}, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path.with_suffix(".safetensors"))
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))  # the records last: a shard is whole or absent
        shard, recs, feats = shard + 1, [], []

    with torch.inference_mode():
        for msgs, prompt, reply in generated() if args.prompts else wanted():
            key = data.chat_key(msgs)
            if key in done:
                continue
            done.add(key)
            ids = prompt + reply
            cache = target.new_cache(len(ids))
            o = target(torch.tensor([ids]), cache, logits="all", taps=taps)
            choice = o.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()  # the target's token for each reply position
            recs.append({"key": key, "prompt_ids": prompt, "response_ids": reply, "target_ids": choice})
            feats.append(o.hidden[0].to(torch.bfloat16))  # [T, n_taps * H]
            n_tok += len(ids)
            agree[0] += sum(a == b for a, b in zip(choice, reply))
            agree[1] += len(reply)
            if len(recs) == args.shard_size:
                flush()
                dt = time.time() - t0
                print(f"shard {shard}: {n_tok} tokens, {n_tok / dt:.0f} tok/s ({agree[1] / dt:.0f} reply tok/s), "
                      f"text = target's choice at {agree[0] / agree[1]:.1%} of reply tokens",
                      file=sys.stderr, flush=True)
    flush()
    print(f"done: {shard} shards, {n_tok} tokens this run in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
