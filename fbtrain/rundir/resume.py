"""What a run directory holds, and where a run starts there.

What the directory holds decides how a run may start there (:func:`choose_resume`): one
that holds a run's checkpoints or metrics is never a fresh start, and ``--resume auto``
continues from the newest checkpoint that loads, saying so when that is not ``last.pt``.
A checkpoint of another run copied into ``checkpoints/`` (another ``run_id``, see
:mod:`fbtrain.rundir.history`) or a ``step-N.pt`` that holds another step is refused, naming
the file, before anything is moved or written. Called as the directory's owner
(:mod:`fbtrain.rundir.lock`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fbtrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    resolve_checkpoint,
)
from fbtrain.checkpoint.export import export_folder
from fbtrain.checkpoint.files import peek_checkpoint
from fbtrain.checkpoint.state import read_checkpoint, resumable_problem
from fbtrain.config import ConfigError
from fbtrain.messages import is_int
from fbtrain.metrics.tensorboard import event_files
from fbtrain.rundir.history import new_run_id, recorded_run_id
from fbtrain.rundir_names import (
    ABANDONED,
    BEST,
    CHECKPOINT_DIR,
    HISTORY,
    LAST,
    METRICS,
    numbered_step,
)

_LISTED = 3  # checkpoints named in a refusal; more are counted
_REPLACING = "replacing the metrics and TensorBoard events of an earlier start that saved none"


# ----------------------------------------------------------------------------- what it holds


@dataclass(frozen=True)
class RunContents:
    """What a run directory holds of a run that trained there."""

    checkpoints: list[Path]  # CheckpointManager.entries(): readable or not, newest first
    metrics: Path | None  # metrics.jsonl, when it holds anything
    events: list[Path]  # TensorBoard event files

    @property
    def trained(self) -> bool:
        """Whether a run left its results here: a checkpoint (readable or not) or logged
        metrics. TensorBoard events alone are not: every figure goes to metrics.jsonl too,
        so events beside no metrics hold only what a writer puts there when it opens (the
        header, the chart layout) - a run that failed before its first figure."""
        return bool(self.checkpoints or self.metrics)

    def describe(self, run_dir: Path) -> str:
        """'checkpoints/best.pt, checkpoints/step-00000020.pt, metrics.jsonl and 3
        TensorBoard event files', say."""
        names = [str(p.relative_to(run_dir)) for p in self.checkpoints[:_LISTED]]
        if len(self.checkpoints) > _LISTED:
            names.append(f"{len(self.checkpoints) - _LISTED} more checkpoints")
        if self.metrics is not None:
            names.append(self.metrics.name)
        if self.events:
            names.append(f"{len(self.events)} TensorBoard event file"
                         f"{'s' if len(self.events) > 1 else ''}")
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def survey(manager: CheckpointManager) -> RunContents:
    """What ``manager``'s run directory holds. Refuses (ConfigError) a ``checkpoints``
    that is not a folder: every save would fail there, so say it before training."""
    folder = manager.dir
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise ConfigError([
            f"run directory {manager.run_dir}: {folder} is not a folder, so no checkpoint "
            "could be saved there; move it away (or train under another run.name, "
            "--set run.name=NEW)"])
    metrics = manager.run_dir / METRICS
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    return RunContents(checkpoints=manager.entries(), metrics=metrics if has_metrics else None,
                       events=event_files(manager.run_dir))


@dataclass(frozen=True)
class ResumeChoice:
    """Where a run starts: ``path`` and its loaded ``payload`` (None, None: afresh), and
    ``note``, a line to print when the choice is not the obvious one."""

    path: Path | None = None
    payload: dict[str, Any] | None = None
    note: str | None = None
    run_id: str = ""  # the run's id from here on (the directory's, or a new run's)
    new_run: bool = True  # the directory held no checkpoint: its history starts anew


