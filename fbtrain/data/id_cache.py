"""A BPE corpus's token ids, encoded once and memory-mapped after: the splits as views of
one file in the download cache, as enwik8's bytes are.

Encoding a large text with a learned vocabulary takes a while (docs/datasets.md), and every
start on it would pay again: a resume, ``fbtrain eval``, another run on the same text. So
the first writes its ids (uint16 where the vocabulary allows, else int32; the training
split's, then the validation split's) to ``<cache>/bpe-ids/<digest>.ids`` beside a record of
the two lengths, named by a digest of everything the ids depend on: the text, the
vocabulary, the split point and the encoder's own rules (``bpe.ENCODING``). The next maps
that file (``torch.from_file``, private: the pages are the file's until written, and
nothing writes them) instead of encoding. The record also holds a SHA-256 of the ids,
checked on every mapping (a small fraction of the encoding's time): an entry damaged in
place, whose size still matches, would otherwise feed the run other tokens, or ids past the
vocabulary. An entry that does not match its record is encoded again; a cache that cannot
be written costs the speed-up, not the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import torch
from torch import Tensor

from fbtrain.data import bpe
from fbtrain.io import atomic_write, atomic_write_text

log = logging.getLogger(__name__)

FOLDER = "bpe-ids"
_HASHED_CHARS = 1 << 20  # text hashed a part at a time (no whole UTF-8 copy)


def ids_key(text: str, vocab: Sequence[str], n_train: int, dtype: torch.dtype) -> str:
    """The digest an entry is named by: the text, the vocabulary (its pieces in id order),
    the split point, the ids' dtype and the encoder's rules."""
    digest = hashlib.sha256()
    for start in range(0, len(text), _HASHED_CHARS):
        digest.update(text[start:start + _HASHED_CHARS].encode("utf-8", "surrogatepass"))
    digest.update(json.dumps([list(vocab), n_train, str(dtype), bpe.ENCODING]).encode("utf-8"))
    return digest.hexdigest()[:32]


def cached_ids(folder: Path, key: str, dtype: torch.dtype,
               encode: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The train and val ids ``[n]`` of ``dtype`` under ``key`` in ``folder``: mapped from
    the entry when it is whole, else ``encode()``d, written, and mapped from what was
    written (the encoded copy is let go)."""
    entry = folder / FOLDER / f"{key}.ids"
    mapped = _mapped(entry, dtype)
    if mapped is not None:
        return mapped
    train, val = encode()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(entry, lambda f: _write(f, (train, val)))
        atomic_write_text(_record(entry), json.dumps({
            "train": len(train), "val": len(val), "dtype": str(dtype),
            "sha256": _digest(train, val)}))
    except OSError as e:  # a read-only or full cache: this run encodes, the next does too
        log.warning("could not keep the encoded ids in %s (%s); the next start on this text "
                    "encodes it again", entry, e)
        return train, val
    return _mapped(entry, dtype) or (train, val)


def _write(f: IO[bytes], splits: tuple[Tensor, Tensor]) -> None:
    """The splits' ids, in order, from their own memory (numpy's view of it: no copy)."""
    for ids in splits:
        f.write(ids.contiguous().numpy())


def _digest(*splits: Tensor) -> str:
    """SHA-256 of the splits' ids as the entry holds them (read in place, no copy)."""
    digest = hashlib.sha256()
    for ids in splits:
        digest.update(ids.contiguous().numpy())
    return digest.hexdigest()


def _mapped(entry: Path, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """The entry's two splits as views of one private mapping; None when it is missing or
    does not hold what its record says (lengths, dtype, digest)."""
    try:
        record = json.loads(_record(entry).read_text(encoding="utf-8"))
        n_train, n_val = int(record["train"]), int(record["val"])
        size = entry.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if record.get("dtype") != str(dtype) or size != (n_train + n_val) * itemsize:
        return None
    ids = torch.from_file(str(entry), shared=False, size=n_train + n_val, dtype=dtype)
    if record.get("sha256") != _digest(ids):
        return None
    return ids[:n_train], ids[n_train:]


def _record(entry: Path) -> Path:
    return entry.with_suffix(".json")
