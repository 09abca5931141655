"""``marlin-verify``'s checks beyond structure: exact comparison with the source
(``--against``), CPU numerics, and (through ``converter.gpu``) GPU numerics.

Verification streams like conversion: layer by layer, in chunks of rows
(:func:`converter.convert.chunk_rows`), the artifact's and the source's tensors are read,
compared bitwise and multiplied, and the mapped pages of both are dropped before the
next chunk, so memory does not grow with the number of layers.  Stages, each named on
the progress bar: ``checksums`` (every tensor's xxh3-128), then per layer ``against
source`` and ``CPU numerics`` together (one read serves both), then GPU numerics.  The
source's sha256 (``source_differs``) is computed on a thread of its own from the start;
the CPU products of a chunk run on two more threads while the next chunk is read.

A padded layer is compared on its ``size_n`` real columns, and its padding columns
must be exactly code 8, scale 1.0 and delta +0.0; numerics use the real columns only.
A regrouped layer is read in chunks of whole source groups.
"""

from .against import COMPARE_CHUNK_BYTES, SPLIT_COMPARE_BYTES
from .cpu_numerics import CPU_M, CPU_REL_TOL
from .cpu_numerics import _widened as _widened  # converter/export/verify.py widens its chunks the same way
from .gpu_numerics import artifact_weight, unpack_layer
from .layer_pass import COMPILED_CHUNK_DIVISOR, NUMPY_CHUNK_DIVISOR
from .run import verify

__all__ = [
    "COMPARE_CHUNK_BYTES",
    "COMPILED_CHUNK_DIVISOR",
    "CPU_M",
    "CPU_REL_TOL",
    "NUMPY_CHUNK_DIVISOR",
    "SPLIT_COMPARE_BYTES",
    "artifact_weight",
    "unpack_layer",
    "verify",
]