def choose_resume(resume: str | None, manager: CheckpointManager) -> ResumeChoice:
    """The checkpoint to continue from, loaded, decided from what the directory holds.

    ``resume``: None starts afresh, refused when the directory already holds a run
    (:attr:`RunContents.trained`), naming what it holds; ``"auto"`` continues from the
    newest checkpoint that loads and passes the resume checks (``last.pt``, else the
    highest step among ``step-N.pt`` and ``best.pt``; refused when none does), and starts
    afresh only where no checkpoint was ever saved; anything else is a checkpoint file or
    run directory, refused when it belongs to another run and this directory holds
    checkpoints of its own. Call as the directory's owner.
    """
    if resume is not None and not resume.strip():  # an unset shell variable: not "."
        raise ConfigError([f"--resume {resume!r}: empty; give auto, a run directory or a "
                           "checkpoint file (or leave --resume out to start afresh)"])
    run_dir = manager.run_dir
    held = survey(manager)
    if resume is None:
        if held.trained:
            raise ConfigError([
                f"run directory {run_dir} already holds a run ({held.describe(run_dir)}); "
                "continue it with --resume auto, or start anew under another run.name "
                "(--set run.name=NEW) or after deleting that folder"])
        return ResumeChoice(run_id=new_run_id())
    recorded = recorded_run_id(run_dir) or _only_run_id(run_dir, held.checkpoints)
    if resume == "auto":
        if not held.checkpoints:
            if held.metrics is None:
                return ResumeChoice(run_id=new_run_id())
            return ResumeChoice(note=f"no checkpoint in {run_dir} to resume from: starting "
                                f"afresh ({_REPLACING})", run_id=new_run_id())
        return _newest_loadable(manager, held.checkpoints, recorded)
    if export_folder(resume) is not None:
        raise CheckpointError(
            f"--resume {resume}: an exported model holds the weights alone (no optimizer "
            "state, step or random streams), which a resume needs; to train on from its "
            f"weights, start a run with --set train.init_from={resume}")
    path = resolve_checkpoint(resume, prefer="last")
    # checkpoints/ may be a link to a folder elsewhere (a bigger disk): inside that is ours.
    inside = any(path.resolve().is_relative_to(folder.resolve())
                 for folder in (run_dir, manager.dir))
    if held.checkpoints and not inside:
        # Resuming writes last.pt, best.pt and metrics.jsonl here: another run's would
        # be overwritten. (A checkpoint of this run itself, say step-N.pt, is fine.)
        raise ConfigError([
            f"--resume {path} belongs to another run, but run directory {run_dir} "
            f"already holds its own checkpoints ({held.checkpoints[0].name}, ...); resume "
            f"into another run.name (--set run.name=NEW), or use --resume auto to continue "
            f"{run_dir.name}"
        ])
    _refuse_a_set_aside_branch(manager, path)
    payload = read_checkpoint(path)
    if not held.checkpoints:
        if recorded is not None and _run_id_of(payload) == recorded:  # its own, moved out
            return ResumeChoice(path, payload, run_id=recorded, new_run=False)
        # a new run that goes on from another's weights
        note = None if held.metrics is None else \
            f"{run_dir} holds no checkpoint: a new run from {path} ({_REPLACING})"
        return ResumeChoice(path, payload, note=note, run_id=new_run_id())
    ours = recorded or _run_id_of(payload) or new_run_id()
    _refuse_if_alien(manager, path, payload, ours)
    _check_entries(manager, held.checkpoints, ours, {path.name: payload})
    return ResumeChoice(path, payload, run_id=ours, new_run=False)


def _refuse_a_set_aside_branch(manager: CheckpointManager, path: Path) -> None:
    """Refuse a checkpoint in a folder where a rewind set a branch aside
    (``checkpoints/abandoned-from-step-N/``): the files in ``checkpoints/`` and
    ``metrics.jsonl`` are then the branch that replaced it, whose steps a resume here would
    mix with its own."""
    folder = path.resolve().parent
    if folder.parent == manager.dir.resolve() and folder.name.startswith(ABANDONED):
        raise ConfigError([
            f"--resume {path} is in {folder.name}/, a branch set aside by an earlier rewind; "
            f"{manager.dir} and {manager.run_dir / METRICS} now hold the branch that "
            "replaced it, which a resume here would mix with its steps; resume it into "
            f"another run.name (--set run.name=NEW --resume {path})"])


def identity_problem(path: Path, payload: dict[str, Any], run_id: str | None) -> str:
    """'' when the checkpoint ``payload`` read from ``path`` may be resumed in a run whose
    id is ``run_id``, else why not: it holds another step than its ``step-N.pt`` name says
    (a file's name is not its step), or it was saved by another run. A checkpoint saved
    before checkpoints carried a run id passes (it cannot be told)."""
    theirs = _run_id_of(payload)
    if theirs and run_id and theirs != run_id:
        return (f"{path} belongs to another run (run id {theirs}; this run's, in its "
                f"history.jsonl and checkpoints, is {run_id})")
    named, step = numbered_step(path.name), payload.get("step")
    if named is not None and is_int(step) and step != named:
        return (f"{path} holds the state of step {step}, not of step {named} as its name "
                "says")
    return ""


def _refuse_if_alien(manager: CheckpointManager, path: Path, payload: dict[str, Any],
                     run_id: str | None) -> None:
    problem = identity_problem(path, payload, run_id)
    if problem:
        raise CheckpointError(
            f"{problem}; move it out of {manager.dir} (or rename it), then resume again. "
            "Nothing was moved or written")


