"""A process's own edges, tested for real: started with a standard stream closed, stopped
by SIGTERM before training began (issue 31, items 6 and 14)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import Server
from test_train import CHILD_ENV, make_raw

from fbtrain.models.core import native

REPO = Path(__file__).resolve().parents[1]


def _copied_core(tmp_path: Path) -> dict[str, str]:
    """A TORCH_EXTENSIONS_DIR of its own holding this session's build of the core (copied:
    nothing compiles, but torch still runs its ninja over it, as on a first use)."""
    native.native_ops()  # this session's build, made here if not yet
    name = native.extension_name(*native._core_recipe())
    root = tmp_path / "extensions"
    shutil.copytree(native.build_directory(name), root / name)  # keeps the mtimes
    return {**CHILD_ENV, "TORCH_EXTENSIONS_DIR": str(root), "FBTRAIN_CORE": "native"}


def test_training_with_stdout_or_stderr_closed(tmp_path: Path) -> None:
    """`fbtrain train ... >&-` (and `2>&-`) on a first use of the core ended in torch's
    `sys.stdout.flush()` on None (AttributeError, exit 1, nothing trained)."""
    env = _copied_core(tmp_path)
    for name, closing in (("out", ">&-"), ("err", "2>&-")):
        raw = make_raw(tmp_path, name, train={"max_steps": 2})
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        command = (f"exec {sys.executable} -m fbtrain train --config {tmp_path / name}.yaml "
                   f"{closing}")
        proc = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert proc.returncode == 0, (closing, proc.stdout, proc.stderr)
        assert (tmp_path / "runs" / name / "checkpoints" / "last.pt").is_file()
        # The closed stream stayed closed to the reader: nothing arrived there, and the
        # descriptor was no file's (a lock file, a checkpoint) in between.
        assert (proc.stdout if closing == ">&-" else proc.stderr) == ""
        assert "Traceback" not in proc.stderr + proc.stdout


def test_sigterm_while_the_data_downloads_cleans_up_like_ctrl_c(
        tmp_path: Path, server: Server) -> None:
    """SIGTERM during the data load exited 143 with no word, leaving runs/<name>/.lock
    (SIGINT at the same point said "interrupted" and left nothing)."""
    raw = make_raw(tmp_path, "dl")
    raw["data"] = {"dataset": "stalled", "url": server.url("/stall"), "sha256": None,
                   "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    for sig, code, line in ((signal.SIGTERM, 143, "interrupted (SIGTERM)"),
                            (signal.SIGINT, 130, "interrupted")):
        hits = server.hits["/stall"]
        proc = subprocess.Popen([sys.executable, "-m", "fbtrain", "train", "--config",
                                 str(tmp_path / "cfg.yaml")], env=CHILD_ENV, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while server.hits["/stall"] == hits:  # until it waits on the download
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.05)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == code, err
        assert err.splitlines()[-1] == line and "Traceback" not in err, err
        assert not (tmp_path / "runs").exists(), sorted(map(str, (tmp_path / "runs").rglob("*")))
        assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()
                    and not p.name.endswith(".lock")]
