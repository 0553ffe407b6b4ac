"""An exported model: a folder of weights to share, in the formats the ecosystem uses.

``fbtrain export`` writes::

    model.safetensors   the weights only (no optimizer state), safetensors format
    config.json         the model config (fbtrain.config.ModelConfig's fields)
    vocab.json          the vocabulary, as in a run directory

The safetensors header's metadata also holds where the weights came from
(``fbtrain.step``), the run's training config (``fbtrain.config``, JSON) and the sha256 of
the splits it trained on (``fbtrain.data``, JSON), so that ``fbtrain eval`` finds the data
and the sequence length, and checks the data, as it does for a run. This module
reads and writes the folder; :func:`fbtrain.checkpoint.contents.load_model` checks what it
read, as for a checkpoint.

The three files are one set. An export writes all three to temp files first (a full disk
or a kill leaves the folder's previous export as it was), then moves them into place, the
weights first; the weights' metadata records the sha256 of the config and vocabulary
written with them (``fbtrain.files``). So a failure between the moves (a file that cannot
be replaced) or files mixed by hand leave a set that :func:`read_export` refuses, never one
that loads wrong. (A temp folder renamed into place would replace the folder itself: its
other files, its permissions, and a folder that is a mount point or ``.``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fbtrain.checkpoint.files import CHECKPOINT_DIR, CheckpointError
from fbtrain.data.errors import DataError
from fbtrain.data.tokenizers import VOCAB_FILE, Tokenizer
from fbtrain.io import fsync_dir, remove_stale_temps, write_error, write_temp

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows has no flock
    fcntl = None  # type: ignore[assignment]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_FILES = (WEIGHTS_FILE, CONFIG_FILE, VOCAB_FILE)  # the order they are moved into place
FILES_KEY = "fbtrain.files"  # weights metadata: {file: sha256} of the other two


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is an exported model's folder: it holds ``model.safetensors``, or
    ``config.json`` (an export that lost its weights, which :func:`read_export` then
    refuses by name, rather than "no checkpoint found"); and no ``checkpoints/``: a run
    directory is read as one, whatever else it holds (an export copied into it)."""
    path = Path(path)
    return ((path / WEIGHTS_FILE).is_file() or (path / CONFIG_FILE).is_file()) \
        and not (path / CHECKPOINT_DIR).exists()


def export_folder(path: str | Path) -> Path | None:
    """The exported model's folder ``path`` names: the folder itself or one of its files
    (``exports/ts/model.safetensors``, its ``config.json`` or ``vocab.json``); None when it
    names no export."""
    path = Path(path)
    if path.name in EXPORT_FILES and path.is_file() and is_export(path.parent):
        return path.parent
    return path if is_export(path) else None


def write_export(out: Path, state: dict[str, torch.Tensor], model_config: dict[str, Any],
                 tokenizer: Tokenizer, *, step: Any = None,
                 config: dict[str, Any] | None = None, data: Any = None) -> list[Path]:
    """Write the three files into ``out`` (created if needed) as one set (see the module's
    docstring), removing temp files a killed export left there first.

    Returns the files written. ``out`` must be a folder (or not exist yet)."""
    from safetensors.torch import save

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder; give a folder to export into")
    if (out / CHECKPOINT_DIR).is_dir():
        # sample/eval would then read the export, not the run's checkpoints, from that folder
        raise CheckpointError(f"{out}: is a run directory (it has {CHECKPOINT_DIR}/); export "
                              "into a folder of its own")
    config_bytes = (json.dumps(model_config, indent=2) + "\n").encode("utf-8")
    vocab_bytes = tokenizer.to_json().encode("utf-8")
    # contiguous() and clone(): safetensors refuses views and tensors sharing memory.
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
    metadata = {"format": "pt", "fbtrain.step": json.dumps(step),
                "fbtrain.config": json.dumps(config or {}),
                "fbtrain.data": json.dumps(data),
                FILES_KEY: json.dumps({CONFIG_FILE: _sha256(config_bytes),
                                       VOCAB_FILE: _sha256(vocab_bytes)})}
    contents = {WEIGHTS_FILE: save(tensors, metadata), CONFIG_FILE: config_bytes,
                VOCAB_FILE: vocab_bytes}
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) or e from None
    with _sole_writer(out):
        remove_stale_temps(out, EXPORT_FILES)  # a killed export's: ours is the only one
        temps: dict[str, Path] = {}
        try:
            for name in EXPORT_FILES:
                temps[name] = write_temp(out / name, lambda f, d=contents[name]: f.write(d))
            for moved, name in enumerate(EXPORT_FILES):
                try:
                    os.replace(temps[name], out / name)
                except OSError as e:
                    raise _not_replaced(out, moved, e) from None
                del temps[name]
        finally:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)
        fsync_dir(out)
    return [out / name for name in EXPORT_FILES]


