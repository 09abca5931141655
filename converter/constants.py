"""Every format constant and layout fact, in one place.

Order: ``.tinyloop`` container, safetensors container, Marlin layout and limits,
artifact schema and tensor names.  Nothing else in the package types these
literals; import them from here.
"""

from __future__ import annotations

import enum

# --- .tinyloop v1 (docs/spec/tinyloop-v1.md) --------------------------------------
TINYLOOP_MAGIC = b"TINYLOOP"
TINYLOOP_SUPPORTED_VERSIONS = (1,)
#: magic (8s), version (u32), reserved (u32), header length H (u64); little-endian.
TINYLOOP_PREAMBLE_FORMAT = "<8sIIQ"
TINYLOOP_PREAMBLE_SIZE = 24
TINYLOOP_ALIGNMENT = 64
#: Bound on H before anything is allocated (the spec suggests 100 MiB).
TINYLOOP_MAX_HEADER_BYTES = 100 * 1024 * 1024
#: .tinyloop dtype code -> (numpy storage dtype, safetensors dtype code).
#: bf16 has no numpy dtype: it is stored and carried as its raw uint16 bits.
TINYLOOP_DTYPES = {
    "u8": ("u1", "U8"),
    "i8": ("i1", "I8"),
    "i32": ("<i4", "I32"),
    "f16": ("<f2", "F16"),
    "bf16": ("<u2", "BF16"),
    "f32": ("<f4", "F32"),
}
TINYLOOP_SUPPORTED_BITS = (2, 4)
#: Extra per-linear channels that Marlin ignores; carried over unchanged.
TINYLOOP_EXTRA_CHANNELS = ("frac4", "sign_bit")

# --- safetensors (docs/spec/checkpoint-formats.md section 7) -------------------------
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000
#: safetensors dtype code -> numpy storage dtype (little-endian). BF16 and the
#: float8 types are kept as raw bits.
SAFETENSORS_DTYPES = {
    "BOOL": "|b1",
    "U8": "|u1",
    "I8": "|i1",
    "F8_E5M2": "|u1",
    "F8_E4M3": "|u1",
    "I16": "<i2",
    "U16": "<u2",
    "F16": "<f2",
    "BF16": "<u2",
    "I32": "<i4",
    "U32": "<u4",
    "F32": "<f4",
    "F64": "<f8",
    "I64": "<i8",
    "U64": "<u8",
}
SAFETENSORS_METADATA_KEY = "__metadata__"
HF_INDEX_NAME = "model.safetensors.index.json"

# --- Marlin layout and limits (checkpoint-formats.md section 4) ----------------------
#: B is stored in 16x16 tiles of (k, n).
MARLIN_TILE = 16
#: Codes per int32 word.
MARLIN_PACK_FACTOR = 8
#: The symmetric offset hard-wired in Marlin's dequant: W = (q - 8) * s.
MARLIN_ZERO = 8
#: Our conversion rule: the smallest tile the layout is defined on.
CONVERT_K_MULTIPLE = MARLIN_TILE
CONVERT_N_MULTIPLE = 64
CONVERT_GROUP_MULTIPLE = MARLIN_TILE
#: Rows in a whole block of every packed bit width (3-bit packs 32 codes in 3 words,
#: 2-bit 16 in one): K chunks that start on it never split a source word.
PACKED_ROW_BLOCK = 32
#: What the columns of a padded layer (N rounded up to a multiple of 64) hold: the
#: zero weight (q - 8) * s + delta = 0, so a kernel that computed them would get 0.
PAD_CODE = MARLIN_ZERO
PAD_SCALE = 1.0
PAD_DELTA = 0.0
#: Upstream IST-DASLab Marlin's own limits (marlin.Layer), recorded per layer.
UPSTREAM_K_MULTIPLE = 128
UPSTREAM_N_MULTIPLE = 256
UPSTREAM_GROUP_SIZES = (128, -1)
#: 8x8 transpose of every 64-column chunk of grouped scales: new[8i+j] = old[8j+i].
SCALE_PERM_GROUPED_CHUNK = 64
#: Per-channel scale permutation, applied to every 32-column chunk (section 4.4).
SCALE_PERM_SINGLE = (
    0, 1, 8, 9, 16, 17, 24, 25,
    2, 3, 10, 11, 18, 19, 26, 27,
    4, 5, 12, 13, 20, 21, 28, 29,
    6, 7, 14, 15, 22, 23, 30, 31,
)  # fmt: skip

