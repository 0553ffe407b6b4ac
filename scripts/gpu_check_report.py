"""The bookkeeping of scripts/gpu_check.py, apart from what it measures: the hard time budget,
each section's file (written atomically as soon as the section ends), the watchdog that
cuts a run at the budget, and the summary table printed last.

No torch here: this module must import and work before anything heavy is loaded, and it is
what a run killed part-way leaves behind that a reader relies on.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SKIPPED = "skipped: budget"  # the entry a unit of work left undone for lack of time gets
NEEDS_CUDA = "needs CUDA"  # the entry of a unit that means nothing on the CPU stand-in


class BudgetExceeded(Exception):
    """Raised by :meth:`Budget.check` when a unit of work would start past the budget."""


class Budget:
    """The run's wall-clock budget (seconds, from construction). Every section asks
    :meth:`allows` before each unit of work; a unit that is not allowed is recorded as
    ``SKIPPED`` and the rest of the section goes on (each later unit asks again)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need_s: float = 0.0) -> bool:
        """Whether a unit expected to take ``need_s`` seconds fits in what is left."""
        return self.left() > need_s

    def timeout(self, reserve_s: float = 5.0) -> float:
        """A subprocess's time limit: what is left, less ``reserve_s`` (1 s at least)."""
        return max(1.0, self.left() - reserve_s)


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its finished subprocesses."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_json_atomic(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path``: written to a temporary file beside it, flushed to disk
    and renamed over it, so the file is either absent, the old one, or whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Report:
    """The sections' results: each one, once done, goes to ``out/<name>.json`` (atomic),
    one line is printed for it, and its row joins the summary table.

    A section is a dict that its code fills as it goes (``status``, ``summary``, results);
    the watchdog (:meth:`start_watchdog`) writes whatever the section in progress has when
    the budget runs out, marked ``cut: budget``, then the table, and ends the process."""

    def __init__(self, out: Path, budget: Budget, where: str):
        self.out, self.budget, self.where = out, budget, where
        self.rows: list[tuple[str, str, float, str]] = []
        self.current: tuple[str, dict, float] | None = None
        self.child: subprocess.Popen | None = None  # a subprocess to end with the run
        self.lock = threading.Lock()
        self.failed = False
        self.cpu_at_begin = 0.0

    def begin(self, name: str, title: str) -> dict:
        """A new section ``name``; returns its dict to fill."""
        print(f"\n== {name}: {title} (at {self.budget.elapsed():.0f} s)", flush=True)
        data: dict = {"section": name, "title": title, "status": "running"}
        with self.lock:
            self.current = (name, data, self.budget.elapsed())
            self.cpu_at_begin = cpu_seconds()
        return data

    def end(self, status: str, summary: str) -> None:
        """The section in progress is done: ``status`` (``PASS``, ``FAIL``, ``ok`` or
        ``needs CUDA``) and a one-line ``summary``; its file is written."""
        with self.lock:
            if self.current is None:
                return
            name, data, started = self.current
            self.current = None
            self._finish(name, data, started, status, summary)

    def _finish(self, name: str, data: dict, started: float, status: str,
                summary: str) -> None:
        seconds = self.budget.elapsed() - started
        data.update(status=status, summary=summary, seconds=round(seconds, 2),
                    cpu_seconds=round(cpu_seconds() - self.cpu_at_begin, 2))
        write_json_atomic(self.out / f"{name}.json", data)
        self.failed |= status in ("FAIL", "cut: budget")
        self.rows.append((name, status, seconds, summary))
        print(f"{name}: {status} in {seconds:.1f} s: {summary}  [{self.out / name}.json]",
              flush=True)

    def table(self) -> list[str]:
        """The summary table: one line per section, in order (the last lines printed)."""
        lines = [f"== summary: {self.budget.elapsed():.0f} s of a {self.budget.seconds:.0f} s "
                 f"budget; {self.where}",
                 f"{'section':<16} {'status':<12} {'s':>6}  result"]
        for name, status, seconds, summary in self.rows:
            lines.append(f"{name:<16} {status:<12} {seconds:6.1f}  {summary}")
        return lines

    def close(self) -> int:
        """Write ``summary.json``, print the table; the exit status (1: a check failed)."""
        write_json_atomic(self.out / "summary.json", {
            "where": self.where, "seconds": round(self.budget.elapsed(), 2),
            "budget_s": self.budget.seconds,
            "sections": [{"section": n, "status": s, "seconds": round(t, 2), "summary": m}
                         for n, s, t, m in self.rows]})
        print("\n" + "\n".join(self.table()), flush=True)
        return 1 if self.failed else 0

    def start_watchdog(self, grace_s: float = 0.0) -> threading.Timer:
        """At the budget (plus ``grace_s``): end a running subprocess, write the section in
        progress as ``cut: budget``, print the table and end the process (exit 3), wherever
        the main thread is (a kernel compile, a C++ build, a long step)."""

        def cut() -> None:
            with self.lock:
                if self.child is not None and self.child.poll() is None:
                    self.child.kill()
                if self.current is not None:
                    name, data, started = self.current
                    self.current = None
                    self._finish(name, _snapshot(data), started, "cut: budget",
                                 "the budget ran out inside this section")
            self.close()
            sys.stdout.flush()
            os._exit(3)

        timer = threading.Timer(max(0.0, self.budget.left() + grace_s), cut)
        timer.daemon = True
        timer.start()
        return timer

    def run_child(self, cmd: list[str], timeout: float, **kwargs: Any
                  ) -> subprocess.CompletedProcess:
        """``subprocess.run`` (text, output captured) that the watchdog can end."""
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **kwargs) as proc:
            self.child = proc
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
            finally:
                self.child = None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _snapshot(data: dict) -> dict:
    """A deep copy of a section's results that the main thread may be changing as it is
    read (the watchdog's view): a few tries, else what is safe to say."""
    for _ in range(5):
        try:
            return json.loads(json.dumps(data, default=str))
        except (RuntimeError, ValueError):  # changed during the copy: again
            time.sleep(0.01)
    return {"section": data.get("section"), "note": "results unreadable at the cut"}
