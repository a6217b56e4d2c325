"""Block-FP8 weights in Hugging Face directories (and GPT-OSS's MXFP4 experts, at the end), the torch-free part:
what config.json's `quantization_config` says and what inspect reports of it (the arithmetic is fp8.py's, mxfp4.py's).

DeepSeek-V3 / R1 are released this way (and Qwen3's -FP8 repositories): every Linear weight of the
attention and the MLPs stored float8_e4m3fn beside a float32 `<name>_scale_inv` of shape
[ceil(out/128), ceil(in/128)], one scale per 128x128 block (the last row / column of blocks partial
where a dimension is not a multiple of 128: DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168], its
scale [5, 56]); embeddings, lm_head, norms and the router stay bf16 (the router's expert bias fp32).
config.json says {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]} (transformers' FineGrainedFP8Config, transformers 5.24
utils/quantization_config.py; DeepSeek-V3's README_WEIGHTS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ...errors import CkptError, require

SCALE_SUFFIX = "_scale_inv"  # weight W's scale is W + SCALE_SUFFIX ("...weight_scale_inv")
FP8_DTYPE = "float8_e4m3fn"
FP8_DTYPES = (FP8_DTYPE, "float8_e5m2")  # stored FP8 of either kind: each needs its scale (e5m2 is refused)
# Scale dtypes the reader multiplies by (torch dtype names): DeepSeek's float32, and the power-of-two
# UE8M0 form (scale_fmt "ue8m0") transformers reads as float8_e8m0fnu or as its raw exponent bytes.
SCALE_DTYPES = ("float32", "bfloat16", "float8_e8m0fnu", "uint8")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: a block's largest |w| maps to it


@dataclass(frozen=True)
class BlockFP8:
    """One checkpoint's block-FP8 scheme (config.json's quantization_config)."""
    block: Tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    scale_fmt: str = "float"

    def grid(self, shape) -> Tuple[int, int]:
        """The scale tensor's shape for a weight of shape [out, in]: one per block, edge blocks partial."""
        return tuple(-(-n // b) for n, b in zip(shape, self.block))

    def config_json(self) -> dict:
        """quantization_config as DeepSeek-V3's config.json writes it (transformers reads it back)."""
        conf = {"activation_scheme": self.activation_scheme, "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(self.block)}
        if self.scale_fmt != "float":
            conf["scale_fmt"] = self.scale_fmt
        return conf

    def label(self) -> str:
        """The scheme in words, for a conversion's report line."""
        return f"block FP8 e4m3 {self.block[0]}x{self.block[1]}"

    def describe(self, tensors: int, scale_dtype: str, read_as: str) -> dict:
        """inspect's `quantization` object (docs/inspect-json.md)."""
        return {"method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                "activation_scheme": self.activation_scheme, "scale_fmt": self.scale_fmt,
                "scale_dtype": scale_dtype, "tensors": tensors, "read_as": read_as}


RELEASE = BlockFP8()  # what to-hf --fp8 writes: DeepSeek-V3 / R1's form


def block_fp8(conf: dict, where) -> Optional[BlockFP8]:
    """The block-FP8 scheme config.json declares; None without a quantization_config; CkptError for a
    quantization ckptool does not dequantize exactly (another method, fp8 without blocks, static
    activation scales)."""
    quant = conf.get("quantization_config")
    if not quant:
        return None
    require(isinstance(quant, dict), f"{where}: quantization_config is not an object")
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    require(method == "fp8" and fmt == "e4m3", f"{where}: quantization {method}/{fmt} is not supported",
            "ckptool dequantizes block FP8 (quant_method fp8, fmt e4m3, weight_scale_inv per block) only")
    block = quant.get("weight_block_size")
    require(isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
            f"{where}: fp8 quantization_config with weight_block_size={block!r}",
            "ckptool dequantizes block FP8 (a [rows, cols] weight_block_size, e.g. [128, 128]) only")
    scheme = quant.get("activation_scheme", "dynamic")
    require(scheme == "dynamic", f"{where}: fp8 activation_scheme {scheme!r} is not supported",
            "static activation scales (activation_scale tensors) have no place in a Megatron GPT")
    scale_fmt = quant.get("scale_fmt") or "float"
    require(scale_fmt in ("float", "ue8m0"), f"{where}: fp8 scale_fmt {scale_fmt!r} is not supported",
            "ckptool reads float and ue8m0 block scales")
    return BlockFP8(tuple(block), scheme, scale_fmt)


def storage_label(q: dict) -> str:
    """SourceInfo.storage of a quantized directory (inspect's `storage`), from its `quantization` object."""
    if q["method"] == MXFP4:
        return (f"MXFP4 ({q['tensors']} stacked expert weights: e2m1 codes in blocks of {q['block_size']} with e8m0 "
                f"_scales), read as {q['read_as']}")
    rows, cols = q["weight_block_size"]
    return (f"block FP8 ({q['tensors']} weights {FP8_DTYPE} in {rows}x{cols} blocks, {q['scale_dtype']} "
            f"weight_scale_inv), read as {q['read_as']}")


# --- which stored tensors are block FP8 (the reader's and the quick reader's one check) ----------------
# Both hand in {name: (shape, torch dtype name)} of the stored tensors.
Stored = Dict[str, Tuple[tuple, str]]


def scaled_weights(stored: Stored, where) -> List[Tuple[str, str]]:
    """[(weight name, scale name)] of the block-FP8 weights; CkptError for a scale without its
    float8_e4m3fn matrix or an FP8 tensor without its scale."""
    pairs = []
    for key in sorted(k for k in stored if k.endswith(SCALE_SUFFIX)):
        name = key[:-len(SCALE_SUFFIX)]
        shape, dtype = stored.get(name, ((), None))
        require(dtype == FP8_DTYPE and len(shape) == 2, f"{where}: {key} scales no float8_e4m3fn matrix {name}",
                "the FP8 checkpoint is incomplete or not block FP8")
        pairs.append((name, key))
    scaled = {name for name, _ in pairs}
    bare = sorted(k for k, (_, dtype) in stored.items() if dtype in FP8_DTYPES and k not in scaled)
    require(not bare, f"{where}: FP8 tensors without a weight_scale_inv: {', '.join(bare[:3])}",
            "ckptool dequantizes block FP8 weights that carry their scales")
    return pairs


def checked_scheme(stored: Stored, pairs: List[Tuple[str, str]], conf: dict, where) -> BlockFP8:
    """The checkpoint's scheme (config.json's, else DeepSeek's 128x128 blocks), every scale's shape and
    dtype checked against it."""
    scheme = block_fp8(conf, where) or RELEASE
    for name, key in pairs:
        (shape, _), (scale_shape, scale_dtype) = stored[name], stored[key]
        want = scheme.grid(shape)
        require(tuple(scale_shape) == want, f"{where}: {key} has shape {tuple(scale_shape)}, expected {want} for "
                f"{tuple(shape)} in {scheme.block[0]}x{scheme.block[1]} blocks")
        require(scale_dtype in SCALE_DTYPES, f"{where}: {key} is {scale_dtype}",
                f"block scales are one of {', '.join(SCALE_DTYPES)}")
    return scheme


def quantization_doc(stored: Stored, conf: dict, where) -> Optional[dict]:
    """inspect's `quantization` object of the stored tensors; None without FP8 or MXFP4 weights."""
    pairs = scaled_weights(stored, where)
    if not pairs:
        blocks = mxfp4_pairs(stored, conf, where)
        return {"method": MXFP4, "fmt": "e2m1", "block_size": MXFP4_BLOCK, "scale_fmt": "e8m0",
                "tensors": len(blocks), "read_as": "bfloat16"} if blocks else None
    scheme = checked_scheme(stored, pairs, conf, where)
    return scheme.describe(len(pairs), "/".join(sorted({stored[key][1] for _, key in pairs})), "bfloat16")


# --- MXFP4: GPT-OSS's experts as released (issue 32; the arithmetic is mxfp4.py's) ----------------------------
# transformers 5.24 integrations/mxfp4.py: <name>_blocks uint8 [E, out, G, 16], 32 e2m1 codes of the input axis per
# block, two per byte; <name>_scales uint8 [E, out, G], one e8m0 exponent per block; config.json says
# {"quant_method": "mxfp4"}. Read as <name> [E, in = G * 32, out] in bfloat16.
MXFP4 = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
MXFP4_BLOCK = 32  # values per scale


def mxfp4_pairs(stored: Stored, conf: dict, where) -> List[Tuple[str, str, str]]:
    """[(name, blocks key, scales key)] of the MXFP4 tensors (the reader's and the quick reader's one check);
    CkptError for blocks without quant_method mxfp4, a half without the other, or shapes that are not MXFP4."""
    blocks = sorted(k for k in stored if k.endswith(BLOCKS))
    if not blocks:
        return []
    quant = conf.get("quantization_config") or {}
    require(quant.get("quant_method") == MXFP4, f"{where}: {blocks[0]} with quantization "
            f"{quant.get('quant_method')!r}", "ckptool dequantizes MXFP4 blocks (quant_method mxfp4) only")
    pairs = []
    for key in blocks:
        name = key[:-len(BLOCKS)]
        require(name + SCALES in stored, f"{where}: {key} has no {name + SCALES}", "the MXFP4 checkpoint is incomplete")
        (b, b_dtype), (s, s_dtype) = stored[key], stored[name + SCALES]
        require(len(b) == 4 and b[-1] == MXFP4_BLOCK // 2 and b_dtype == s_dtype == "uint8"
                and tuple(s) == tuple(b[:-1]),
                f"{where}: {key} {tuple(b)} / {name + SCALES} {tuple(s)} are not MXFP4 blocks and scales",
                "expected uint8 [experts, out, groups, 16] codes and [experts, out, groups] exponents")
        pairs.append((name, key, name + SCALES))
    paired = {s for _, _, s in pairs}
    left = sorted(k for k in stored if k.endswith(SCALES) and k not in paired)
    if left:
        raise CkptError(f"{where}: {left[0]} has no {left[0][:-len(SCALES)] + BLOCKS}",
                        "the MXFP4 checkpoint is incomplete")
    return pairs


def mxfp4_shape(blocks: tuple) -> tuple:
    """The dequantized [E, in, out] of blocks [E, out, G, 16]."""
    return (blocks[0], blocks[2] * blocks[3] * 2, blocks[1])
