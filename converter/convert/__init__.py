"""Source checkpoint -> Marlin artifact, streaming tensor by tensor.

Flow: ``plan`` (metadata and small tensors only; every check that can fail on the
input runs here, before anything is written), then stream each layer in K chunks
through :func:`~converter.marlin.layout.pack_b` into an
:class:`~converter.artifact.writer.ArtifactWriter` (one file, shards or a model
folder; temporary files, fsync, rename), hashing every tensor's bytes on the way.

A padded layer (``LayerPlan.padded_n``) gets its zero columns here, where the layout is
written: code 8, scale 1, delta 0 (``PAD_CODE``, ``PAD_SCALE``, ``PAD_DELTA`` in
:mod:`converter.constants`).  A regrouped layer arrives from its reader already at the
artifact's group size (:meth:`~converter.formats.base.LayerPlan.source_group_rows`).

Three threads share the work (docs/performance-cpu.md): the main one reads and packs
(the compiled packer releases the GIL), a write-behind thread hashes and writes the
chunks while the next is packed (splicing them into the file, copying pass-through
tensors file to file, and starting the disk's write-back as it goes), and one computes
the sha256 of the input files for the manifest from the start (overlapping planning,
when the second core is otherwise idle); the manifest is sized with placeholder
digests and sealed with the real ones last, so nothing waits for the hash before the
output checks have passed.
"""

from .plan import CHUNK_CODE_BYTES, PLAIN_REASON, InputStats, build_layout, chunk_rows, layer_tensor_names
from .report import ConvertReport, NotConverted, Progress
from .run import convert
from .stream import COPY_CHUNK_BYTES, SMALL_BATCH_BYTES, SMALL_BATCH_COUNT, SMALL_TENSOR_BYTES

__all__ = [
    "CHUNK_CODE_BYTES",
    "COPY_CHUNK_BYTES",
    "PLAIN_REASON",
    "SMALL_BATCH_BYTES",
    "SMALL_BATCH_COUNT",
    "SMALL_TENSOR_BYTES",
    "ConvertReport",
    "InputStats",
    "NotConverted",
    "Progress",
    "build_layout",
    "chunk_rows",
    "convert",
    "layer_tensor_names",
]
