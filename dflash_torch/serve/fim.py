"""Fill-in-the-middle: a completion written between a prefix and a suffix (code completion in an editor),
as OpenAI completions' `suffix` asks, in the format of the model's own FIM tokens."""

from __future__ import annotations

# (prefix, suffix, middle) tokens; the prompt is prefix-token PREFIX suffix-token SUFFIX middle-token
FORMATS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
# Tokens that end a fill when the model writes them, beside its end-of-sequence token: padding, and the
# separators of the repository-level format (a model that goes on writes the next file).
END_TOKENS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<fim_pad>", "<file_sep>")


def _token_id(tokenizer, token: str) -> int | None:
    i = tokenizer.convert_tokens_to_ids(token)
    return i if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == token else None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> str:
    """The prompt text for a fill between `prefix` and `suffix`; ValueError for a tokenizer without FIM tokens."""
    for tokens in FORMATS:
        if all(_token_id(tokenizer, t) is not None for t in tokens):
            return f"{tokens[0]}{prefix}{tokens[1]}{suffix}{tokens[2]}"
    raise ValueError("this model's tokenizer has no fill-in-the-middle tokens (such as <|fim_prefix|>), so it "
                     "cannot complete between a prompt and a suffix")


def end_token_ids(tokenizer) -> list[int]:
    """The ids of END_TOKENS this tokenizer has."""
    return [i for t in END_TOKENS if (i := _token_id(tokenizer, t)) is not None]
