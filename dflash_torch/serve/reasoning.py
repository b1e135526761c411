"""Reasoning parsing: thinking models (Qwen3, Qwen3.5/3.6, DeepSeek-R1 and their distillations) write
their reasoning between <think> and </think> before the answer. The server returns it apart, as
`reasoning_content` (the field vLLM, SGLang and DeepSeek's API use), and the answer as `content`."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def has_think_tags(tokenizer) -> bool:
    """True when the tokenizer has <think> and </think> as tokens of their own (a thinking model)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None and hasattr(tokenizer, "get_vocab") else {}
    return OPEN in vocab and CLOSE in vocab


def starts_inside(prompt_text: str) -> bool:
    """True when the prompt leaves the model inside a think block (templates that open it for the model)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ReasoningSplitter:
    """Text deltas -> (reasoning, content) deltas. A tag split over deltas is held back until it is
    whole; the tags are dropped, and so are the newlines models put after </think>. Text that starts
    with anything but <think> (leading whitespace aside) is all answer."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside  # in the think block now
        self.answering = False  # the answer began: the rest is content, tags included
        self.strip = False  # drop the newlines that start the answer
        self.pending = ""  # held back: possibly part of a tag

    @property
    def in_block(self) -> bool:
        """In the think block, or holding back what may be its opening tag."""
        return self.inside or (not self.answering and bool(self.pending))

    def feed(self, text: str) -> tuple[str, str]:
        """Reasoning and content to send for this delta."""
        return self._split(self.pending + text, final=False)

    def finish(self) -> tuple[str, str]:
        """What is held back, once generation is over."""
        return self._split(self.pending, final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        self.pending, reasoning, content = "", "", ""
        while text:
            if self.answering:
                content += text
                break
            if self.inside:
                i = text.find(CLOSE)
                if i < 0:
                    keep = 0 if final else max((k for k in range(1, len(CLOSE)) if text.endswith(CLOSE[:k])),
                                               default=0)
                    reasoning, self.pending = reasoning + text[: len(text) - keep], text[len(text) - keep :]
                    break
                reasoning, text = reasoning + text[:i], text[i + len(CLOSE) :]
                self.inside, self.answering, self.strip = False, True, True
                continue
            rest = text.lstrip()  # before the answer: whitespace waits, <think> opens the block
            if rest.startswith(OPEN):
                self.inside, text = True, rest[len(OPEN) :]
            elif not final and OPEN.startswith(rest):  # nothing yet, or the start of <think>
                self.pending = text
                break
            else:
                self.answering = True
        if self.strip and content:
            content = content.lstrip("\n")
            self.strip = not content
        return reasoning, content
