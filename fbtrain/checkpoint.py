"""Checkpoints: atomic save, safe load, latest/best lookup, keep-last-N, RNG capture.

A checkpoint is one ``torch.save`` file holding a plain dict (model, optimizer, scheduler,
step, config, vocabulary, RNG states, ...) plus a ``format`` marker. It is always loaded with
``weights_only=True``, so opening a checkpoint can never run code; everything put into one
must therefore be tensors, numbers, strings, bytes, None and lists/tuples/dicts of those.

A run directory keeps its checkpoints in ``<run>/checkpoints/``::

    last.pt               the newest state (what ``--resume`` picks up)
    best.pt               the state with the best validation loss so far
    step-00001000.pt      numbered snapshots; only the newest ``keep_last`` are kept
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from fbtrain.io import atomic_write

FORMAT = "fbtrain-checkpoint-v1"
CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"
BEST = "best.pt"
_NUMBERED = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(Exception):
    """A checkpoint cannot be found or read; the message is one user-facing line."""


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus the format marker) to ``path`` atomically.

    The file appears complete or not at all: ``torch.save`` goes to a temp file in the same
    folder, which is fsynced and then renamed over ``path``. The caller's dict is not changed.
    """
    data = {**payload, "format": FORMAT}
    atomic_write(Path(path), lambda f: torch.save(data, f))


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only``: runs no code).

    Every failure (missing, truncated, corrupt, not a torch file, not an fbtrain checkpoint,
    holding objects that would need code to rebuild) is a :class:`CheckpointError` that names
    the path and the problem, never a traceback.
    """
    path = Path(path)
    # Open it ourselves first: errors from here on are about the file's contents (torch's
    # reader even raises OSError for some truncated archives), errors here about access.
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file not found") from None
    except IsADirectoryError:
        raise CheckpointError(
            f"{path}: is a directory, not a checkpoint file (pass a checkpoint file, "
            "or resolve a run directory with resolve_checkpoint)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from None
    if not head:
        raise CheckpointError(f"{path}: checkpoint file is empty (was the save interrupted?)")
    try:
        with warnings.catch_warnings():
            # Harmless notice for pickles written with a newer protocol; not for users.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for bad files; all mean "unreadable".
        raise CheckpointError(f"{path}: {_why_unreadable(path, head, e)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path}: not an fbtrain checkpoint (holds a {type(data).__name__}, not a dict)"
        )
    if "format" not in data:
        raise CheckpointError(f"{path}: not an fbtrain checkpoint (no 'format' key)")
    if data["format"] != FORMAT:
        raise CheckpointError(
            f"{path}: unsupported checkpoint format {data['format']!r} "
            f"(this version of fbtrain reads {FORMAT!r})"
        )
    return data


def _why_unreadable(path: Path, head: bytes, error: Exception) -> str:
    """Turn whatever torch.load raised into a short explanation, judged from the file's bytes."""
    if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
        if not zipfile.is_zipfile(path):
            return "not a PyTorch checkpoint file (a plain pickle or some other format)"
        # torch names what it refused: a class ("Unsupported global: GLOBAL pkg.Class was
        # not an allowed global"), a function a __reduce__ payload would call ("unsupported
        # GLOBAL posix.system whose module posix is blocked", "call reduce for unrecognized
        # function ..."). Both are the same danger and get the same words; any other
        # complaint (an unknown opcode) means damaged bytes.
        found = re.search(r"GLOBAL ([\w.]+)|reduce for unrecognized function (\S+)",
                          str(error))
        if found:
            return (
                f"refusing to load: it holds a {found.group(1) or found.group(2)} object, "
                "and unpickling anything but tensors and plain containers could run code"
            )
        detail = re.search(r"Unsupported \w+ [^\n]*", str(error))
        return "checkpoint file is corrupt (unreadable pickle data" + (
            f": {detail.group(0)[:80]})" if detail else ")"
        )
    # torch.save writes a zip archive; a zip header without a readable archive is a file
    # cut short (or damaged), anything else is some other kind of file.
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return "checkpoint file is truncated or corrupt (incomplete zip archive)"
        text = str(error).strip()
        # torch's reader appends paragraphs of advice; its first sentence is the diagnosis.
        first = text.splitlines()[0].split(". ")[0] if text else type(error).__name__
        return f"checkpoint file is truncated or corrupt ({first[:100]})"
    return "not a PyTorch checkpoint file (unrecognized format, truncated or corrupt)"


