"""How much memory this process may use: the least of the machine's physical memory, its
address-space limit (``RLIMIT_AS``, ``ulimit -v``) and its cgroup's memory limit (v2
``memory.max``, v1 ``memory.limit_in_bytes``: a container's, or a batch job's); and what an
allocation that failed looks like (:func:`is_allocation_failure`).

A run on a shared machine is usually held to far less than the machine has; an estimate
held against the machine alone lets through what the limit then kills minutes later.
"""

from __future__ import annotations

import errno
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from fbtrain.messages import format_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large is none.
NO_LIMIT = 2**62
MACHINE = "this machine has"  # MemoryLimit.holder of the machine's own memory


@dataclass(frozen=True)
class MemoryLimit:
    """``size`` bytes, and the words that say whose limit it is (``this machine has``)."""

    size: int
    holder: str  # "this machine has", "this process may use", "this process's cgroup allows"
    how: str = ""  # where the figure comes from, for the message: " (ulimit -v ...)"


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where the system does not say."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def mapped_bytes() -> int:
    """This process's address space in use now (VmSize), 0 where /proc does not say."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def address_space_limit() -> MemoryLimit | None:
    """What ``RLIMIT_AS`` (``ulimit -v``) leaves this process: the soft limit less what it
    has mapped already (the interpreter, torch, its libraries), or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= NO_LIMIT:
        return None
    return MemoryLimit(max(0, soft - mapped_bytes()), "this process may use",
                       " (its address-space limit, RLIMIT_AS / ulimit -v, less what it has "
                       "mapped already)")


def cgroup_limit(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> MemoryLimit | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, else v1
    ``memory.limit_in_bytes``), looked up in its own group and the root one, the least
    found; None when there is none. ``root`` and ``proc``: for tests."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        lines = []
    candidates: list[Path] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip("/")
        if controllers == "":  # v2: one unified hierarchy
            candidates += [root / rel / "memory.max", root / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates += [root / "memory" / rel / "memory.limit_in_bytes",
                           root / "memory" / "memory.limit_in_bytes"]
    sizes = []
    for file in candidates:
        try:
            text = file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < NO_LIMIT:  # v2 says "max" for none
            sizes.append((int(text), file.name))
    if not sizes:
        return None
    size, name = min(sizes)
    return MemoryLimit(size, "this process's cgroup allows", f" ({name})")


def memory_limit(physical: int | None) -> MemoryLimit | None:
    """The least of ``physical`` (the machine's memory, None: unknown), RLIMIT_AS and the
    cgroup limit; None when none is known."""
    found = [MemoryLimit(physical, MACHINE)] if physical else []
    found += [limit for limit in (address_space_limit(), cgroup_limit()) if limit is not None]
    return min(found, key=lambda limit: limit.size) if found else None


# What an allocation that failed says, besides MemoryError: c10's CPU allocator ("can't
# allocate memory"), CUDA's ("CUDA out of memory", torch.OutOfMemoryError), and a thread
# whose stack found no room in the address space ("can't start new thread").
ALLOCATION_FAILURES = ("can't allocate memory", "out of memory", "can't start new thread")


def is_allocation_failure(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: a MemoryError, an OSError ENOMEM, an
    allocator's RuntimeError, or the SystemError a C function raises over one of these (an
    import under a tight ``ulimit -v``). Not any other error that mentions memory."""
    if isinstance(error, SystemError):
        inner = error.__cause__ or error.__context__
        return inner is not None and is_allocation_failure(inner)
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    return isinstance(error, RuntimeError) and any(s in str(error) for s in ALLOCATION_FAILURES)


def limit_line(physical: int | None) -> str:
    """The tightest memory limit of this process, whole (not less what it uses), as a
    message names it: "this process's address-space limit (RLIMIT_AS, ulimit -v) is 700.0
    MiB"; ``physical``: the machine's memory (None: unknown)."""
    found = [(physical, f"this machine has {format_bytes(physical)}")] if physical else []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < NO_LIMIT:
        found.append((soft, "this process's address-space limit (RLIMIT_AS, ulimit -v) is "
                            f"{format_bytes(soft)}"))
    cgroup = cgroup_limit()
    if cgroup is not None:
        found.append((cgroup.size, f"{cgroup.holder} {format_bytes(cgroup.size)}{cgroup.how}"))
    return min(found)[1] if found else "this system does not say how much memory there is"


def allocation_failed(error: BaseException, doing: str, fix: str) -> str:
    """The one line for an allocation that failed (``error``) while ``doing`` ("setting up
    the run"; "" to say nothing of it): what it asked for where the allocator says, the
    tightest limit (:func:`limit_line`), and ``fix``."""
    return (f"out of memory{' ' + doing if doing else ''}{_asked(error)}: "
            f"{limit_line(physical_memory())}; {fix}")


def _asked(error: BaseException) -> str:
    """" (it asked for 745.1 GiB)", from the CPU or CUDA allocator's words; else ""."""
    text = str(error)
    found = re.search(r"tried to allocate (\d+) bytes", text)
    if found:
        return f" (it asked for {format_bytes(int(found.group(1)))})"
    found = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)  # CUDA's
    if found:
        return f" (it asked for {found.group(1)})"
    return " (for a new thread)" if "can't start new thread" in text else ""