#: Our own GEMM's limits (kernels/marlin_gemm.cu): K % 64, N % 64, and any group
#: size that is a multiple of 16 dividing K, or per-channel.
KERNEL_K_MULTIPLE = 64
#: Columns of one output block of our GEMM (and of the other kernels' grids): N % 64.
KERNEL_N_MULTIPLE = 64
#: The bar for our fp16 GEMM against an fp32 reference: a layer fails above this mean
#: relative error (marlin-verify's GPU mode and converter.gpu.verify).
GPU_MEAN_REL_TOL = 1e-3
#: The same bar for bf16 activations: bf16's unit roundoff (2^-8) is 8x fp16's (2^-11),
#: and the output (and on the per-weight routes the weight ``(q - 8) * s``) is rounded to it.
GPU_MEAN_REL_TOL_BF16 = 8e-3
#: The activation types of our kernels, and each one's bar.
GPU_MEAN_REL_TOLS = {"float16": GPU_MEAN_REL_TOL, "bfloat16": GPU_MEAN_REL_TOL_BF16}

# --- Artifact (schemas/marlin-artifact.v2.schema.json) --------------------------------
PRODUCER_NAME = "marlin-convert"
#: Folder mode's ``config.json`` field that transformers reads as the name of the weight file.
HF_WEIGHTS_KEY = "transformers_weights"
#: Its value there: no safetensors name, so a plain ``from_pretrained`` stops with this text
#: before it builds anything (it would give random weights to the quantized layers); after
#: ``import converter`` the registered quantizer names the artifact instead (docs/serving.md).
HF_WEIGHTS_GUARD = (
    "this is a marlin-convert model: run `import converter` before from_pretrained "
    "(without it transformers would give its quantized layers random weights)"
)
#: v2 added the layer fields ``source_group_size`` (regrouped) and ``padded_n`` (padded), and
#: ``checksums.files`` (folder mode's config.json and tokenizer files).
ARTIFACT_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
META_FORMAT = "format"
META_FORMAT_VALUE = "pt"
META_SCHEMA_VERSION = "marlin.schema_version"
META_MANIFEST = "marlin.manifest"
#: safetensors ``__metadata__`` key of a compressed-tensors export's manifest (never the
#: Marlin artifact's keys: our own reader must read the export back as a source).
EXPORT_META_KEY = "marlin_convert_export"
#: xxh3-128 of the manifest string, so a flipped byte in the manifest is caught too.
META_MANIFEST_CHECKSUM = "marlin.manifest_checksum"
CHECKSUM_ALGORITHM = "xxh3_128"
CHECKSUM_HEX_LEN = 32


class Suffix(str, enum.Enum):
    """Artifact tensor-name suffixes for a converted layer ``<prefix>``."""

    B = "marlin_B"
    """int32 ``(size_k // 16, layout_n * 16 // MARLIN_PACK_FACTOR)``, Marlin tile order
    (``layout_n``: ``padded_n`` when the layer is padded, else ``size_n``)."""
    SCALES = "marlin_scales"
    """float16 ``(num_groups, layout_n)``, Marlin scale permutation (64- or 32-entry)."""
    DELTA = "marlin_delta"
    """float32 ``(num_groups, layout_n)``, natural column order, group order."""
    PERM = "marlin_perm"
    """int32 ``(size_k,)``: Marlin row k holds source input channel ``perm[k]``."""
    BIAS = "bias"
    """Source dtype ``(size_n,)``, natural order, unchanged."""


class SourceFormat(str, enum.Enum):
    """Input formats the converter recognises (JSON-visible values)."""

    TINYLOOP = "tinyloop"
    GPTQ = "gptq"
    AWQ = "awq"
    COMPRESSED_TENSORS = "compressed-tensors"


class ZeroConvention(str, enum.Enum):
    """How a source stores the asymmetric offset (JSON-visible values).

    * ``gptq_v1``: stored nibble = z - 1 (whole-word borrows, section 1.5).
    * ``gptq_v2``: stored nibble = z.
    * ``tinyloop_additive``: float ``zero`` in weight units, W = q*s + zero.
    * ``awq``: stored nibble = z, AWQ interleave.
    * ``ct_offset8``: compressed-tensors, stored zero = signed zero + 2^(b-1).
    """

    GPTQ_V1 = "gptq_v1"
    GPTQ_V2 = "gptq_v2"
    TINYLOOP_ADDITIVE = "tinyloop_additive"
    AWQ = "awq"
    CT_OFFSET8 = "ct_offset8"


#: Why a model folder converted from a ``.tinyloop`` file loads in no model class (the
#: loaders refuse it; the conversion warns).
TINYLOOP_MESSAGE = (
    "converted from a .tinyloop checkpoint: TinyLoop models are not a transformers architecture, so there is "
    "no model to build; run its layers with converter.gpu.api.load_artifact_gpu"
)
