"""Python API: load a target (and its drafter) once, then stream or generate many times.

    from dflash_torch import load, generate
    pipe = load()                      # the embedded default model and its drafter
    ids = pipe.encode("Write a haiku about rain")
    result = generate(pipe, ids, max_tokens=64)
    print(result.text, result.stats.acceptance_length_mean)
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import loading, registry
from .decoding import structured
from .decoding.drafter import DFlashDrafter, load_drafter
from .decoding.sampling import Sampler, TokenLogprobs
from .decoding.speculative import Stats, generate_tokens
from .decoding.structured import Constraint


def _byte_level_chars() -> dict[str, int]:
    # Byte-level BPE (GPT-2 and its descendants) spells each byte as one printable character: the
    # printable Latin-1 bytes as themselves, the other bytes as code points 256, 257, ... in byte order.
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_chars()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class Pipeline:
    """A loaded target with its tokenizer, stop tokens and (optional) drafter."""

    target: torch.nn.Module
    tokenizer: object | None
    stop_token_ids: list[int]
    model_path: Path
    name: str
    drafter: DFlashDrafter | None = None
    draft_path: Path | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    quantize: str | None = None  # "q4_0" / "q4_1" / "q8_0" / "int8" / "int4": the target's and drafter's linear layers
    lm_head: str | None = None  # the target's LM head's format, None = as loaded
    # The target's prefills attend one query at a time (set by `load` for quantized targets, see there)
    exact_prefill: bool = False
    # the thread `load` ran in: passes run from another thread of a process whose loading thread ran
    # OpenMP regions can be several times slower (docs/performance.md, "One thread runs the model")
    loaded_in: int = field(default_factory=threading.get_ident)

    @property
    def max_context(self) -> int:
        return int(self.target.config.max_position_embeddings)

    def encode(self, text: str, chat: bool = True, system: str | None = None,
               template_args: dict | None = None) -> list[int]:
        """Token ids for a user prompt, through the chat template unless chat=False."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return self.encode_messages(messages, template_args) if chat else self._plain(text)

    def encode_messages(self, messages: list[dict], template_args: dict | None = None,
                        tools: list[dict] | None = None, continue_final: bool = False) -> list[int]:
        """Token ids for a chat (list of {"role", "content"}), with the generation prompt appended.
        `template_args`: extra variables for the chat template (e.g. {"enable_thinking": False} for Qwen3).
        `tools`: OpenAI function tools, shown to the model by its chat template. `continue_final`: the last
        message is the start of the reply (an assistant message left open), which the model continues."""
        tok = self._need_tokenizer()
        template = getattr(tok, "chat_template", None)
        if tools and not (isinstance(template, str) and "tools" in template):
            raise ValueError("this model's chat template does not take tools")
        if continue_final and (not messages or messages[-1]["role"] != "assistant"):
            raise ValueError("only a final assistant message can be continued")
        if not template:
            if continue_final:
                *messages, last = messages
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
            return self._plain(text + (last["content"] if continue_final else ""))
        kwargs = dict(template_args or {}) | ({"tools": tools} if tools else {})
        ids = tok.apply_chat_template(messages, add_generation_prompt=not continue_final, tokenize=True,
                                      continue_final_message=continue_final, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _plain(self, text: str) -> list[int]:
        return list(self._need_tokenizer()(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token id `token` stands for: one token may hold part of a character, which its
        decoded text cannot show (byte-level BPE pieces, SentencePiece byte tokens <0xNN>)."""
        tok = self._need_tokenizer()
        piece = tok.convert_ids_to_tokens(int(token))
        if piece is None:
            return b""
        if int(token) in tok.all_special_ids:
            return piece.encode()
        if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if "ByteLevel" in str(getattr(getattr(tok, "backend_tokenizer", None), "decoder", "")) and all(
                c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece marks a space as U+2581

    def constraint(self, kind: str, spec=None) -> Constraint:
        """A grammar for one generation (`structured.grammar`: "json_schema", "json_object", "regex",
        "lark", "choice"), to pass as `constraint=` to `stream` or as `grammar=(kind, spec)` to `generate`."""
        return Constraint(self._need_tokenizer(), structured.grammar(kind, spec), self.target.config.vocab_size,
                          self.stop_token_ids, self.token_bytes)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer; pass token ids (--prompt-ids) instead of text")
        return self.tokenizer


def freeze_heap() -> None:
    """Collect garbage once, then leave everything alive in the permanent generation of Python's garbage collector
    (`gc.freeze`), for a process that loads a model once and then serves from it. A loaded pipeline leaves ~190k
    objects (torch, transformers, the modules); a full collection walks them all (~110 ms on an AMD EPYC Zen 4,
    2 cores) and serving triggers one now and then, a pause in the middle of a request. Frozen objects are skipped;
    reference counting still frees them. Changes no output (`tools/probes/gc_pause_probe.py` measures it)."""

    import gc

    gc.collect()
    gc.freeze()


def load(
    model: str | None = None,
    draft: str | None = "auto",
    device: str = "auto",
    dtype: str = "auto",
    quiet: bool = False,
    quantize: str | None = None,
    cuda_graphs: bool = False,
    draft_vocab: bool = True,
    draft_window: int | None = None,
    draft_sinks: int = 64,
) -> Pipeline:
    """Load a target and its drafter.

    model: None (embedded default), a directory, a .gguf file or a hub id. draft: "auto" (the
    registered drafter for this model, if any), None (no drafter), or a directory / hub id.
    quantize: None (or "none"), "int8" or "int4" (weight-only quantized linear layers in the target and the
    drafter; int4: CPU only), or "auto" (`loading.auto_quantize`: int4 on a CPU for a 4-bit GGUF file).
    cuda_graphs: replay the target's decode and verify passes as CUDA graphs (cudagraph.py; CUDA,
    Llama-family targets). draft_vocab: where the drafter has a draft vocabulary (draft_vocab.json),
    draft logits come from those rows of the LM head (False: the whole head). draft_window: the drafter
    attends to its first `draft_sinks` and last `draft_window` context positions (0: all of them; None:
    the drafter's own setting, `dflash_config.draft_window`, else all; only the proposals change). The
    performance switches live here, and none changes greedy output.

    How a prompt is run is decided here, once, for every entry point (`dflash generate`, `chat`,
    `serve`, `bench` and this API all load through this function): a quantized target's prefills attend
    one query at a time (`quantize.exact_prefill`, `Pipeline.exact_prefill`), as its verify passes
    and decode steps do. Every position is then computed exactly as a decode step computes it, whatever
    the pass it is in, so a cold prefill, a prefill in chunks (`prefill_chunk`) and a prefill that
    continues a prefix cache's keys and values give the same bits, and a request gives the same tokens
    from every entry point. (Fused prefill attention rounds differently from decode steps; bfloat16
    activations turn that into flipped near-tie tokens.) Float32 targets keep the fused prefill.
    """
    dev = loading.pick_device(device)
    dt = loading.pick_dtype(dtype, dev)
    path = loading.resolve_model(model)
    config = json.loads((path / "config.json").read_text())
    head = quantize  # the LM head's format: as the other layers' unless --quantize auto says otherwise
    as_stored = quantize == "auto"  # each block-stored matrix in its own format (loading.load_target)
    if quantize == "auto":
        quantize, head = loading.auto_quantize(config, dev)
        if quantize and not quiet:
            stored, stored_head = loading.stored_types(config)
            print(f"dflash: {quantize} weights, LM head {head or 'not quantized'} (the GGUF file stores "
                  f"{stored}, its LM head {stored_head}; --quantize none for float32)", file=sys.stderr)
    elif quantize == "none":
        quantize = head = None
    from .models.quantize import BLOCK_FORMATS

    # in a block format: the layers a GGUF file stores in it are built from its blocks, never in float
    blocks = (quantize, head or quantize) if quantize in BLOCK_FORMATS else None
    target = loading.load_target(path, dev, dt, blocks=blocks, as_stored=as_stored)
    quantizer = None
    if quantize is not None:
        from .models.quantize import BLOCK_FORMATS, quantize_blocks, quantize_int4, quantize_int8

        if quantize not in ("int8", "int4", *BLOCK_FORMATS):
            raise ValueError(f"unknown quantization {quantize!r} (choose auto, none, {', '.join(BLOCK_FORMATS)}, "
                             "int8 or int4)")
        if quantize in ("int4", *BLOCK_FORMATS) and dev.type != "cpu":
            raise ValueError(f"--quantize {quantize} uses a CPU-only kernel; on {dev} use --quantize int8")
        if quantize in BLOCK_FORMATS:
            fmt = quantize

            def quantizer(model, head=None, stored=None):
                return quantize_blocks(model, fmt, head=head, stored=stored)

            # a GGUF file's blocks as stored, where it stores the layers in the kernel's formats
            quantizer(target, head=head, stored=loading.stored_blocks(target, path))
        else:
            quantizer = quantize_int4 if quantize == "int4" else quantize_int8
            quantizer(target, head=head)
    if not quiet and config.get("gguf_group_types"):
        print("dflash: weights (stored -> run as): " + "; ".join(loading.weight_report(target, config)),
              file=sys.stderr)
    from .models.quantize import exact_prefill

    # Every target, not only those quantized above: it acts wherever a quantizer marked the layers
    # (exact_verify), and is a no-op on a float target. Before the CUDA-graph wrapper, on the layers.
    exact = exact_prefill(target)
    loading.release_freed_memory()  # (each stage's freed buffers back before the next one's: a lower peak)
    if cuda_graphs:
        from .models.cudagraph import GraphedTarget

        target = GraphedTarget(target)
    tokenizer = loading.load_tokenizer(path)
    loading.release_freed_memory()
    config = config.get("text_config") or config  # multimodal checkpoints: the language model's settings
    name = model or loading.DEFAULT_MODEL_NAME
    pipe = Pipeline(
        target=target, tokenizer=tokenizer, stop_token_ids=loading.stop_token_ids(path, tokenizer),
        model_path=path, name=name, device=dev, dtype=dt, quantize=quantize, lm_head=head if quantize else None,
        exact_prefill=exact,
    )
    draft_spec = registry.drafter_for(name, config) if draft == "auto" else draft
    if draft == "auto" and draft_spec is None and not quiet:
        print(f"dflash: no drafter registered for {name}; running target-only", file=sys.stderr)
    if draft_spec is not None:
        draft_path = loading.resolve_model(str(draft_spec)) if not Path(draft_spec).is_dir() else Path(draft_spec)
        # The drafter's layers quantized too: a draft pass reads its weights once per cycle, and its
        # proposals only steer speed (the target verifies every token), so output stays the same.
        if quantize in BLOCK_FORMATS:  # (CPU): blocks kept in the cache after the first load
            from .decoding.drafter_blocks import load_in_blocks

            drafter = load_in_blocks(draft_path, quantize, dev, dt)
        else:
            drafter = load_drafter(draft_path, device=dev, dtype=dt)
            if quantizer is not None:
                quantizer(drafter)
        if not draft_vocab:
            drafter.set_draft_vocab(None)
        if draft_window is not None:
            drafter.set_window(draft_window or None, draft_sinks)
        loading.release_freed_memory()
        drafter.fuse_context_kv()
        drafter.draft_head(target.lm_head)  # built now, with the load's other transient buffers
        drafter.check_target(config, target.num_layers, target.config.vocab_size)
        registry.warn_if_other_target(drafter, name, config)
        pipe.drafter, pipe.draft_path = drafter, draft_path
    from .models import hugepages

    # the block weights, target's and drafter's, in huge pages where the kernel gives them (the same bytes)
    hugepages.move_blocks(target, pipe.drafter)
    loading.release_freed_memory()
    return pipe


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: Stats
    logprobs: list | None = None  # TokenLogprobs.entries, one per token, when asked for


def stream(
    pipe: Pipeline,
    prompt_ids: list[int],
    max_tokens: int = 256,
    *,
    block_size: int | None = None,
    use_draft: bool = True,
    sampler: Sampler | None = None,
    stop_token_ids: list[int] | None = None,
    stats: Stats | None = None,
    controller=None,
    lookup: bool | None = None,
    prefill_chunk: int | None = None,
    logprobs: TokenLogprobs | None = None,
    constraint: Constraint | None = None,
) -> Iterator[int]:
    """Yield completion token ids as they are committed (see `generate` for the arguments;
    `controller` picks the block size per cycle, see `speculative.generate_tokens`; `lookup`:
    prompt-lookup drafts too, default on whenever the drafter is used; `logprobs`: filled with each
    token's log-probability under the target, and its best alternatives, before the token is yielded;
    `constraint`: a grammar the output follows, from `Pipeline.constraint`)."""
    check_lengths(pipe, prompt_ids, max_tokens)
    stops = pipe.stop_token_ids if stop_token_ids is None else stop_token_ids
    if lookup is None:
        lookup = use_draft and pipe.drafter is not None
    yield from generate_tokens(
        pipe.target, prompt_ids, max_new_tokens=max_tokens,
        drafter=pipe.drafter if use_draft else None, block_size=block_size,
        stop_token_ids=stops, sampler=sampler, stats=stats, controller=controller, lookup=lookup,
        prefill_chunk=prefill_chunk, logprobs=logprobs, constraint=constraint,
    )


@torch.inference_mode()
def prompt_logprobs(pipe: Pipeline, prompt_ids: list[int], top: int = 0, chunk: int = 256) -> TokenLogprobs:
    """Each prompt token's log-probability given the tokens before it (entries for prompt_ids[1:]; the
    first token has none), with its `top` best alternatives: one target pass over the prompt, in
    pieces of `chunk` tokens so that only [chunk, V] logits exist at a time."""
    check_lengths(pipe, prompt_ids, 1)
    out = TokenLogprobs(top)
    cache = pipe.target.new_cache(len(prompt_ids))
    for i in range(0, len(prompt_ids) - 1, chunk):
        piece = prompt_ids[i : i + chunk]
        logits = pipe.target(torch.tensor([piece], device=pipe.device), cache, logits="all").logits[0]
        nxt = prompt_ids[i + 1 : i + 1 + chunk]  # the token each position predicts
        out.add(logits, nxt)
    return out


def check_lengths(pipe: Pipeline, prompt_ids: list[int], max_tokens: int) -> None:
    """Raise ValueError for an empty prompt, bad ids, max_tokens < 1 or a request beyond the context."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    vocab = pipe.target.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if len(prompt_ids) + max_tokens > pipe.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {pipe.max_context} tokens"
        )


def generate(
    pipe: Pipeline,
    prompt_ids: list[int],
    max_tokens: int = 256,
    logprobs: int | None = None,
    grammar: tuple[str, object] | None = None,
    **kwargs,
) -> Result:
    """Generate a completion. kwargs: block_size, use_draft, sampler, stop_token_ids, controller, lookup.
    `logprobs=k`: also report each token's log-probability under the target with its k best alternatives
    (`Result.logprobs`, as `sampling.TokenLogprobs` entries). `grammar=(kind, spec)`: the output follows
    it (`Pipeline.constraint`), e.g. ("json_schema", {...}) or ("regex", "[0-9]+")."""
    stats = Stats()
    lp = TokenLogprobs(logprobs) if logprobs is not None else None
    constraint = pipe.constraint(*grammar) if grammar is not None else None
    ids = list(stream(pipe, prompt_ids, max_tokens, stats=stats, logprobs=lp, constraint=constraint, **kwargs))
    stops = pipe.stop_token_ids if kwargs.get("stop_token_ids") is None else kwargs["stop_token_ids"]
    reason = "stop" if ids and ids[-1] in stops else "length"
    return Result(ids, pipe.decode(ids), reason, stats, lp.entries if lp is not None else None)


class Detokenizer:
    """Turns a stream of token ids into text increments, holding back incomplete characters.

    Only a short window of recent tokens is decoded per step (decoding the whole list every token
    would make long outputs quadratic); the window restarts at a token boundary once its text is out.
    `sent` is all the text handed out so far.
    """

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe, self.ids, self.start = pipe, [], 0
        self.window, self.sent = "", ""  # text of ids[start:] already handed out; all text handed out

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.pipe.decode(self.ids[self.start:])
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.window):]
        self.sent += new
        if len(self.ids) - self.start > 8:  # keep a few tokens of left context for spacing rules
            self.start = len(self.ids) - 4
            self.window = self.pipe.decode(self.ids[self.start:])
        else:
            self.window = text
        return new
