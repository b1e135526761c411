"""Prompts for drafter data that no dataset holds: user turns written by the target itself, and ShareGPT first turns
that no generated data set has used yet.

The target samples a user turn from the chat template's opening of one (as the Magpie recipe does), after an optional
opener that steers its kind: a code request in the held-out code prompts' wording ("Complete this Python function."
and a `def`), a question opener for arithmetic, nothing for open chat. The prompts are the target's own, not the
held-out ones: those are ShareGPT's held-out split, HumanEval problems and `data.MATH_PROMPTS`, and a sampled prompt
equal to one of them is dropped. Writes a JSONL of {"prompt": ...} for `tools/teacher_forced_data.py --prompts`.

    python tools/self_prompts.py --out runs/self-prompts.jsonl --code 250 --math 250 --chat 150 \
        --sharegpt-from 8160 --sharegpt-to 9000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from dflash_torch import data
from dflash_torch.decoding.sampling import Sampler
from dflash_torch.generate import generate, load

CODE_OPENER = "Complete this Python function.\n\n```python\ndef"  # the name comes with its space
MATH_OPENERS = ["Calculate", "Solve for x:", "What is the value of", "Find the", "How many", "Compute", "Simplify",
                "What is the product of", "A store sells", "Convert"]
MARK = "\x00"  # stands for the user turn while the template is rendered, so the opening can be cut at it


def user_turn_opening(tok) -> list[int]:
    """Token ids of the chat template up to where a user turn's text starts."""
    text = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=False)
    return tok.encode(text[: text.index(MARK)], add_special_tokens=False)


def function_head(code: str) -> str:
    """The `def` line and its docstring, if one follows: a function to complete, as HumanEval poses one."""
    lines = code.split("```")[0].rstrip().splitlines()
    head = lines[:1]
    if len(lines) > 1 and lines[1].strip()[:3] in ('"""', "'''"):
        quote = lines[1].strip()[:3]
        for line in lines[1:]:
            head.append(line)
            if line.strip().endswith(quote) and (len(head) > 2 or line.strip() != quote):
                break
        else:
            return head[0]  # the docstring never ends: the signature alone
    return "\n".join(head)


def sampled(p, ids: list[int], seed: int, max_tokens: int):
    return generate(p, ids, max_tokens, use_draft=False, sampler=Sampler(temperature=1.0, top_p=0.95, seed=seed))


def sampled_turn(p, opening: list[int], opener: str, seed: int, max_tokens: int) -> str | None:
    """One user turn the target writes after `opener`; None if it does not end within `max_tokens`. A code request
    is cut to its function's head; one without a docstring gets one the target writes after its `def` line."""
    enc = lambda s: p.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    r = sampled(p, opening + (enc(opener) if opener else []), seed, max_tokens)
    text = (opener + p.tokenizer.decode(r.token_ids, skip_special_tokens=True)).strip()
    if opener == CODE_OPENER:
        head = function_head(text[len(CODE_OPENER) - len("def"):])
        if "\n" not in head:  # the signature alone: the target writes its docstring
            start = head + '\n    """'
            r = sampled(p, opening + enc(CODE_OPENER[: -len("def")] + start), seed + 1, 96)
            doc = p.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            if '"""' in doc:
                doc = doc[: doc.index('"""')]
                head = start + doc.rstrip() + ('\n    """' if "\n" in doc else '"""')
        return CODE_OPENER[: -len("def")] + head + "\n```"
    if r.finish_reason != "stop":
        return None
    return text if len(text) > len(opener) + 8 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--code", type=int, default=0, help="code requests to sample")
    ap.add_argument("--math", type=int, default=0, help="arithmetic questions to sample")
    ap.add_argument("--chat", type=int, default=0, help="open user turns to sample")
    ap.add_argument("--sharegpt-from", type=int, default=0, help="first ShareGPT training first turn to take")
    ap.add_argument("--sharegpt-to", type=int, default=0, help="one past the last (0: none)")
    ap.add_argument("--max-chars", type=int, default=2000, help="longest ShareGPT first turn kept")
    ap.add_argument("--max-tokens", type=int, default=160, help="longest sampled user turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rows = [{"prompt": m[0]["content"], "source": "sharegpt"}
            for m in data.sharegpt_prompts("train", max_chars=args.max_chars)[args.sharegpt_from : args.sharegpt_to]]
    if args.code + args.math + args.chat:
        p = load(draft=None, quantize="auto", quiet=True)
        opening = user_turn_opening(p.tokenizer)
        held = {m[0]["content"].strip() for kind in data.heldout_prompts(50, 164, 50).values() for m in kind}
        rng = random.Random(args.seed)
        kinds = ["code"] * args.code + ["math"] * args.math + ["chat"] * args.chat
        seen, t0 = {r["prompt"] for r in rows}, time.time()
        for i, kind in enumerate(kinds):
            opener = CODE_OPENER if kind == "code" else rng.choice(MATH_OPENERS) if kind == "math" else ""
            for attempt in range(4):  # a turn that runs on past max_tokens is drawn again
                text = sampled_turn(p, opening, opener, args.seed * 1_000_003 + i * 7 + attempt, args.max_tokens)
                if text and text not in seen and text not in held:
                    seen.add(text)
                    rows.append({"prompt": text, "source": f"self-{kind}"})
                    break
            if (i + 1) % 50 == 0:
                print(f"{i + 1}/{len(kinds)} sampled, {len(rows)} prompts, {time.time() - t0:.0f} s", file=sys.stderr)
    random.Random(args.seed).shuffle(rows)  # kinds interleaved: a data run stopped early still has each
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
