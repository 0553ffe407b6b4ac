"""Time and peak memory of a BPE run's data (data.tokenizer: bpe): learning the vocabulary
from the training split and encoding the whole text, on a file of ``--mb`` megabytes made
by repeating ``--path``.

    python scripts/bpe_speed.py --path input.txt                  # 100 MB, 512 pieces
    python scripts/bpe_speed.py --path input.txt --mb 10 --json out.json

The work runs in a fresh process (``--child``), so its peak resident memory (``ru_maxrss``)
is its own: Python, torch, the text and its ids. It reads the text the way a run does
(:func:`fbtrain.data.text.load_text`), then times the two steps of
:func:`fbtrain.data.corpus.bpe_corpus` apart.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(path: str, vocab_size: int) -> None:
    """Learn and encode once; print one JSON line of seconds, sizes and peak RSS."""
    from fbtrain.config import DataConfig
    from fbtrain.data.corpus import text_bytes
    from fbtrain.data.streams import split_point
    from fbtrain.data.text import load_text
    from fbtrain.data.tokenizers import BpeTokenizer

    cfg = DataConfig(path=path, tokenizer="bpe", vocab_size=vocab_size)
    start = time.perf_counter()
    text = load_text(cfg)
    read = time.perf_counter()
    n_train = split_point(len(text), cfg.val_fraction)
    tokenizer = BpeTokenizer.learn(text[:n_train], vocab_size, text_bytes(text))
    learned = time.perf_counter()
    ids = tokenizer.encode_compact(text)
    encoded = time.perf_counter()
    print(json.dumps({
        "bytes": Path(path).stat().st_size, "characters": len(text), "pieces": len(ids),
        "vocab_size": tokenizer.vocab_size, "dtype": str(ids.dtype),
        "read_s": read - start, "learn_s": learned - read, "encode_s": encoded - learned,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="a UTF-8 text to repeat")
    parser.add_argument("--mb", type=float, default=100.0, help="size of the text timed (MB)")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.path, args.vocab_size)
        return 0
    unit = Path(args.path).read_text(encoding="utf-8")
    target = int(args.mb * 1_000_000)
    with tempfile.TemporaryDirectory() as folder:
        big = Path(folder) / "text.txt"
        with big.open("w", encoding="utf-8") as f:
            written = 0
            while written < target:
                f.write(unit)
                written += len(unit.encode("utf-8"))
        out = subprocess.run([sys.executable, __file__, "--child", "--path", str(big),
                              "--vocab-size", str(args.vocab_size)],
                             check=True, capture_output=True, text=True).stdout
    result = json.loads(out.splitlines()[-1])
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
