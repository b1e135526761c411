"""Structured output: the target may only choose tokens that keep its output inside a grammar (a JSON
schema, any JSON object, a regular expression, a Lark grammar or a list of choices), through
llguidance's token-level matcher.

With speculation, row i of a verify pass decides the token after the block's first i drafts, so its
mask is the grammar's after those drafts: the matcher takes the drafts it allows, a mask is read
before each, and it rolls back. A draft the grammar refuses ends the rows that can matter (the target
cannot choose it, so it is rejected there). Masked rows are what target-only decoding masks, so the
output is the same, greedy or sampled.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable

import numpy as np
import torch

# the grammar library's tokenizer per tokenizer object (building one takes a while); weak keys, so a
# tokenizer that is gone cannot hand its entry to a new one at the same address
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar(kind: str, spec) -> str:
    """An llguidance grammar for kind "json_schema" (spec: the schema, a dict), "json_object" (spec
    ignored), "regex" (a pattern), "lark" (a Lark grammar) or "choice" (a list of strings, one of which
    is the whole output). Raises ValueError for a spec that is not one of these or does not compile."""
    from llguidance import LLMatcher

    text = _grammar(kind, spec)
    failed, messages = LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        what = {"json_schema": "JSON schema", "lark": "Lark grammar", "choice": "list of choices"}.get(kind, kind)
        raise ValueError(f"the {what} does not compile: {messages[0]}")
    return text


def _grammar(kind: str, spec) -> str:
    from llguidance import LLMatcher

    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise ValueError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(spec)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("a regex must be a non-empty string")
        return LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        if not isinstance(spec, str) or not spec:
            raise ValueError("a Lark grammar must be a non-empty string")
        return LLMatcher.grammar_from_lark(spec)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in spec))
    raise ValueError(f"unknown grammar kind {kind!r}")


class GrammarRefused(RuntimeError):
    """The grammar took none of the tokens the model could choose: the format asks for text this model's
    tokens cannot write (a vocabulary without a character it needs next). The request's fault, not a bug."""


class Constraint:
    """One generation's grammar state. `mask(drafts, rows)` -> which tokens each row may choose,
    `commit(tokens)` after the tokens are decided."""

    def __init__(self, tokenizer, grammar_text: str, vocab_size: int, stop_token_ids: list[int],
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        from llguidance import LLMatcher

        built = _TOKENIZERS.setdefault(tokenizer, {})
        key = (vocab_size, tuple(stop_token_ids))
        if key not in built:
            built[key] = _lltokenizer(tokenizer, vocab_size, list(stop_token_ids), token_bytes)
        self.matcher = LLMatcher(built[key], grammar_text)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is not valid: {self.matcher.get_error()}")
        self.vocab_size, self.stops = vocab_size, set(stop_token_ids)

    def _before_stop(self, tokens: list[int]) -> list[int]:
        """`tokens` up to the first stop token: a stop ends the generation, so the matcher never takes one
        in (it does not roll one back cleanly)."""
        return tokens[: next((i for i, t in enumerate(tokens) if t in self.stops), len(tokens))]

    def _row(self) -> torch.Tensor:
        """Allowed tokens [V] (bool) now: the matcher's bitmask (bit t of the little-endian words = token t)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(bool))

    def mask(self, drafts: list[int], rows: int) -> torch.Tensor:
        """Allowed tokens [rows, V] (bool): row i after drafts[:i]. Rows past the first draft the grammar
        refuses, or past a stop token, cannot decide anything and allow everything."""
        drafts = self._before_stop(drafts[: rows - 1])
        ok = self.matcher.validate_tokens(drafts) if drafts else 0
        out = torch.ones(rows, self.vocab_size, dtype=torch.bool)
        for i in range(ok + 1):
            out[i] = self._row()
            if i < ok:
                self.matcher.consume_token(drafts[i])
        if ok:
            self.matcher.rollback(ok)
        return out

    def draft(self, draft_logits: torch.Tensor, sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's tokens [K] (and q [K, V] when sampling) chosen under the grammar, position by
        position: a draft the grammar refuses would be rejected anyway, so the drafter's best allowed
        token goes in its place. Any proposal keeps the output exact; this one is kept more often."""
        tokens, qs, taken, free = [], [], 0, False  # free: past a stop token, where nothing matters
        for i in range(draft_logits.shape[0]):
            row = draft_logits[i : i + 1].float()  # [1, V]
            if not free:
                masked = row.masked_fill(~self._row().to(row.device), float("-inf"))
                if torch.isfinite(masked).any():
                    row = masked
                else:  # nothing allowed that the drafter can propose (a draft vocabulary): any proposal will do
                    free = True
            token, q = sampler.draft(row)
            tokens.append(int(token[0]))
            qs.append(q)
            if not free:
                # (validated first: a refused token would leave the matcher in its error state)
                if tokens[-1] in self.stops or self.matcher.validate_tokens(tokens[-1:]) != 1:
                    free = True
                else:
                    self.matcher.consume_token(tokens[-1])
                    taken += 1
        if taken:
            self.matcher.rollback(taken)
        return torch.tensor(tokens, device=draft_logits.device), None if qs[0] is None else torch.cat(qs)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` next tokens the grammar leaves no choice about (its canonical tokens of the only
        text allowed next; a model may spell that text with other tokens)."""
        if limit < 1:
            return []
        return self._before_stop(self.matcher.compute_ff_tokens()[:limit])

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar takes in a row from here (counting stops at a stop token)."""
        tokens = self._before_stop(tokens)
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def commit(self, tokens: list[int]) -> None:
        tokens = [t for t in tokens if t not in self.stops]  # the last token, if any: the generation ends
        if tokens and not self.matcher.consume_tokens(tokens):
            raise GrammarRefused(f"structured output: the grammar refused a chosen token ({self.matcher.get_error()})")


def _lltokenizer(tokenizer, vocab_size: int, stops: list[int], token_bytes: Callable[[int], bytes] | None):
    """The grammar library's view of a tokenizer: its own reading of a Hugging Face fast tokenizer where
    it has one, else every token's bytes (`Pipeline.token_bytes`) and the tokenizer as the encoder."""
    from llguidance import LLTokenizer
    from llguidance.hf import from_tokenizer

    try:  # (tokenizer.Tokenizer: transformers' own of the same files, which the library reads)
        return from_tokenizer(getattr(tokenizer, "hf", tokenizer), n_vocab=vocab_size, eos_token=stops)
    except (ValueError, AttributeError):
        if token_bytes is None:
            raise

    class Tokens:  # what llguidance.TokenizerWrapper reads
        is_tokenizer_wrapper = True
        eos_token_id = stops[0]
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special_token_ids = sorted({*tokenizer.all_special_ids, *getattr(tokenizer, "added_tokens_decoder", {})})
        tokens = [token_bytes(i) if i < len(tokenizer) else b"" for i in range(vocab_size)]

        def __call__(self, text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return LLTokenizer(Tokens(), n_vocab=vocab_size, eos_token=stops)


def parse_response_format(value) -> tuple[str, object] | None:
    """OpenAI's response_format -> (kind, spec) for `grammar`, or None for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return "json_object", None
    schema = (value.get("json_schema") or {}).get("schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            schema = None
    if not isinstance(schema, dict):
        raise ValueError("'response_format.json_schema.schema' must be a JSON schema object")
    return "json_schema", schema
