"""Time and peak memory of loading enwik8, first run (download, unzip, check, cache) and
cached run, on a synthetic corpus of random bytes served from 127.0.0.1 (no network).

    python scripts/corpus_load.py                 # 100,000,000 bytes, as enwik8
    python scripts/corpus_load.py --json out.json

Each run is a fresh process (``--child``), so its peak resident memory (``ru_maxrss``) is
its own: Python, torch and the corpus. ``--size`` other than enwik8's shrinks the size
check and split for that process only (a smoke test of this script), as the tests do.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ENWIK8_SIZE = 100_000_000


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # the report is the only output
        pass


def child(url: str, cache: str, size: int) -> None:
    """Load the corpus once and print one JSON line: seconds, peak RSS, split sizes."""
    start = time.perf_counter()
    from fbtrain.config import DataConfig
    from fbtrain.data import archives
    from fbtrain.data.corpus import load_corpus

    imported = time.perf_counter()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Python + torch
    if size != ENWIK8_SIZE:
        archives.SIZE, archives.HELD_OUT = size, size // 20
    corpus = load_corpus(DataConfig(dataset="enwik8", url=url, cache_dir=cache))
    done = time.perf_counter()
    print(json.dumps({
        "import_s": round(imported - start, 3),
        "load_s": round(done - imported, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_imports_mb": round(base_rss, 1),
        "vocab": corpus.tokenizer.vocab_size,
        "splits": {k: len(v.inputs) for k, v in corpus.splits.items()},
        "dtype": str(corpus.stream("train").inputs.dtype),
    }))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=ENWIK8_SIZE, help="bytes of the corpus")
    parser.add_argument("--json", metavar="FILE", help="also write the report here")
    parser.add_argument("--child", nargs=2, metavar=("URL", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.size)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:  # random bytes don't shrink
            zf.writestr("enwik8", os.urandom(args.size))
        (root / "enwik8.zip").write_bytes(buf.getvalue())
        del buf
        handler = functools.partial(QuietHandler, directory=str(root))
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}/enwik8.zip"
        env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        report: dict[str, object] = {"size": args.size}
        for run in ("first", "cached"):
            proc = subprocess.run([sys.executable, __file__, "--size", str(args.size),
                                   "--child", url, str(root / "cache")],
                                  capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            report[run] = json.loads(proc.stdout.strip().splitlines()[-1])
        httpd.shutdown()
    for run in ("first", "cached"):
        r = report[run]
        print(f"{run:>6}: load {r['load_s']:.2f} s (+ imports {r['import_s']:.2f} s), "
              f"peak RSS {r['peak_rss_mb']:.0f} MB ({r['rss_after_imports_mb']:.0f} MB after "
              f"imports), splits {r['splits']}, {r['dtype']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
