"""Which drafter goes with which target.

Targets are matched by base name: the last path component, lower-cased, with quantization and
format suffixes removed, so `Qwen/Qwen3-8B`, `Qwen3-8B-AWQ` and `qwen3-8b-q4_k_m.gguf` all find the
Qwen3-8B drafter. An explicit `--draft` always wins over this table.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

SHIPPED = Path(__file__).parent / "drafters"

# base name of the target -> drafter (hub id, or a directory shipped inside this package)
DRAFTERS: dict[str, str] = {
    "smollm2-135m-instruct": str(SHIPPED / "smollm2-135m-instruct"),
    "qwen3-4b": "z-lab/Qwen3-4B-DFlash-b16",
    "qwen3-8b": "z-lab/Qwen3-8B-DFlash-b16",
    "qwen3-coder-30b-a3b-instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "qwen3.5-4b": "z-lab/Qwen3.5-4B-DFlash",
    "qwen3.5-9b": "z-lab/Qwen3.5-9B-DFlash",
    "qwen3.5-27b": "z-lab/Qwen3.5-27B-DFlash",
    "qwen3.5-35b-a3b": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "qwen3.6-27b": "z-lab/Qwen3.6-27B-DFlash",
    "qwen3.6-35b-a3b": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "qwen3.8-27b": "z-lab/Qwen3.8-27B-DFlash2",  # the DFlash2 format (decoding/dflash2.py)
    "gemma-4-31b-it": "z-lab/gemma-4-31B-it-DFlash",
    "gemma-4-26b-a4b-it": "z-lab/gemma-4-26B-A4B-it-DFlash",
    "llama-3.1-8b-instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
}

# Families whose target runtime exists in this package (model_type in config.json).
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                   "qwen3_5_moe_text", "gemma4", "gemma4_text", "gemma3", "gemma3_text")

_SUFFIXES = re.compile(
    r"([-_.](gguf|awq|gptq|fp8|fp16|bf16|int8|int4|mlx|[0-9]+bit|q[0-9]_[0-9a-z_]+|q[0-9]+|"
    r"instruct-2507|dwq|exl2|nvfp4|mxfp4))+$"
)


def base_name(spec: str) -> str:
    """`Org/Model-Name-Q4_K_M.gguf` -> `model-name`."""
    name = Path(spec.rstrip("/")).name.lower()
    name = name.removeprefix("meta-")
    prev = None
    while prev != name:
        prev, name = name, _SUFFIXES.sub("", name)
    return name


def drafter_for(model: str, config: dict | None = None) -> str | None:
    """The registered drafter for a target, or None."""
    names = [base_name(model)]
    if config and config.get("_name_or_path"):
        names.append(base_name(config["_name_or_path"]))
    if config and config.get("converted_from"):
        names.append(base_name(config["converted_from"]))
    for name in names:
        found = DRAFTERS.get(name)
        if found is None:
            continue
        if found.startswith("/") and not (Path(found) / "config.json").is_file():
            return None  # a shipped drafter that is not in this install
        return found
    return None


def fingerprint(config: dict) -> str:
    """A short hash of the target config fields a drafter depends on."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "intermediate_size")
    blob = json.dumps({k: config.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warn_if_other_target(drafter, model: str, config: dict) -> None:
    """Warn when a drafter records a target that is not this one (it still runs, losslessly)."""
    recorded = (drafter.config.get("dflash_config") or {}).get("target")
    if not recorded:
        return
    fp = recorded.get("fingerprint")
    if fp and fp != fingerprint(config):
        print(
            f"dflash: warning: this drafter was trained for {recorded.get('name')!r}, whose config differs "
            f"from {model!r}; output stays exact but acceptance may be low",
            file=sys.stderr,
        )


def table() -> list[dict]:
    """Rows for `dflash models`."""
    rows = []
    for name, draft in DRAFTERS.items():
        shipped = draft.startswith("/")
        rows.append({
            "target": name,
            "drafter": Path(draft).name if shipped else draft,
            "shipped": shipped and (Path(draft) / "config.json").is_file(),
        })
    return rows
