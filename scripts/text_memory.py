"""Peak memory of reading and tokenizing a text file (``data.path``), per byte of the file:
the figure behind ``fbtrain.data.text.TEXT_MEMORY_PER_BYTE``.

    python scripts/text_memory.py --text input.txt --mb 20 50 100
    python scripts/text_memory.py --mb 1 --json out.json      # generated texts

Each text is ``--mb`` megabytes made by repeating ``--text`` (default: generated English-like
words), and the same text with its letters written as Greek (2 bytes of UTF-8 each) and as
CJK ideographs (3 bytes each). Each is loaded by ``load_corpus`` in a fresh process
(``--child``) after its imports, with the peak resident size reset first (Linux's
``/proc/self/clear_refs``); the report is the growth of the peak resident size (VmHWM) and
of the peak address space (VmPeak, what ``ulimit -v`` limits) over the size of the file.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("ascii", "2-byte", "3-byte")
WORDS = ("the", "king", "queen", "and", "to", "of", "my", "lord", "thou", "art", "good",
         "What", "say", "you", "?", "!", "I", "will", "not", "be", "so", "thee", "hath")


def status() -> dict[str, int]:
    """This process's VmRSS, VmHWM, VmSize and VmPeak in bytes (/proc/self/status)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSize", "VmPeak"):
            found[key] = int(value.split()[0]) * 1024
    return found


def child(path: str) -> None:
    """Load ``path`` as ``data.path``; print one JSON line of the memory it took."""
    from fbtrain.config import DataConfig
    from fbtrain.data.corpus import load_corpus

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
    before = status()
    corpus = load_corpus(DataConfig(path=path))
    after = status()
    print(json.dumps({"rss_growth": after["VmHWM"] - before["VmRSS"],
                      "address_growth": after["VmPeak"] - before["VmSize"],
                      "tokens": sum(len(s.inputs) + 1 for s in corpus.splits.values()),
                      "vocab": corpus.tokenizer.vocab_size}))


def make_text(source: str, kind: str, size: int) -> bytes:
    """``source`` repeated to ``size`` bytes of UTF-8, its letters re-written as ``kind``
    (cut at a character's end)."""
    if kind == "2-byte":  # Greek: U+0391.. (2 bytes of UTF-8 each)
        source = "".join(chr(0x391 + ord(c) % 25) if c.isalpha() else c for c in source)
    elif kind == "3-byte":  # CJK ideographs: U+4E00.. (3 bytes each)
        source = "".join(chr(0x4E00 + ord(c) % 64) if c.isalpha() else c for c in source)
    unit = source.encode("utf-8")
    data = unit * (size // len(unit) + 1)
    return data[:size].decode("utf-8", errors="ignore").encode("utf-8")


def generated(size: int = 1 << 20) -> str:
    rng = random.Random(0)
    lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
             for _ in range(size // 40))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", help="a UTF-8 text to repeat (default: generated words)")
    parser.add_argument("--mb", type=float, nargs="+", default=[20.0],
                        help="sizes of the texts, in megabytes (10^6 bytes)")
    parser.add_argument("--json", metavar="FILE", help="also write the report here")
    parser.add_argument("--child", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    source = Path(args.text).read_text(encoding="utf-8") if args.text else generated()
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.mb:
            for kind in KINDS:
                file = Path(tmp) / f"{kind}.txt"
                file.write_bytes(make_text(source, kind, int(mb * 1e6)))
                size = file.stat().st_size
                proc = subprocess.run([sys.executable, __file__, "--child", str(file)],
                                      capture_output=True, text=True, check=False)
                file.unlink()
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                r.update(kind=kind, bytes=size, rss_per_byte=r["rss_growth"] / size,
                         address_per_byte=r["address_growth"] / size)
                report.append(r)
                print(f"{size / 1e6:6.1f} MB {kind:>6}: peak RSS +{r['rss_growth'] / 1e6:,.0f} "
                      f"MB ({r['rss_per_byte']:.1f} per byte), peak address space "
                      f"+{r['address_growth'] / 1e6:,.0f} MB ({r['address_per_byte']:.1f} per "
                      f"byte), {r['tokens']:,} tokens")
    worst = max(max(r["rss_per_byte"], r["address_per_byte"]) for r in report)
    print(f"most per byte: {worst:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
