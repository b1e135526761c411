"""Mean per-token negative log-likelihood of the default model on held-out ShareGPT conversations, for each
weight format: what the 8-bit activation blocks of the block kernels (and each weight format) cost.

    python tools/activation_nll.py [--texts 50] [--tokens 256] [--formats none,q8_0,q4_1,q4_0,int4]
                                   [--float32-cache]

Each text is a held-out conversation's first exchange (user turn and the reply) through the chat
template, cut to --tokens tokens; the NLL is the mean over every predicted token of every text. Formats:
none is float32 (the GGUF file's weights dequantized), q4_1 / q8_0 the file's own blocks (its layers /
its LM head), q4_0 and q8_0 for all layers the same weights quantized again, int4 PyTorch's kernel.
The block formats keep the KV cache in float16; --float32-cache adds a row for each of them with a
float32 cache (what the float16 cache costs).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def texts(n: int) -> list[list[dict]]:
    from dflash_torch.data import heldout_key, iter_sharegpt

    out = []
    for rec in iter_sharegpt():
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        user, reply = (conv[0].get("value") or "").strip(), (conv[1].get("value") or "").strip()
        if user and reply and heldout_key(user):
            out.append([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
            if len(out) >= n:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--formats", default="none,q8_0,q4_1,q4_0,int4")
    ap.add_argument("--float32-cache", action="store_true", help="also each block format with a float32 cache")
    args = ap.parse_args()
    from dflash_torch import load, prompt_logprobs

    convs = texts(args.texts)
    rows = []
    for fmt in args.formats.split(","):
        pipe = load(draft=None, quantize=fmt, quiet=True)
        ids = [pipe.encode_messages(c)[: args.tokens] for c in convs]
        caches = [None]
        if args.float32_cache and getattr(pipe.target, "cache_dtype", None) is not None:
            caches.append(torch.float32)
        for cache in caches:
            if cache is not None:
                pipe.target.cache_dtype = None  # the weights' dtype: float32
            t0, total, count = time.perf_counter(), 0.0, 0
            for seq in ids:
                lp = prompt_logprobs(pipe, seq)
                total -= sum(e[0] for e in lp.entries)
                count += len(lp.entries)
            kv = str(pipe.target.new_cache(1).k.dtype).removeprefix("torch.")
            row = {"format": fmt, "lm_head": pipe.lm_head, "kv_cache": kv, "texts": len(ids), "tokens": count,
                   "nll": total / count, "ppl": math.exp(total / count),
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]["nll"]
    print(f"{'format':>8} {'LM head':>8} {'KV cache':>9} {'NLL':>8} {'vs ' + rows[0]['format']:>10} {'ppl':>8}")
    for r in rows:
        print(f"{r['format']:>8} {str(r['lm_head']):>8} {r['kv_cache']:>9} {r['nll']:8.4f} {r['nll'] - base:+10.4f} "
              f"{r['ppl']:8.3f}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
