"""Split GGUF files (llama.cpp's gguf-split, gguf-py's `split_max_tensors`): `NAME-00001-of-00003.gguf`, ...

The first part holds the metadata; every part holds some tensors and the `split.*` keys (`split.no` counts
from 0, `split.count`, `split.tensors.count`). `SplitGGUF` presents the parts as one reader: the first
part's fields, every part's tensors, in part order.
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFReader
from gguf.gguf_reader import ReaderField, ReaderTensor

from shardline.models.errors import CorruptModelError, ModelNotFoundError

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS = "split.tensors.count"


def split_stem(path: Path) -> str:
    """The file's stem without a split suffix: `Qwen3-8B-Q4_K_M` for `Qwen3-8B-Q4_K_M-00001-of-00002.gguf`."""
    m = SPLIT_NAME.match(path.name)
    return m["stem"] if m else path.stem


def split_parts(path: Path) -> list[Path]:
    """Every part of the split GGUF `path` belongs to, first first (any part may be given); [path] for a
    file that is not a split. A missing part: ModelNotFoundError naming it."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise ModelNotFoundError(f"{path}: part {int(m['no'])} of {count} is not a split GGUF part name")
    width = len(m["no"])
    parts = [path.with_name(f"{m['stem']}-{i:0{width}d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(
            f"split GGUF {parts[0].name} lacks {len(missing)} of its {count} parts: {', '.join(missing)}"
        )
    return parts


def _scalar(reader: GGUFReader, key: str) -> int | None:
    field: ReaderField | None = reader.fields.get(key)
    return None if field is None else int(field.contents())


class SplitGGUF:
    """The parts of a split GGUF read as one: `fields` of the first part, `tensors` of all of them (what
    gguf_import reads of a GGUFReader)."""

    def __init__(self, parts: list[Path]) -> None:
        self.parts = parts
        self.readers = [GGUFReader(p) for p in parts]
        first = self.readers[0]
        self.fields: dict[str, ReaderField] = first.fields
        self.tensors: list[ReaderTensor] = [t for r in self.readers for t in r.tensors]
        count = _scalar(first, SPLIT_COUNT)
        if count is not None and count != len(parts):
            raise CorruptModelError(
                f"{parts[0].name}: split.count is {count}, but {len(parts)} parts are named"
            )
        for i, (part, reader) in enumerate(zip(parts, self.readers, strict=True)):
            no = _scalar(reader, SPLIT_NO)
            if no is not None and no != i:
                raise CorruptModelError(f"{part.name}: split.no is {no}, expected {i} (parts mixed up?)")
        total = _scalar(first, SPLIT_TENSORS)
        if total is not None and total != len(self.tensors):
            raise CorruptModelError(
                f"{parts[0].name}: split.tensors.count is {total}, the parts hold {len(self.tensors)}"
            )
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise CorruptModelError(f"{parts[0].name}: a tensor name appears in two parts")

    @property
    def nbytes(self) -> int:
        """The parts' bytes together."""
        return sum(p.stat().st_size for p in self.parts)
