"""Seeds and random-number state: the one place that says how a seed is made.

:func:`derived_seed` turns a seed and the names of what it is for (a rank, a split) into an
independent 63-bit seed. It imports nothing of fbtrain, so every layer can use it.
"""

from __future__ import annotations

import hashlib


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from its parts whose stream is unrelated to other parts' streams.

    Hashing, because seed + rank would make rank 1 of seed s replay rank 0 of seed s + 1.
    """
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
