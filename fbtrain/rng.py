"""Every seed and random state of a run, in one place: derive, seed, preserve, capture,
restore.

A run's numbers depend on three streams: Python's ``random``, torch's global generator
(initialisation, dropout) on the CPU and each CUDA device, and the batch sampler's own
generator (``data``). Seeding them in a fixed order and saving all of them is what makes a
resumed run bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fbtrain.errors import UserError
from fbtrain.messages import a_type, first_line


class RngStateError(UserError):
    """A saved RNG state that cannot be restored (one line naming the file and the part)."""


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from its parts whose stream is unrelated to other parts' streams.

    Hashing, because seed + rank would make rank 1 of seed s replay rank 0 of seed s + 1.
    Every stream of fbtrain has a named derivation below; code elsewhere calls those, so
    what each stream is drawn from reads in one place.
    """
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# The streams of a run, each with its own tag. run.seed itself seeds Python's and torch's
# global generators (seed_everything: initialisation, and dropout on rank 0).


def sampler_seed(seed: int, rank: int) -> int:
    """The batch sampler's generator on rank ``rank`` (which training windows it draws)."""
    return derived_seed("fbtrain", seed, rank)


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """A rank's own stream from ``step`` on, unrelated to other ranks' (and to ``seed + 1``'s):
    the dropout of ranks > 0, and the fresh sampler of a rank whose state a resume lacks."""
    return derived_seed("fbtrain-rank", seed, rank, step)


def sample_seed(seed: int, step: int) -> int:
    """The generator of the text sample logged at ``step`` (its own stream: the logged
    samples never move training's)."""
    return derived_seed("fbtrain-sample", seed, step)


def dataset_seed(seed: int, salt: str) -> int:
    """A generated dataset's stream (``data.seed``), one per ``salt`` (say, a split's)."""
    return derived_seed("algorithmic", seed, salt)


def sample_generator(seed: int) -> torch.Generator:
    """The CPU generator sampling draws from: the same seed gives the same text on CPU and
    GPU (up to float noise), and the global streams are never touched."""
    return torch.Generator(device="cpu").manual_seed(seed)


def seed_everything(seed: int) -> None:
    """Python and torch (CPU and every CUDA device) from ``seed``; nothing in fbtrain draws
    from numpy."""
    random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def preserve_rng(device: torch.device) -> Iterator[None]:
    """Run a block (evaluation, sampling) without moving Python's, torch's or CUDA's RNG."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(state)


def capture_rng() -> dict[str, Any]:
    """Snapshot the global random number generators, in a form ``weights_only`` loading
    accepts: Python's ``random``, torch's CPU generator and every CUDA device's generator
    (when CUDA is available). The batch sampler's generator is the sampler's to save."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        # Python's state is (version, 625 ints, gauss_next). Tuples of ints do load under
        # weights_only today, but an int64 tensor is the one type every torch version's safe
        # unpickler is built for, and it stores 625 numbers as bytes rather than pickle ops.
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], path: str | Path | None = None) -> None:
    """Put back the generators saved by :func:`capture_rng` (those present in ``state``).

    CUDA states are restored only when CUDA is available now; a checkpoint made on a GPU can
    be resumed on a CPU (and vice versa) with the CPU streams still exact.

    A malformed state (a hand-edited or damaged checkpoint) is an :class:`RngStateError`
    naming ``path`` and what is wrong; it is checked whole before anything is restored, so
    a refused state leaves every generator as it was.
    """
    where = f"{path}: " if path is not None else ""
    problem = rng_problem(state)
    if problem:
        raise RngStateError(f"{where}malformed RNG state: {problem}")
    if "python" in state:
        random.setstate(_python_state(state["python"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [s.cpu() for s in state["cuda"]]
        # Resuming on fewer GPUs than were saved: restore the devices that exist.
        try:
            for device, s in enumerate(cuda_states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, device)
        except RuntimeError as e:  # a state of the wrong size for this CUDA generator
            raise RngStateError(f"{where}malformed RNG state: rng.cuda: "
                                  f"{first_line(e)}") from None


class GlobalRng:
    """The global streams (Python, torch, CUDA) as one part of a checkpoint
    (:mod:`fbtrain.checkpoint.state`): a resume needs Python's and torch's."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def state_problem(self, state: Any) -> str:
        if state is None:
            return "missing"
        needed = [k for k in ("python", "torch") if isinstance(state, dict) and k not in state]
        problem = rng_problem(state) or (f"rng lacks {', '.join(needed)}" if needed else "")
        return f"malformed RNG state: {problem}" if problem else ""

    def load_state_dict(self, state: Any) -> None:
        restore_rng(state)


def rng_problem(state: Any) -> str:
    """What is wrong with an RNG state from :func:`capture_rng` ('' when nothing is).

    Each part present is tried on a scratch generator (``random.Random``,
    ``torch.Generator``), so what passes here is exactly what restoring accepts; the CUDA
    states (no scratch CUDA generator without a GPU) are checked for type only.
    """
    if not isinstance(state, dict):
        return f"rng is {a_type(state)}, not a dict"
    if "python" in state:
        try:
            random.Random().setstate(_python_state(state["python"]))
        except (TypeError, ValueError, OverflowError, KeyError) as e:
            return f"rng.python: {first_line(e)}"
    if "torch" in state:
        problem = generator_problem(state["torch"])
        if problem:
            return f"rng.torch: {problem}"
    if "cuda" in state:
        cuda = state["cuda"]
        if not isinstance(cuda, (list, tuple)) or not all(
            torch.is_tensor(s) and s.dtype == torch.uint8 for s in cuda
        ):
            return "rng.cuda: not a list of uint8 tensors (one per GPU)"
    return ""


def _python_state(py: Any) -> tuple[Any, ...]:
    """The ``random.setstate`` tuple from :func:`capture_rng`'s ``python`` dict.

    TypeError/KeyError when ``py`` is not shaped like one (setstate checks the values)."""
    if not isinstance(py, dict):
        raise TypeError(f"is {a_type(py)}, not a dict of version, internal, gauss_next")
    missing = [k for k in ("version", "internal", "gauss_next") if k not in py]
    if missing:
        raise TypeError(f"missing {', '.join(missing)}")
    internal = py["internal"]
    if torch.is_tensor(internal):
        if internal.dim() != 1 or internal.dtype.is_floating_point or internal.is_complex():
            raise TypeError(f"internal is a {internal.dtype} tensor of shape "
                            f"{tuple(internal.shape)}, not 625 integers")
        internal = internal.tolist()
    if not isinstance(internal, (list, tuple)):
        raise TypeError(f"internal is {a_type(internal)}, not 625 integers")
    # setstate takes any gauss_next, and random.gauss() would fail on it later.
    if py["gauss_next"] is not None and not isinstance(py["gauss_next"], float):
        raise TypeError(f"gauss_next is {py['gauss_next']!r}, not a float or None")
    return (py["version"], tuple(internal), py["gauss_next"])


def generator_problem(value: Any) -> str:
    """Why ``value`` is not a CPU ``torch.Generator`` state ('' when it is one)."""
    if not torch.is_tensor(value) or value.dtype != torch.uint8:
        kind = f"a {value.dtype} tensor" if torch.is_tensor(value) else a_type(value)
        return f"is {kind}, not a generator state (a uint8 tensor)"
    try:
        torch.Generator().set_state(value.detach().cpu())
    except RuntimeError as e:  # the wrong size, or bytes no generator would hold
        return f"not a generator state ({first_line(e)})"
    return ""
