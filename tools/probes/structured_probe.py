"""Structured output with the drafter: drafts chosen under the grammar or not (docs/performance.md).

Loads the embedded default model and its drafter and generates JSON that follows a schema for a few
prompts, greedy, 16-wide blocks, prompt lookup and the fallback off (the drafter alone), twice: with
the drafter's proposals masked by the grammar position by position (what the loop does), and with its
plain argmax. It prints the mean acceptance length and tok/s of each, and checks that both emit the same
tokens (the proposal never changes the output).

It then times a forced tool call (`tool_choice: "required"`'s grammar, one line of JSON) for four
prompts in three modes, in turn: target-only decoding, prompt lookup with the grammar's forced tokens
as drafts (no drafter), and the drafter with the target-only fallback (how `dflash generate` runs),
checking that all three emit the same tokens.

    python tools/probes/structured_probe.py --quantize int4
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_torch.decoding import structured
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.speculative import Stats
from dflash_torch.generate import load, stream
from dflash_torch.serve.tool_calls import forced_call_grammar

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "maximum": 150},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
          "required": ["name", "age", "city", "hobbies"]}
EVENT = {"type": "function", "function": {"name": "create_event", "parameters": {
    "type": "object", "additionalProperties": False,
    "properties": {"title": {"type": "string", "maxLength": 40}, "location": {"type": "string", "maxLength": 30},
                   "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                   "duration_minutes": {"type": "integer", "maximum": 600}, "reminder": {"type": "boolean"}},
    "required": ["title", "location", "attendees", "duration_minutes", "reminder"]}}}
CALL_PROMPTS = ["Schedule a team meeting in Room 4 with Ann and Bob for an hour.",
                "Plan a dinner at Luigi's with my parents.", "Book a 30 minute call with Sam, remind me.",
                "Set up a workshop in the lab for the interns."]
PROMPTS = ["Describe a person named Alice, 30, from Paris who likes chess, as JSON.",
           "Create a JSON profile for a chef from Rome.", "Give me a JSON record of a student named Tom.",
           "JSON for a retired teacher living in Oslo who enjoys hiking."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", default="int4", choices=["auto", "int8", "int4", "none"])
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--rounds", type=int, default=2, help="each way this many times, in turn")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(quiet=True, quantize=None if args.quantize == "none" else args.quantize)
    masked = structured.Constraint.draft

    def plain(self, draft_logits, sampler):
        return sampler.draft(draft_logits)

    outputs = {}
    for r in range(args.rounds):
        for name, draft in (("plain drafts", plain), ("grammar-masked drafts", masked)):
            structured.Constraint.draft = draft
            accept, tokens, seconds, outs = [], 0, 0.0, []
            for prompt in PROMPTS:
                stats, ids = Stats(), pipe.encode(prompt)
                t = time.perf_counter()
                out = list(stream(pipe, ids, args.max_tokens, stats=stats, lookup=False,
                                  constraint=pipe.constraint("json_schema", SCHEMA)))
                seconds += time.perf_counter() - t
                accept.append(stats.acceptance_length_mean)
                tokens += len(out)
                outs.append(out)
            outputs.setdefault(name, outs)
            print(f"round {r + 1}, {name:22s}: acceptance length {sum(accept) / len(accept):.3f}, "
                  f"{tokens / seconds:.1f} tok/s ({tokens} tokens)")
    structured.Constraint.draft = masked
    same = outputs["plain drafts"] == outputs["grammar-masked drafts"]
    print(f"same tokens both ways: {same}")

    grammar = forced_call_grammar("<tool_call>", [EVENT])
    modes = {"target-only": lambda: dict(use_draft=False), "lookup + forced tokens": lambda: dict(use_draft=False,
             lookup=True), "drafter + fallback": lambda: dict(controller=FallbackController())}
    outputs = {}
    for r in range(args.rounds):
        for name, kwargs in modes.items():
            tokens, seconds, forced, outs = 0, 0.0, 0, []
            for prompt in CALL_PROMPTS:
                stats, ids = Stats(), pipe.encode(prompt)
                t = time.perf_counter()
                out = list(stream(pipe, ids, args.max_tokens, stats=stats, constraint=pipe.constraint("lark", grammar),
                                  **kwargs()))
                seconds += time.perf_counter() - t
                tokens, forced = tokens + len(out), forced + stats.forced_accepted
                outs.append(out)
            outputs.setdefault(name, outs)
            print(f"round {r + 1}, forced call, {name:22s}: {tokens / seconds:6.1f} tok/s ({tokens} tokens, "
                  f"{forced} of them forced drafts kept)")
    print(f"same tokens in every mode: {len({str(o) for o in outputs.values()}) == 1}")


if __name__ == "__main__":
    main()
