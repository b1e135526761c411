"""Weight-only int8 and int4 quantization of a target's linear layers.

int8: per output channel symmetric (scale = max |w| / 127). On CPU the matmul runs in
`aten._weight_int8pack_mm` (int8 weights, bf16 activations, no dequantized copy); elsewhere the
weights are dequantized on the fly. Reads a quarter of the float32 bytes per decode step, which is
what decode on a CPU is bound by.

int4 (CPU only): group-wise asymmetric, 16 levels between each group's min and max along the input
dimension, bf16 scale and zero point per group; the matmul runs in `aten._weight_int4pack_mm_for_cpu`.
About a sixth of the float32 bytes at group size 32 (4 bits plus 32 bits of scale/zero per group).

q4_0 / q4_1 / q8_0 (CPU): GGUF's block formats, 32 weights per block with an fp16 scale (q4_1: and an
fp16 minimum), on the block kernels of `kernels/` (blocks.cpp): activations quantized per row into 8-bit
blocks, integer block dot products, a fixed float order, so each row's result is the same whether it is
computed alone or among other rows, which makes verify passes reproduce decode steps bit for bit. The
fastest on a CPU for a few rows (docs/performance.md), and GGUF files stored in these types keep their
blocks: quantizing their dequantized weights again gives the same bytes (tests/test_kernels.py).

All first fuse q/k/v and gate/up into one layer each (`fuse_projections`): same results, fewer kernel
calls. Both keep the embedding in full precision (the lookup stays exact and the drafter reads it); a tied
LM head is replaced by a quantized copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels import pack
from .layers import Linear, RMSNorm

BLOCK_FORMATS = pack.FORMATS  # "q4_0", "q4_1", "q8_0"

INT4_GROUP_SIZE = 32  # 64 measured no faster on an AVX-512 CPU (128 about 3x slower); 32 rounds finer


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights [N, K] and per-row scales [N]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that reads .weight: dtype/device, or the plain path)."""
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu" and x2.dtype in (torch.float32, torch.bfloat16) and int8_fits(self):
            # The CPU kernel is fast with bfloat16 activations and several times slower with float32
            # (measured with `dflash profile`), so float32 inputs go through it in bfloat16.
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight_int8,
                                                   self.scale.to(torch.bfloat16)).to(x2.dtype)
        else:
            y = F.linear(x2, self.weight_int8.to(x2.dtype)) * self.scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """A frozen CPU linear layer with int4 weights packed for `_weight_int4pack_mm_for_cpu`.

    Each group of `group_size` inputs of an output row keeps a bf16 scale and zero point; the kernel
    computes w = (q - 8) * scale + zero for codes q in [0, 15].
    """

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        n, k = linear.weight.shape
        if not int4_fits(linear, group_size):
            raise ValueError(f"int4 needs out_features % 16 == 0 and in_features % {group_size} == 0, got {n}x{k}")
        w = linear.weight.detach().float().cpu().reshape(n, k // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)  # [N, K/g]
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))  # [N, K/2]
        # The kernel adds `zero` to (q - 8) * scale, so the group minimum lo is zero - 8 * scale.
        sz = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1)  # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", sz.contiguous().to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.group_size, self.in_features, self.out_features = group_size, k, n

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] in bfloat16, read back through the kernel (identity input)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self._mm(eye).t()

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # The kernel with float32 activations measured ~30x slower than with bfloat16: always bf16.
        y = self._mm(x.reshape(-1, shape[-1]).to(torch.bfloat16)).to(x.dtype)  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class BlockLinear(nn.Module):
    """A frozen CPU linear layer with weights in GGUF blocks (q4_0 / q4_1 / q8_0), packed for the block
    kernels (`kernels.pack`). Outputs float32 whatever the input dtype (cast back to it)."""

    def __init__(self, linear: nn.Linear | None, fmt: str, raw: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        """From a float `linear` (quantized as llama.cpp does), or from GGUF blocks `raw` [N, K/32 * bytes]
        (`linear` None; `bias` then optional)."""
        super().__init__()
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {fmt!r} (choose {', '.join(BLOCK_FORMATS)})")
        if raw is None:
            if not block_fits(linear):
                raise ValueError(f"{fmt} needs in_features % 32 == 0, got {linear.in_features}")
            raw = pack.quantize(linear.weight, fmt)
            bias = linear.bias
        kernels.ensure()
        self.fmt, self.code = fmt, BLOCK_FORMATS.index(fmt)
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // pack.block_bytes(fmt) * pack.QK
        self.register_buffer("packed", pack.pack(raw, fmt))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().cpu(), requires_grad=False)

    def raw(self) -> torch.Tensor:
        """The GGUF blocks [N, K/32 * bytes], exactly as given or quantized."""
        return pack.unpack(self.packed, self.fmt, self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] in float32 (what the blocks stand for)."""
        return pack.dequantize(self.raw(), self.fmt)

    def rows(self, index: torch.Tensor) -> BlockLinear:
        """A layer of the output rows `index` only, with their blocks as they are (no requantization)."""
        bias = None if self.bias is None else self.bias[index]
        index = index.cpu()
        # a few rows at a time: never the whole layer's blocks unpacked at once (an LM head's: 30 MB)
        raw = torch.cat([pack.unpack_rows(self.packed, self.fmt, self.out_features, self.in_features, part)
                         for part in index.split(512)])
        return BlockLinear(None, self.fmt, raw, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.dflash.block_mm(x.reshape(-1, shape[-1]), self.packed, self.code, self.out_features, -1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class BlockStack(nn.Module):
    """A stack of E frozen expert matrices [E, N, K] in one GGUF block format (a mixture-of-experts layer's
    gate/up or down stack, `moe.Experts`), one packed matrix per expert: row e of `packed` [E, bytes] is
    expert e's blocks in the kernels' layout. `forward(x, e)` is x [M, K] @ W_e^T on the block kernels,
    float32 (cast back to x's dtype), each row computed alike whatever the other rows."""

    def __init__(self, fmt: str, num_experts: int, raws) -> None:
        """From the experts' GGUF blocks, each [N, K/32 * bytes] (an iterable of `num_experts`: a 3-D tensor
        of blocks, or blocks made one expert at a time, so that no stack of dequantized floats exists)."""
        super().__init__()
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {fmt!r} (choose {', '.join(BLOCK_FORMATS)})")
        kernels.ensure()
        self.fmt, self.code, self.num_experts = fmt, BLOCK_FORMATS.index(fmt), num_experts
        packed = None
        for e, raw in enumerate(raws):
            one = pack.pack(raw, fmt)
            if packed is None:
                self.out_features = raw.shape[0]
                self.in_features = raw.shape[1] // pack.block_bytes(fmt) * pack.QK
                packed = torch.empty(num_experts, one.numel(), dtype=torch.uint8)
            packed[e] = one
        if packed is None or e != num_experts - 1:
            raise ValueError(f"expected the blocks of {num_experts} experts")
        self.register_buffer("packed", packed)  # [E, packed bytes]

    def raw(self, e: int) -> torch.Tensor:
        """Expert e's GGUF blocks [N, K/32 * bytes], exactly as given."""
        return pack.unpack(self.packed[e], self.fmt, self.out_features, self.in_features)

    def weight(self, e: int) -> torch.Tensor:
        """Expert e's dequantized weight [N, K] in float32 (what its blocks stand for)."""
        return pack.dequantize(self.raw(e), self.fmt)

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        y = torch.ops.dflash.block_mm(x.contiguous(), self.packed[e], self.code, self.out_features, -1)
        return y.to(x.dtype)


def quantize_experts(model: nn.Module, fmt: str) -> nn.Module:
    """Replace the float expert stacks of every `moe.Experts` of `model` (3-D parameters) by `BlockStack`s in
    format `fmt`, quantized one expert at a time; stacks already in blocks stay as they are."""
    from .moe import Experts

    for m in model.modules():
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(m, name, None) if isinstance(m, Experts) else None
            if isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[-1] % pack.QK == 0:
                stack = BlockStack(fmt, w.shape[0], (pack.quantize(w[e], fmt) for e in range(w.shape[0])))
                delattr(m, name)
                setattr(m, name, stack)
    return model


class BlockEmbedding(nn.Module):
    """A token embedding kept in GGUF blocks (`loading.load_target`): the rows of the looked-up tokens are
    dequantized as they are looked up, so the table never exists in float (SmolLM2's: 113 MB in float32,
    30 MB as the file's Q8_0). Each row is exactly the dequantized table's (`pack.dequantize` per row)."""

    def __init__(self, raw: torch.Tensor | None, fmt: str, dtype: torch.dtype = torch.float32,
                 head: BlockLinear | None = None) -> None:
        """From GGUF blocks `raw` [V, K/32 * bytes], or (raw None) from a tied LM `head` of blocks, whose
        bytes it then shares: the rows are read out of the head's packed layout (`pack.unpack_rows`)."""
        super().__init__()
        self.fmt = fmt
        if head is not None:
            self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
            self._head = [head]  # not a submodule: the model owns it as its LM head
        else:
            self.num_embeddings, self.embedding_dim = raw.shape[0], raw.shape[1] // pack.block_bytes(fmt) * pack.QK
            self._head = None
            self.register_buffer("blocks", raw.contiguous())  # [V, K/32 * bytes] uint8, as stored
        # Where callers ask an embedding for its device and dtype (`embed_tokens.weight.device`): an
        # empty tensor that has them. Anything that would read the table through it fails loudly.
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    # Rows dequantized before, kept for the next lookup of their token: a decode step looks up one token
    # and a verify pass a few, where a lookup is ~20 small tensor operations (tens of microseconds, a few
    # percent of the default model's decode step). The same values as a fresh lookup, so the same bits.
    ROW_CACHE_BYTES = 8 << 20
    SMALL_LOOKUP = 64  # rows per call served through the cache; prefills (more rows) dequantize in one go

    def _apply(self, fn, recurse=True):  # moved or cast: the kept rows would be stale
        self.__dict__.pop("_rows", None)
        return super()._apply(fn, recurse)

    def _dequantize(self, flat_ids: torch.Tensor) -> torch.Tensor:
        if self._head is not None:
            h = self._head[0]
            raw = pack.unpack_rows(h.packed, self.fmt, h.out_features, h.in_features, flat_ids)
        else:
            raw = self.blocks[flat_ids]
        return pack.dequantize(raw, self.fmt)  # [n, H] float32

    def rows(self, ids: list[int]) -> torch.Tensor:
        """The rows [T, H] of token ids, in the table's dtype, from the rows kept from earlier lookups (a decode
        step looks up one token and a verify pass a few, where a lookup is ~20 small tensor operations): one
        token's is the kept row itself (read-only: the layers never write their input), several are joined. Right
        after a pass's matmuls, with the caches cold, small operators cost several times what they cost warm
        (docs/performance.md, "What a pass costs around its kernels"). The same values as a fresh lookup."""
        cache = self.__dict__.setdefault("_rows", {})  # token id -> [1, H] (not state: not saved)
        got = {t: cache[t] for t in dict.fromkeys(ids) if t in cache}  # each id once, in order
        missing = [t for t in dict.fromkeys(ids) if t not in got]
        if missing:
            new = self._dequantize(torch.tensor(missing, dtype=torch.long)).to(self.weight.dtype)  # [n, H]
            got.update(zip(missing, new.split(1)))
            limit = max(self.SMALL_LOOKUP, self.ROW_CACHE_BYTES // (4 * self.embedding_dim))
            while cache and len(cache) + len(missing) > limit:  # the oldest first (this call's rows are in `got`)
                cache.pop(next(iter(cache)))
            cache.update((t, got[t]) for t in missing)
        return got[ids[0]] if len(ids) == 1 else torch.cat([got[t] for t in ids])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat_ids = ids.reshape(-1).cpu()
        if flat_ids.numel() > self.SMALL_LOOKUP:  # prefills dequantize in one go
            rows = self._dequantize(flat_ids).to(self.weight.dtype)
        else:  # a new tensor: callers never hold the kept rows
            rows = self.rows(flat_ids.tolist())
            rows = rows.clone() if flat_ids.numel() == 1 else rows
        return rows.view(*ids.shape, self.embedding_dim)


def block_fits(linear: nn.Module) -> bool:
    """Whether the block kernels take this layer: in_features a multiple of the 32-value block."""
    return linear.in_features % pack.QK == 0


def int8_fits(linear: nn.Module) -> bool:
    """Whether the CPU int8 kernel takes this layer: it reads inputs in vectors of 16 with no tail
    loop, so in_features not a multiple of 16 reads past the end (measured: a crash at K = 8, 24, 40).
    32 keeps a margin for other vector widths."""
    return linear.in_features % 32 == 0


def int4_fits(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether the CPU int4 kernel takes this layer's shape (N a multiple of 16, K of the group size)."""
    n, k = linear.weight.shape
    return n % 16 == 0 and k % group_size == 0


def _replace_linears(model: nn.Module, make) -> nn.Module:
    """Swap each nn.Linear child for make(linear) in place; make returns None to keep a layer."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (new := make(child)) is not None:
                setattr(module, child_name, new)
    return forget_plans(model)


def forget_plans(model: nn.Module) -> nn.Module:
    """Drop what a model looked up from its layers ahead of time (llama.Model's decode plan) after
    layers were replaced; it is rebuilt from the new layers on the next pass."""
    for m in model.modules():
        if hasattr(m, "_plan"):
            m._plan = None
    return model


def _concat(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    out = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    if first.weight.is_meta:  # shapes only, for blocks to replace (drafter_blocks.py); no meta arithmetic
        return out.requires_grad_(False)
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    return out.requires_grad_(False)


def fuse_projections(model: nn.Module, fits=lambda linear: True, stored: dict | None = None) -> nn.Module:
    """Concatenate q/k/v into `qkv_proj` and gate/up into `gate_up_proj` wherever a module declares
    those slots (llama.Attention, layers.MLP), in place: one matmul and one activation cast instead of
    three or two. A kind of slot is fused only where every module's parts can be (all satisfy `fits`; in
    blocks, of one format), so a quantizer that skips a shape skips the same layers fused or not.

    Used for quantized targets only: the int8/int4 kernels compute each output column alike whatever
    the matrix it sits in, so fused and separate layers give identical results (tests/test_fast_quantized.py),
    and fewer kernel calls cut a decode step's fixed costs (docs/performance.md). float32 matmuls
    measured no faster fused here and round differently, so float32 targets are left unfused.
    `stored` ({layer: (format, GGUF blocks)}, `loading.stored_blocks`) gains the fused layers' blocks:
    their parts' rows, concatenated, where all parts are stored in one format."""
    groups = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))

    def how(parts) -> str | None:
        if all(isinstance(p, BlockLinear) for p in parts) and len({p.fmt for p in parts}) == 1 and fits(parts[0]):
            return "blocks"  # kept in their stored blocks (loading.load_target): their rows, concatenated
        if all(isinstance(p, nn.Linear) and fits(p) for p in parts) and len(
                {(p.in_features, p.bias is not None) for p in parts}) == 1:
            return "float"
        return None

    for fused, names in groups:
        slots = [m for m in model.modules() if hasattr(m, fused) and getattr(m, fused) is None]
        # all of them or none: the flat decode path takes the layers fused one way throughout (a GGUF
        # file that stores v in another type than q and k in some layers, as Q4_K_M files do, keeps
        # q/k/v apart everywhere)
        if not slots or any(how([getattr(m, n, None) for n in names]) is None for m in slots):
            continue
        for m in slots:  # (the parts looked up one module at a time: each is freed once fused)
            parts = [getattr(m, n) for n in names]
            if how(parts) == "blocks":
                bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
                setattr(m, fused, BlockLinear(None, parts[0].fmt, torch.cat([p.raw() for p in parts]), bias))
                for n in names:
                    delattr(m, n)
                continue
            setattr(m, fused, _concat(parts))
            if stored is not None and all(p in stored for p in parts) and len({stored[p][0] for p in parts}) == 1:
                stored[getattr(m, fused)] = (stored[parts[0]][0], torch.cat([stored[p][1] for p in parts]))
            for n in names:
                delattr(m, n)
    return forget_plans(model)


def exact_verify(model: nn.Module) -> nn.Module:
    """Make verify passes reproduce decode steps bit for bit: attention one query at a time (the
    quantized linear kernels already give each row the same result for any number of rows). Without
    it, bfloat16 activations amplify the fused attention's rounding differences into different
    near-tie tokens between speculative and target-only decoding."""
    for m in model.modules():
        if hasattr(m, "exact_verify"):
            m.exact_verify = True
    return model


def exact_prefill(model) -> bool:
    """Where verify passes already attend one query at a time (quantized targets), make prefills do so
    too: then every pass computes each position exactly as a decode step would, so the keys and values
    a prefix cache keeps from earlier passes are the ones a cold prefill computes, bit for bit. Costs
    27-54% of a cold prefill of 43-1000 tokens (docs/performance.md). True if any layer does it."""
    found = False
    for m in model.modules():
        if getattr(m, "exact_verify", False):
            m.exact_max_t = None
            found = True
    return found


def quantize_int8(model: nn.Module, fuse: bool = True, head: str | None = "int8") -> nn.Module:
    """Replace every nn.Linear of `model` (the LM head included, untied from the embedding) whose shape
    the kernel takes (`int8_fits`; others stay in full precision) in place, after fusing q/k/v and
    gate/up (`fuse=False` keeps them apart; same results, more kernel calls). `head`: "int8", or None to
    keep the LM head as it is."""
    if fuse:
        fuse_projections(model, fits=int8_fits)
    apart = _head_apart(model, head, "int8")
    _replace_linears(model, lambda lin: Int8Linear(lin) if lin is not apart and int8_fits(lin) else None)
    return exact_verify(_set_head(model, apart, head))


def quantize_int4(model: nn.Module, group_size: int = INT4_GROUP_SIZE, fuse: bool = True,
                  head: str | None = "int4") -> nn.Module:
    """Replace every nn.Linear of a CPU `model` (the LM head included, untied from the embedding) in
    place; a layer whose shape the kernel does not take stays in full precision. q/k/v and gate/up are
    fused first where every part fits the kernel (`fuse=False` keeps them apart; same results).
    `head`: "int4", "int8" (an 8-bit LM head: closer to a model stored with one, and slower), or None to
    keep the LM head as it is."""
    if fuse:
        fuse_projections(model, fits=lambda lin: int4_fits(lin, group_size))
    apart = _head_apart(model, head, "int4")
    _replace_linears(model, lambda lin: Int4Linear(lin, group_size)
                     if lin is not apart and int4_fits(lin, group_size) else None)
    return exact_verify(_set_head(model, apart, head))


def quantize_blocks(model: nn.Module, fmt: str, fuse: bool = True, head: str | None = None,
                    stored: dict | None = None) -> nn.Module:
    """Replace every nn.Linear of a CPU `model` whose in_features the block kernels take (`block_fits`;
    others stay in full precision) by a `BlockLinear` in format `fmt` (q4_0, q4_1 or q8_0), in place,
    after fusing q/k/v and gate/up (exactly as apart: each output column is computed alike). `head`: the LM
    head's format (one of the block formats; None: `fmt`). `stored`: {layer: (format, GGUF blocks)} from
    the file the model came from (`loading.stored_blocks`): a layer stored in the format it gets keeps
    those bytes, the others are quantized from their weights. Marks the model for exact verification."""
    head = head or fmt
    if head not in BLOCK_FORMATS:
        raise ValueError(f"unknown LM head format {head!r} (choose {', '.join(BLOCK_FORMATS)})")
    stored = dict(stored or {})

    def blocks(lin: nn.Linear, f: str) -> BlockLinear:
        kept = stored.get(lin)
        if kept is not None and kept[0] == f:
            return BlockLinear(None, f, kept[1], lin.bias)
        return BlockLinear(lin, f)

    if fuse:
        fuse_projections(model, fits=block_fits, stored=stored)
    lm = getattr(model, "lm_head", None)
    if isinstance(lm, nn.Linear) and block_fits(lm):
        model.lm_head = blocks(lm, head)
    _replace_linears(model, lambda lin: blocks(lin, fmt) if block_fits(lin) else None)
    quantize_experts(model, fmt)  # (expert stacks a GGUF file stores in blocks are BlockStacks already)
    attentions = [m for m in model.modules() if hasattr(m, "exact_kernel") and getattr(m, "no_window", False)]
    for m in attentions:  # attention whose result for a query does not depend on the pass
        m.exact_kernel = True
    if attentions:  # a Llama-family target (its flat path reads these flags): its norms in one pass too
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.kernel = True
    if attentions and len(attentions) == sum(hasattr(m, "exact_kernel") for m in model.modules()):
        # Every layer reads its keys and values through kernels/attention.cpp, which widens float16 exactly:
        # the cache in float16, as llama.cpp keeps it. A decode step at 1,000 positions reads 46 MB of
        # float32 keys and values in a 135M model (two thirds of what its 4-bit weights take); this halves it. Verify,
        # prefill and decode passes round and read the same values, so output stays lossless.
        if hasattr(model, "cache_dtype"):
            model.cache_dtype = torch.float16
    return exact_verify(model)


def _head_apart(model: nn.Module, head: str | None, same: str) -> nn.Linear | None:
    """The LM head when it takes another format than the other layers (`same`): left out of their swap."""
    if head not in (same, "int8", None):
        raise ValueError(f"unknown LM head format {head!r} (choose {same}, int8 or None)")
    lm = getattr(model, "lm_head", None)
    return lm if head != same and isinstance(lm, nn.Linear) else None


def _set_head(model: nn.Module, apart: nn.Linear | None, head: str | None) -> nn.Module:
    if apart is not None and head == "int8" and int8_fits(apart):
        model.lm_head = Int8Linear(apart)
        forget_plans(model)
    return model