# ----------------------------------------------------------------------------- lookup


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """Find the checkpoint file meant by ``path``.

    - a file: returned as is;
    - a run directory ``runs/<name>/`` or its ``checkpoints/`` folder: ``best.pt`` when
      ``prefer == "best"`` and it exists, else ``last.pt``.

    Raises :class:`CheckpointError` listing what was looked for when nothing is there.
    """
    if prefer not in ("best", "last"):
        raise ValueError(f"prefer must be 'best' or 'last', got {prefer!r}")
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or run directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint file or run directory")
    folder = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path
    names = [BEST, LAST] if prefer == "best" else [LAST]
    candidates = [folder / name for name in names]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise CheckpointError(f"{path}: no checkpoint found (looked for {looked})")


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Writes ``last.pt``, ``best.pt`` and numbered snapshots of one run; purges old ones.

    Only one process (rank 0) should save into a run directory at a time.
    """

    def __init__(self, run_dir: Path, keep_last: int):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINT_DIR
        self.keep_last = keep_last

    @property
    def last_path(self) -> Path:
        return self.dir / LAST

    @property
    def best_path(self) -> Path:
        return self.dir / BEST

    def step_path(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}.pt"

    def numbered(self) -> list[Path]:
        """Numbered snapshots present on disk, oldest step first."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _NUMBERED.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def save(
        self, step: int, payload: dict[str, Any], *, numbered: bool = True, best: bool = False
    ) -> Path:
        """Save ``payload`` as ``last.pt`` and, as asked, ``step-N.pt`` and ``best.pt``.

        Serializes once, then copies: each copy goes through its own temp file and rename,
        so every file is complete at every instant. ``last.pt`` is written first, so after a
        crash part-way it is never older than a numbered snapshot. Returns the path of the
        numbered file when one was written, else ``last.pt``.
        """
        save_checkpoint(self.last_path, payload)
        written = self.last_path
        if numbered:
            written = self.step_path(step)
            _atomic_copy(self.last_path, written)
        if best:
            _atomic_copy(self.last_path, self.best_path)
        self.purge(keep=written)
        return written

    def purge(self, keep: Path | None = None) -> list[Path]:
        """Delete numbered snapshots beyond the newest ``keep_last`` (by step number).

        ``last.pt`` and ``best.pt`` are never touched, nor ``keep`` (the file just written:
        after resuming from an older snapshot, stale higher-numbered files from the abandoned
        run must not push out the new one). Returns the deleted paths.
        """
        files = self.numbered()
        doomed = files[: max(0, len(files) - self.keep_last)]
        removed = []
        for p in doomed:
            if keep is not None and p == keep:
                continue
            p.unlink(missing_ok=True)
            removed.append(p)
        return removed


def _atomic_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as source:
        atomic_write(dst, lambda f: shutil.copyfileobj(source, f, 1 << 20))


# ----------------------------------------------------------------------------- RNG