def _check_entries(manager: CheckpointManager, entries: list[Path], run_id: str | None,
                   loaded: dict[str, dict[str, Any]]) -> None:
    """:func:`identity_problem` of every checkpoint in ``entries`` that can be read (those
    in ``loaded`` already were; the others are read memory-mapped): a resume may move
    any of them aside (a rewind) or delete it (keep_last), so none may be another run's
    or carry a name that lies about its step."""
    for path in entries:
        payload = loaded.get(path.name)
        if payload is None:
            payload = peek_checkpoint(path) if path.is_file() else None
        if payload is not None:
            _refuse_if_alien(manager, path, payload, run_id)


def _only_run_id(run_dir: Path, entries: list[Path]) -> str | None:
    """The run id the checkpoints in ``entries`` carry, for a run directory whose
    history.jsonl (which names it) is missing; None when none carries one. Checkpoints of
    two runs are refused: without the history nothing tells which is this run's."""
    found: dict[str, list[str]] = {}
    for path in entries:
        payload = peek_checkpoint(path) if path.is_file() else None
        theirs = _run_id_of(payload) if payload is not None else None
        if theirs:
            found.setdefault(theirs, []).append(path.name)
    if len(found) > 1:
        runs = "; ".join(f"run id {k}: {', '.join(v)}" for k, v in found.items())
        raise CheckpointError(
            f"{run_dir / CHECKPOINT_DIR} holds checkpoints of {len(found)} runs ({runs}) and "
            f"{run_dir / HISTORY}, which names this run's, is missing; move the other runs' "
            "files out, then resume again. Nothing was moved or written")
    return next(iter(found), None)


def _run_id_of(payload: dict[str, Any]) -> str | None:
    theirs = payload.get("run_id")
    return theirs if isinstance(theirs, str) and theirs else None


def _newest_loadable(manager: CheckpointManager, entries: list[Path], recorded: str | None
                     ) -> ResumeChoice:
    """The checkpoint of the highest step among ``entries`` (newest first by name) that
    loads and passes the resume checks. ``best.pt`` only says its step once loaded, so it
    is loaded first when ``last.pt`` fails, and wins over every step-N.pt below it. A
    checkpoint that loads but is another run's, or holds another step than its name says,
    is refused (:func:`identity_problem`), as is every other one in the folder; the run's
    id is ``recorded`` (its history's, or the one its checkpoints carry), else the first
    loaded checkpoint's."""
    run_dir = manager.run_dir
    problems: list[str] = []
    loaded: dict[str, dict[str, Any]] = {}
    expected = recorded

    def load(path: Path) -> dict[str, Any] | None:
        nonlocal expected
        try:
            payload = read_checkpoint(path)
            problem = resumable_problem(payload)
            if problem:
                raise CheckpointError(f"{path}: cannot resume from it: {problem}")
        except CheckpointError as e:
            problems.append(str(e))
            return None
        expected = expected or _run_id_of(payload)
        _refuse_if_alien(manager, path, payload, expected)
        loaded[path.name] = payload
        return payload

    by_name = {p.name: p for p in entries}
    last = run_dir / CHECKPOINT_DIR / LAST
    chosen = None
    if LAST not in by_name:
        problems.append(f"{last} is missing")
    elif (payload := load(last)) is not None:
        chosen = (last, payload)  # the usual case: nothing to say
    if chosen is None:
        best = by_name.get(BEST)
        best_payload = load(best) if best is not None else None
        for path in (p for p in entries if p.name not in (LAST, BEST)):  # highest step first
            if best_payload is not None and best_payload["step"] > _step_of(path):
                break
            if (payload := load(path)) is not None:
                chosen = (path, payload)
                break
        if chosen is None and best is not None and best_payload is not None:
            chosen = (best, best_payload)
    if chosen is None:
        afresh = "to start afresh, train under another run.name (--set run.name=NEW) or delete"
        if len(entries) == 1:
            raise CheckpointError(f"{problems[-1]}; {afresh} {run_dir}")
        raise CheckpointError(
            f"run directory {run_dir} holds checkpoints, but none can be resumed from "
            f"({'; '.join(problems)}); {afresh} that folder")
    path, payload = chosen
    expected = expected or new_run_id()
    _check_entries(manager, entries, expected, loaded)
    note = None if path == last else (
        f"resuming from {path.name} (step {payload['step']}), the newest checkpoint that "
        f"loads: {'; '.join(problems)}")
    return ResumeChoice(path, payload, note=note, run_id=expected, new_run=False)


def _step_of(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])
