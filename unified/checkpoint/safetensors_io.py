"""The safetensors files of a checkpoint: one import for the format (`safetensors_format`),
writing while hashing (`safetensors_write`), reading back verified (`safetensors_read`, placing
arrays with `safetensors_place`) and hashing files (`safetensors_hash`).

The files are standard safetensors (readable by ``safetensors.safe_open``). Writing streams
each array's own buffer to the file and feeds the same buffer to xxh3, so the checksum costs
no extra pass; reading copies the bytes once, into private memory of each array, hashing each
chunk as it arrives. No checkpoint file is ever mapped. Backends and the stores call these
names through this module (``safetensors_io.write``), which is also where tests replace them.
"""
from __future__ import annotations

from .safetensors_format import (  # noqa: F401
    DTYPE_NAMES,
    MAX_HEADER_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_RANK,
    Exported,
    cannot_open,
    checksum_mismatch,
    export_numpy,
    numpy_dtype,
    parse,
    safetensors_dtype,
    size_mismatch,
)
from .safetensors_hash import (  # noqa: F401
    changed_since,
    hash_entries,
    identity,
    verify_file,
    verify_for_reader,
)
from .safetensors_place import (  # noqa: F401
    KeepsHost,
    Overlapped,
    Placing,
    private_array,
)
from .safetensors_read import (  # noqa: F401
    describe,
    describe_file,
    header_of,
    header_of_file,
    read,
    read_into,
    read_placed,
    read_range_into,
    read_stream,
    read_stream_handed,
    read_stream_into,
    read_stream_placed,
)
from .safetensors_write import (  # noqa: F401
    write,
    write_one_by_one,
    write_stream,
)