def capture_rng(sampler_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Snapshot every random number generator, in a form ``weights_only`` loading accepts.

    Holds Python's ``random``, torch's CPU generator, every CUDA device's generator (when CUDA
    is available) and ``sampler_state`` as given (the data sampler's own state;
    :func:`restore_rng` leaves it to the caller).
    """
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
    if sampler_state is not None:
        state["sampler"] = sampler_state
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the generators saved by :func:`capture_rng` (those present in ``state``).

    CUDA states are restored only when CUDA is available now; a checkpoint made on a GPU can
    be resumed on a CPU (and vice versa) with the CPU streams still exact. ``state["sampler"]``
    is the caller's to restore.
    """
    if "python" in state:
        py = state["python"]
        internal = py["internal"]
        internal = tuple(internal.tolist() if torch.is_tensor(internal) else internal)
        random.setstate((py["version"], internal, py["gauss_next"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [s.cpu() for s in state["cuda"]]
        # Resuming on fewer GPUs than were saved: restore the devices that exist.
        for device, s in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


# ----------------------------------------------------------------------------- model


_MODEL_KEYS = ("model", "model_config", "vocab")
# Prefixes torch.compile (``_orig_mod.``) and DistributedDataParallel (``module.``) put on
# parameter names; a state dict saved from a wrapped model still belongs to the bare one.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def load_model(
    path: str | Path, device: torch.device | str = "cpu", prefer: str = "best"
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """Rebuild the model a checkpoint describes: ``(model, tokenizer, payload)``.

    ``path`` is a checkpoint file or a run directory (``best.pt`` preferred, see
    :func:`resolve_checkpoint`). The model is built from ``payload["model_config"]`` and
    ``len(payload["vocab"])``, given the saved weights, put in eval mode and moved to
    ``device``; the tokenizer is the saved vocabulary's (``payload["tokenizer"]``: char, the
    default, or word). Anything missing or not matching (keys, shapes, config fields) is a one-line
    :class:`CheckpointError`.
    """
    # Imported here: models and data import config, and checkpoint.py stays free of both
    # for the code (trainer, tests) that only needs saving and RNG capture.
    from fbtrain.config import ModelConfig
    from fbtrain.data.errors import DataError
    from fbtrain.data.tokenizers import make_tokenizer
    from fbtrain.models import build_model

    file = resolve_checkpoint(path, prefer=prefer)
    payload = load_checkpoint(file)
    missing = [k for k in _MODEL_KEYS if k not in payload]
    if missing:
        raise CheckpointError(
            f"{file}: not a model checkpoint (missing {', '.join(repr(k) for k in missing)})"
        )
    raw_cfg, vocab, state = payload["model_config"], payload["vocab"], payload["model"]
    if not isinstance(raw_cfg, dict):
        raise CheckpointError(f"{file}: 'model_config' must be a dict of ModelConfig fields")
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: 'model' must be a state dict of tensors")
    try:
        tokenizer = make_tokenizer(vocab, payload.get("tokenizer"))
    except (DataError, TypeError) as e:
        raise CheckpointError(f"{file}: bad 'vocab': {e}") from None
    try:
        cfg = ModelConfig(**raw_cfg)
        model = build_model(cfg, tokenizer.vocab_size)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: bad 'model_config': {e}") from None
    state = strip_wrapper_prefixes(state)
    problem = _state_dict_mismatch(model.state_dict(), state)
    if problem:
        raise CheckpointError(f"{file}: weights do not fit model_config ({cfg.kind}): {problem}")
    model.load_state_dict(state)
    model.eval()
    return model.to(device), tokenizer, payload


def strip_wrapper_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Drop the ``module.`` (DDP) / ``_orig_mod.`` (torch.compile) prefix on every name."""
    for prefix in _WRAPPER_PREFIXES:
        if state and all(isinstance(k, str) and k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _state_dict_mismatch(expected: dict[str, torch.Tensor], got: dict[str, Any]) -> str:
    """One line naming missing/unexpected keys and wrong shapes ('' when all fit).

    Checked here rather than left to ``load_state_dict``, whose error runs to many lines.
    """

    def names(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    wrong = [
        f"{k} {tuple(got[k].shape) if torch.is_tensor(got[k]) else type(got[k]).__name__}"
        f" (expected {tuple(v.shape)})"
        for k, v in expected.items()
        if k in got and (not torch.is_tensor(got[k]) or got[k].shape != v.shape)
    ]
    parts = []
    if missing:
        parts.append(f"missing {names(missing)}")
    if unexpected:
        parts.append(f"unexpected {names(unexpected)}")
    if wrong:
        parts.append(f"wrong shape {names(wrong)}")
    return "; ".join(parts)
