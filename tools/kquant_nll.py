"""What converting K-quant matrices into the block kernels' formats costs in per-token NLL
(docs/usage.md, "GGUF files").

    .venv/bin/python tools/kquant_nll.py [--texts 4] [--tokens 1024]

No K-quant file of a trained model ships offline, so this makes them from the default model's GGUF:
its ffn_down matrices re-encoded as Q4_K, then as Q6_K (in SmolLM2-135M only ffn_down has rows of a
multiple of 256 values, which K-quants need; llama.cpp's own Q4_K_M files of it store the other matrices
in 32-value types for that reason), every other tensor as the file stores it. The encoder here is the plain
one (per sub-block minimum and maximum, scales rounded to 6 / 8 bits), not llama.cpp's search for the best
scales; its blocks are valid K-quant blocks. Each file is then loaded twice:
  --quantize none: the file's own values (the K-quant blocks dequantized exactly, float32 elsewhere);
  --quantize auto: Q4_K converted once into Q4_1 (Q6_K into Q8_0) and run on the block kernels beside
                   the file's Q4_1 / Q8_0 matrices,
and the mean NLL of held-out text (ShareGPT conversations that ship offline) is printed for both, with the
original file's under --quantize none and auto for reference.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import tempfile
from pathlib import Path

from dflash_torch.gguf_kquants import ENCODERS, QK_K


def rewrite(src: Path, dst: Path, qtype: str) -> int:
    """`src` with its ffn_down matrices re-encoded as `qtype`; returns how many were."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = MetadataDetails(kind, field.contents(), sub_type=sub)
        writer.add_key_value(field.name, value.value, value.type, sub_type=sub)
    count = 0
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims innermost first
        if t.name.endswith("ffn_down.weight") and shape[1] % QK_K == 0:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            writer.add_tensor(t.name, ENCODERS[qtype](w), raw_dtype=gguf.GGMLQuantizationType[qtype])
            count += 1
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape if t.tensor_type.name in ("F32", "F16")
                              else None, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def texts(pipe, n: int, tokens: int) -> list[list[int]]:
    """`n` held-out ShareGPT conversations of at least `tokens` tokens, cut to that many."""
    from dflash_torch import bench_longctx

    out = []
    for _, body in bench_longctx.sharegpt_long(min_chars=tokens * 5):
        ids = pipe.tokenizer(body, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            break
    return out


def nll(pipe, docs: list[list[int]]) -> float:
    """Mean per-token negative log-likelihood (nats) of the documents' tokens after their first."""
    import torch

    generate = importlib.import_module("dflash_torch.generate")
    total, count = 0.0, 0
    with torch.inference_mode():
        for ids in docs:
            lp = generate.prompt_logprobs(pipe, ids)
            total -= sum(e[0] for e in lp.entries)  # (logprob, top ids, top logprobs)
            count += len(lp.entries)
    return total / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    from dflash_torch import loading

    generate = importlib.import_module("dflash_torch.generate")
    src = loading.default_gguf()
    with tempfile.TemporaryDirectory(prefix="kquant-nll-") as tmp:
        home = Path(tmp)
        os.environ["DFLASH_HOME"] = str(home / "home")  # conversions of the made files only, removed after
        return _measure(src, home, args, generate)


def _measure(src: Path, home: Path, args, generate) -> int:
    files = {"original Q4_1": src}
    for qtype in ENCODERS:
        dst = home / f"SmolLM2-135M-Instruct.ffn_down-{qtype}.gguf"
        print(f"{qtype}: {rewrite(src, dst, qtype)} ffn_down matrices re-encoded -> {dst.name}", file=sys.stderr)
        files[f"ffn_down {qtype}"] = dst
    docs = None
    print(f"{'file':18s} {'--quantize none':>16s} {'--quantize auto':>16s}   (mean NLL, nats/token)")
    for label, path in files.items():
        row = []
        for quantize in ("none", "auto"):
            pipe = generate.load(str(path), draft=None, quiet=True, quantize=quantize)
            docs = docs or texts(pipe, args.texts, args.tokens)
            row.append(nll(pipe, docs))
        print(f"{label:18s} {row[0]:16.5f} {row[1]:16.5f}   auto - none {row[1] - row[0]:+.5f} "
              f"(perplexity x{math.exp(row[1] - row[0]):.4f})", flush=True)
    print(f"({len(docs)} ShareGPT texts of {args.tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