def _not_replaced(out: Path, moved: int, error: OSError) -> CheckpointError:
    """The line for a file that could not be moved into place after ``moved`` others were."""
    name = EXPORT_FILES[moved]
    why = (error.strerror or str(error)).lower()
    if moved == 0:
        return CheckpointError(f"{out / name}: cannot replace it ({why}); the export in {out} "
                               "is as it was")
    return CheckpointError(
        f"{out / name}: cannot replace it ({why}); {out} now holds the new "
        f"{' and '.join(EXPORT_FILES[:moved])} beside an older {name}, a set that sample and "
        f"eval refuse: export again once {name} can be written")


@contextlib.contextmanager
def _sole_writer(out: Path) -> Iterator[None]:
    """One export at a time into ``out``: an flock on the folder itself (no lock file
    among the files to share), so temp files found while holding it are a killed
    export's. Where the file system has no flock the export goes ahead unlocked."""
    if fcntl is None:
        yield
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{out}: another fbtrain export is writing into it; wait for "
                                  "it to finish") from None
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # drops the flock


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_export(folder: str | Path) -> dict[str, Any]:
    """An exported folder as a checkpoint-shaped dict (``model``, ``model_config``,
    ``vocab``, ``tokenizer``, ``config``, ``step``, ``data``): what ``load_model`` checks and uses.

    Every problem is a one-line :class:`CheckpointError` naming the file."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    weights, config_file = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    for name in EXPORT_FILES:
        if not (folder / name).is_file():
            others = " and ".join(n for n in EXPORT_FILES if n != name)
            raise CheckpointError(f"{folder}: an exported model needs {name} beside {others} "
                                  "(fbtrain export writes all three; did one fail part-way?)")
    try:
        with safe_open(str(weights), framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    try:
        model_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: not readable JSON ({e})") from None
    try:
        step = json.loads(metadata.get("fbtrain.step", "null"))
        config = json.loads(metadata.get("fbtrain.config", "{}"))
        data = json.loads(metadata.get("fbtrain.data", "null"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{weights}: bad fbtrain metadata ({e})") from None
    _check_set(folder, metadata)
    try:
        tokenizer = Tokenizer.load(folder)
    except DataError as e:
        raise CheckpointError(str(e)) from None
    return {"model": state, "model_config": model_config, "vocab": list(tokenizer.tokens),
            "tokenizer": tokenizer.kind, "config": config, "step": step, "data": data}


def _check_set(folder: Path, metadata: dict[str, str]) -> None:
    """Refuse a config or vocabulary other than the one exported with the weights (their
    sha256 in the weights' metadata; an export older than that record is taken as is)."""
    if FILES_KEY not in metadata:
        return
    try:
        recorded = json.loads(metadata[FILES_KEY])
        others = [name for name in (CONFIG_FILE, VOCAB_FILE)
                  if recorded[name] != _sha256((folder / name).read_bytes())]
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise CheckpointError(f"{folder / WEIGHTS_FILE}: bad fbtrain metadata ({FILES_KEY}: "
                              f"{e})") from None
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot read {e.filename}: {e.strerror}") from None
    if others:
        which = " and ".join(others) + (" is not the one" if len(others) == 1
                                         else " are not the ones")
        raise CheckpointError(
            f"{folder}: {which} exported with {WEIGHTS_FILE} (an export that failed part-way, "
            "or files mixed by hand); export into it again")
