"""What the benchmark scripts share: one sample written to a webdataset tar and to an ArrayRecord shard alike."""

from __future__ import annotations

import io
import tarfile
from typing import Any

from datacat.formats.packed import pack_record


def write_sample(tar: tarfile.TarFile, writer: Any, key: str, jpeg: bytes, caption: str) -> None:
    """``key``'s JPEG and caption as two tar members (``.jpg``, ``.txt``) and as one packed ArrayRecord record."""
    for ext, payload in (("jpg", jpeg), ("txt", caption.encode())):
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    writer.write(pack_record({"key": key, "jpg": jpeg, "txt": caption}))
