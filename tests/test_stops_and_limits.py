"""A signal in the final sample, bounds on the sample length
and the weight decay, the process's memory limit, a rank that dies under DDP, the GPU
switches on a CPU, and sampling from a model whose logits overflow.

Each runs the real thing: real signals, a real RLIMIT_AS in a child process, a real killed
rank of two gloo processes.
"""

from __future__ import annotations

import errno
import json
import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_train import CHILD_ENV, make_cfg, make_raw
from typer.testing import CliRunner

import fbtrain.checkpoint.files as files_module
import fbtrain.sample
import fbtrain.train.setup as train_setup
from fbtrain.checkpoint import load_checkpoint
from fbtrain.cli import app
from fbtrain.cli_errors import exit_code_for
from fbtrain.config import ConfigError, limits, load_config
from fbtrain.config.schema import MAX_SAMPLE_LENGTH
from fbtrain.models.core import select
from fbtrain.train import TrainingError, run
from fbtrain.train.oom import OutOfMemory

SIGNALS = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGHUP: 129}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.fixture(autouse=True)
def _restore_signals() -> Iterator[None]:
    """A run stopped by a signal leaves the signals ignored until exit: not past a test."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


# ----------------------------------------------------------------------------- item 6


@pytest.mark.parametrize("sig", list(SIGNALS), ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_the_final_sample_exits_with_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    """The signal arrives (for real, raised in this process) while the last step's sample
    is being generated: the run saves, then stops with 143 / 130 / 129 and says so; it used
    to exit 0 and leave the step-0 sample as the last one shown."""
    real_generate = fbtrain.sample.generate
    calls: list[int] = []

    def generate_then_signal(*args: Any, **kwargs: Any) -> list[str]:
        calls.append(1)
        if len(calls) == 2:  # step 0's sample, then the final step's
            signal.raise_signal(sig)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(fbtrain.sample, "generate", generate_then_signal)
    cfg = make_cfg(tmp_path, train={"max_steps": 3, "sample_every": 3})
    with pytest.raises(TrainingError, match=rf"^interrupted at step 3 \({signal.Signals(sig).name}"
                       r"\), the last step, during its sample: training is complete \(that "
                       r"sample was not logged\); saved .*last\.pt$") as info:
        run(cfg, quiet=True)
    assert info.value.exit_code == SIGNALS[sig]
    assert len(calls) == 2
    assert load_checkpoint(tmp_path / "runs" / "run" / "checkpoints" / "last.pt")["step"] == 3


# ----------------------------------------------------------------------------- item 12


def test_sample_refuses_a_model_that_eval_refuses(tmp_path: Path) -> None:
    """Finite head weights 1e37 times too large: every logit is finite, but their spread
    passes float32's range, so a log-probability is -inf. eval refused the checkpoint
    (loss inf); sample drew the argmax every time and exited 0. Now both refuse, exit 2."""
    from test_evaluate import make_text
    from test_sample import tiny_model, write_run
    from typer.testing import CliRunner

    from fbtrain.cli import app

    text = tmp_path / "text.txt"
    text.write_text(make_text(200), encoding="utf-8")
    model = tiny_model()
    with torch.no_grad():
        model.head.weight.mul_(1e37)
    best = write_run(tmp_path / "huge", model, text_path=text)
    runner = CliRunner()
    scored = runner.invoke(app, ["eval", "-c", str(best.parent.parent), "--device", "cpu"])
    assert scored.exit_code == 2 and "cannot score it: the loss is inf" in scored.stderr
    sampled = runner.invoke(app, ["sample", "-c", str(best.parent.parent), "--device", "cpu",
                                  "--length", "10"])
    assert sampled.exit_code == 2, sampled.stdout
    assert sampled.stderr.splitlines()[-1] == (
        f"error: {best}: cannot sample from it: the model's predictions are NaN or inf "
        "(its weights are so large that the logits overflow)")


# ----------------------------------------------------------------------------- item 7


def test_sample_length_has_an_upper_bound() -> None:
    """100 million characters passed and the run sat silent for minutes after step 0."""
    assert load_config(None, [f"train.sample_length={MAX_SAMPLE_LENGTH}"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.sample_length=100000000"])
    assert info.value.problems == [
        f"<defaults> (with --set): train.sample_length = 100000000: must be <= "
        f"{MAX_SAMPLE_LENGTH}"]


def test_weight_decay_times_lr_must_stay_below_one() -> None:
    """weight_decay 1e9 passed, then the run ended 'loss is nan; try a lower train.lr'."""
    assert load_config(None, ["train.lr=2e-3", "train.weight_decay=499"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.weight_decay=1e9"])
    assert info.value.problems == [
        "<defaults> (with --set): train.lr = 0.002 and train.weight_decay = 1000000000.0: "
        "their product (2e+06) must be < 1 (AdamW multiplies the weights by 1 - lr x "
        "weight_decay each step); lower train.weight_decay (usually 0 to 0.1) or train.lr"]
    with pytest.raises(ConfigError, match=r"train\.lr = 10\.0 and train\.weight_decay = 0\.1"):
        load_config(None, ["train.lr=10"])


# ----------------------------------------------------------------------------- item 11


@pytest.mark.parametrize("value", ["garbage", "2", "step"])
def test_an_unknown_cuda_graphs_value_is_refused(tmp_path: Path, value: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to train without a word (garbage read as off)."""
    from typer.testing import CliRunner

    from fbtrain.cli import app

    monkeypatch.setenv("FBTRAIN_CUDA_GRAPHS", value)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(make_raw(tmp_path, train={"max_steps": 1})))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "-q"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: FBTRAIN_CUDA_GRAPHS={value!r} is not a setting; use one of 1, true, yes, "
        "on, 0, false, no, off (or leave it unset)"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("graphs", "core", "label"), [
    ("1", "python", "PyTorch core"), ("yes", "auto", None), ("0", "python", "PyTorch core")])
def test_the_start_line_names_the_core_and_an_idle_switch_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        graphs: str, core: str, label: str | None) -> None:
    """On a CPU, FBTRAIN_CUDA_GRAPHS=1 did nothing and said nothing; the device line did not
    say which core ran. (Now one line on stderr says why the step runs eagerly.)"""
    from fbtrain.models.core import native

    monkeypatch.setenv("FBTRAIN_CUDA_GRAPHS", graphs)
    monkeypatch.setenv("FBTRAIN_CORE", core)
    if label is None:  # auto: the C++ core where it builds
        label = "C++ core" if select.core() is native.NativeCore else "PyTorch core"
    run(make_cfg(tmp_path, train={"max_steps": 1}))
    out, err = capsys.readouterr()
    threads = torch.get_num_threads()
    assert f"device: cpu ({threads} thread{'s' if threads > 1 else ''}, fp32, {label})\n" in out
    idle = ("fbtrain: FBTRAIN_CUDA_GRAPHS is set, but the device is cpu, not CUDA; the step "
            "runs eagerly")
    assert (idle in err.splitlines()) == (graphs != "0")


# ----------------------------------------------------------------------------- item 8

ULIMIT_V = 6_000_000 * 1024  # `ulimit -v 6000000`, as the issue ran it


def train_under_rlimit_as(tmp_path: Path, batch_size: int) -> subprocess.CompletedProcess:
    """``fbtrain train`` of the tiny config at ``batch_size`` in a child process whose
    address space is limited to :data:`ULIMIT_V` (a real RLIMIT_AS, set before exec)."""
    raw = make_raw(tmp_path, train={"max_steps": 2, "batch_size": batch_size},
                   curriculum=[{"seq_len": 16}])
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(raw))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ULIMIT_V, ULIMIT_V))

    return subprocess.run([sys.executable, "-m", "fbtrain", "train", "--config", str(config)],
                          env=CHILD_ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux has it")
def test_the_memory_estimate_is_held_against_rlimit_as(tmp_path: Path) -> None:
    """A batch of 300,000 needs at least 6.3 GiB, less than the machine has but more than
    `ulimit -v 6000000` leaves: refused before anything is made (it was a traceback)."""
    proc = train_under_rlimit_as(tmp_path, 300_000)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.splitlines()
    assert re.fullmatch(
        r"error: .*cfg\.yaml: train\.batch_size = 300000: training needs at least [\d.]+ GiB "
        r"of memory \(activations of one micro-batch: [\d.]+ GiB\) but this process may use "
        r"[\d.]+ GiB \(its address-space limit, RLIMIT_AS / ulimit -v, less what it has "
        r"mapped already\); make it smaller", line), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux has it")
def test_running_out_of_memory_in_a_step_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A batch the (lower-bound) estimate lets through, whose step then fails to allocate
    under a real RLIMIT_AS: one line naming the batch and what fits, exit 2, no traceback.

    In this process (a child takes 20-40 s to get there on a busy machine): the config is
    checked first, then the soft limit set to 1 GiB past what is mapped, and put back."""
    cfg = make_cfg(tmp_path, train={"max_steps": 2, "batch_size": 200_000},
                   curriculum=[{"seq_len": 16}])  # checked here, against no limit yet
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limits.mapped_bytes() + 2**30, hard))
    try:
        with pytest.raises(OutOfMemory) as info:
            run(cfg, quiet=True)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert info.value.exit_code == 2 and info.value.__cause__ is None
    line = f"error: {info.value}"  # as the CLI prints every UserError
    assert re.fullmatch(
        r"error: step 1: out of memory training 200,000 sequences of 16 tokens "
        r"\(train\.batch_size = 200000\), but this process may use [\d.]+ [MG]iB \(its "
        r"address-space limit, RLIMIT_AS / ulimit -v, less what it has mapped already\): "
        r"lower train\.batch_size; by fbtrain's estimate, which counts only the least a step "
        r"keeps, at most [\d,]+ fit, and [\d,]+ leave room for the rest; train\.grad_accum "
        r"keeps the tokens per step", line), line


@pytest.mark.parametrize(("files", "proc", "expected"), [
    ({"memory.max": "max"}, "0::/\n", None),
    ({"job/memory.max": "1073741824", "memory.max": "max"}, "0::/job\n", 2**30),
    ({"memory/memory.limit_in_bytes": "9223372036854771712",
      "memory/job/memory.limit_in_bytes": "536870912"}, "4:memory:/job\n1:cpu:/\n", 2**29),
])
def test_the_cgroup_memory_limit_is_read_from_v1_and_v2(
        tmp_path: Path, files: dict[str, str], proc: str, expected: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    (tmp_path / "cgroup").write_text(proc)
    found = limits.cgroup_limit(tmp_path, tmp_path / "cgroup")
    assert (found.size if found else None) == expected


def _raised_over(inner: BaseException) -> SystemError:
    """The SystemError a C function raises over the error it met (as an import or torch's
    optimizer set-up did under a tight ulimit -v)."""
    try:
        raise inner
    except BaseException as e:
        outer = SystemError("<built-in function x> returned a result with an exception set")
        outer.__cause__ = e
        return outer


@pytest.mark.parametrize(("error", "failed"), [
    (MemoryError(), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"),
     True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("can't start new thread"), True),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), True),
    (_raised_over(MemoryError()), True),
    (RuntimeError("shapes do not match"), False),  # a bug: keeps its traceback
    (OSError(errno.ENOENT, "No such file"), False),
    (SystemError("returned NULL without setting an exception"), False),
    (_raised_over(ValueError("x")), False),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_what_an_allocation_that_failed_looks_like(error: BaseException, failed: bool) -> None:
    assert limits.is_allocation_failure(error) is failed
    assert (exit_code_for(error) == 2) is failed  # ENOENT without a path named: a bug


@pytest.mark.parametrize("error", [MemoryError(), _raised_over(MemoryError())],
                         ids=["MemoryError", "SystemError"])
def test_running_out_of_memory_in_the_set_up_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Building the optimizer (it imports torch._dynamo) under a tight ulimit -v: a
    SystemError or MemoryError traceback, as the one-line exit of a step covered steps
    only. Now the same one line, and a fresh start leaves no run directory behind."""
    def build_optimizer(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(train_setup, "build_optimizer", build_optimizer)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(make_raw(tmp_path, train={"max_steps": 2})))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--quiet"])
    assert result.exit_code == 2, result.output
    assert re.fullmatch(
        r"error: out of memory setting up the run \(data, model, optimizer\): this [^;]+; make "
        r"the model or the data smaller, or give the process more memory\n", result.stderr)
    assert not (tmp_path / "runs").exists()


def test_running_out_of_memory_anywhere_else_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation no command names (here a checkpoint's copy): one line naming the
    limit, exit 2, never a traceback."""
    def atomic_copy(src: Path, dst: Path) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 1048576 bytes.")

    monkeypatch.setattr(files_module, "atomic_copy", atomic_copy)
    monkeypatch.setattr(limits, "physical_memory", lambda: 2**34)
    monkeypatch.setattr(limits, "cgroup_limit", lambda: None)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(make_raw(tmp_path, train={"max_steps": 2})))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--quiet"])
    assert result.exit_code == 2, result.output
    limit = ("this machine has 16.0 GiB" if soft == resource.RLIM_INFINITY
             else "this process's address-space limit")
    assert result.stderr.startswith("error: out of memory (it asked for 1.0 MiB): " + limit)
    assert result.stderr.endswith("; give the process more memory, or ask for less\n")
    assert len(result.stderr.splitlines()) == 1


def test_an_evaluation_that_runs_out_of_memory_saves_the_step_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluation after step 2 runs out of memory (its windows are scored 64 at a time,
    more than a step may hold): one line naming the evaluation and train.eval_windows,
    exit 2, and step 2 saved and logged first; so does the resume's evaluation of step 2.
    The step used to be lost (its save comes after its evaluation), and the lines said
    nothing of the evaluation."""
    import fbtrain.train.evaluations as evaluations

    real_scores = evaluations.window_scores
    calls: list[int] = []

    def window_scores(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # step 0's, then step 2's
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 1048576 bytes.")
        return real_scores(*args, **kwargs)

    monkeypatch.setattr(evaluations, "window_scores", window_scores)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(make_raw(tmp_path, train={"max_steps": 6, "eval_every": 2},
                                              checkpoint={"every": 6})))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--quiet"])
    assert result.exit_code == 2, result.output
    last = tmp_path / "runs" / "run" / "checkpoints" / "last.pt"
    assert result.stderr.startswith("error: out of memory at step 2 evaluating 8 validation "
                                    "windows of ")
    fix = (f"step 2 is saved ({last}); lower train.eval_windows (the windows scored at "
           "once are at most 64) and resume with --resume auto\n")
    assert result.stderr.endswith(fix)
    assert len(result.stderr.splitlines()) == 1
    assert load_checkpoint(last)["step"] == 2
    logged = [json.loads(line) for line in (last.parent.parent / "metrics.jsonl").open()]
    assert logged[-1]["step"] == 2 and "loss" in logged[-1]
    # The resume evaluates step 2 first: out of memory again, the same line, nothing lost.
    calls.clear()
    calls.append(1)  # its first evaluation is the second call
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--quiet",
                                      "--resume", "auto"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: out of memory at step 2 evaluating ")
    assert result.stderr.endswith(fix) and load_checkpoint(last)["step"] == 2


def test_the_untrained_evaluation_that_runs_out_of_memory_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 0's evaluation, the first every run makes, out of memory: the line names the
    evaluation and train.eval_windows (it said only 'give the process more memory, or ask
    for less'), and that nothing was trained."""
    import fbtrain.train.evaluations as evaluations

    def window_scores(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 1048576 bytes.")

    monkeypatch.setattr(evaluations, "window_scores", window_scores)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(make_raw(tmp_path, train={"eval_windows": 100})))
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: out of memory at step 0 evaluating ")
    assert re.search(r"validation windows of 16 tokens, \d+ at a time \(train.eval_windows = 100\)",
                     result.stderr), result.stderr
    assert result.stderr.endswith("; nothing was trained yet; lower train.eval_windows (the "
                                  "windows scored at once are at most 64)\n")
    assert len(result.stderr.splitlines()) == 1


def test_a_sample_that_runs_out_of_memory_says_so_and_is_not_drawn_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Under ulimit -v the step-0 sample failed with a MemoryError, which says nothing of
    itself: "warning: sampling failed at step 0: " and no reason; every later sample then
    pressed on the limit again. Now the reason is out of memory, and no more samples are
    drawn: training comes first."""
    calls: list[int] = []

    def generate(*args: Any, **kwargs: Any) -> list[str]:
        calls.append(1)
        raise MemoryError

    monkeypatch.setattr(fbtrain.sample, "generate", generate)
    run(make_cfg(tmp_path, train={"max_steps": 6, "eval_every": 3}))
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "sampling failed" in line]
    assert re.fullmatch(r"warning: sampling failed at step 0: out of memory: this .+; no more "
                        r"samples are drawn in this run", line), line
    assert len(calls) == 1  # not at steps 3 and 6
    assert load_checkpoint(tmp_path / "runs" / "run" / "checkpoints" / "last.pt")["step"] == 6


# ----------------------------------------------------------------------------- item 9

# Rank 1 of two gloo ranks: trains as `fbtrain train` does, and kills itself (SIGKILL: no
# word, no cleanup) right after step argv[2]'s collectives, before that step's save.
DYING_RANK = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    from fbtrain.config import load_config
    from fbtrain.train import run
    die_at = int(sys.argv[2])

    def die(step):
        if step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    run(load_config(sys.argv[1], []), quiet=True, on_step=die)
""")


@pytest.mark.parametrize("die_at", [3, 4], ids=["during-training", "after-the-last-step"])
def test_a_killed_rank_gives_the_other_one_line_and_exit_1(tmp_path: Path, die_at: int) -> None:
    """Rank 1 dies (a real SIGKILL) at step 3 of 4 (a checkpoint at step 2) or after its
    last step, when rank 0 is about to print 'done': rank 0 (the real CLI) said gloo's
    'Connection reset by peer' in a traceback; now one line naming rank 1 and the last
    checkpoint, exit 1, and no hang."""
    raw = make_raw(tmp_path, train={"max_steps": 4, "eval_every": 100, "schedule": "constant"},
                   checkpoint={"every": 2})
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(raw))
    (tmp_path / "rank1.py").write_text(DYING_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**CHILD_ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    commands = [[sys.executable, "-m", "fbtrain", "train", "--config", str(config)],
                [sys.executable, str(tmp_path / "rank1.py"), str(config), str(die_at)]]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, command in enumerate(commands)]
    try:
        out, err = procs[0].communicate(timeout=400)  # (a C++ core build may be awaited)
        procs[1].wait(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 1, err[-3000:]
    last = tmp_path / "runs" / "run" / "checkpoints" / "last.pt"
    if die_at == 4:
        assert "done at step 4" in out
        line = (f"error: rank 1 of 2 stopped after training finished (its connection closed: "
                f"killed or crashed; see its own output), so rank 0 stops too; last "
                f"checkpoint: {last}")
    else:
        line = (f"error: rank 1 of 2 stopped during training (its connection closed: killed "
                f"or crashed; see its own output), so rank 0 stops too; last checkpoint: "
                f"{last}; resume with --resume auto")
    assert err.splitlines()[-1] == line, err[-3000:]
    assert "Traceback" not in err and "[rank0]" not in err
    assert load_checkpoint(last)["step"] == (4 if die_at == 4 else 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux has it")
def test_sample_length_is_held_against_rlimit_as_too(tmp_path: Path) -> None:
    """`fbtrain sample --length 1000000000` needs about 16 GiB: less than the machine, more
    than `ulimit -v 6000000` leaves; refused in one line naming the limit, exit 2."""
    from test_sample import tiny_model, write_run

    best = write_run(tmp_path / "run", tiny_model())

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ULIMIT_V, ULIMIT_V))

    proc = subprocess.run([sys.executable, "-m", "fbtrain", "sample", "-c", str(best),
                           "--length", "1000000000", "--device", "cpu"],
                          env=CHILD_ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.splitlines()
    assert re.fullmatch(
        r"error: num_samples = 1 x length = 1000000000: sampling needs about [\d.]+ GiB of "
        r"memory, more than the [\d.]+ GiB of this process's memory limit \(its address-space "
        r"limit, RLIMIT_AS / ulimit -v, less what it has mapped already\); lower num_samples "
        r"or length", line), line


def test_a_bug_in_the_logged_sample_keeps_its_traceback(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A sample may fail by design (a diverged model, memory running out: a warning, and
    training goes on); a bug inside it is no such thing and reaches the caller as itself,
    not as "warning: sampling failed" and exit 0."""

    def broken(*args: object, **kwargs: object) -> list[str]:
        raise ValueError("a bug in generate")

    monkeypatch.setattr(fbtrain.sample, "generate", broken)
    cfg = make_cfg(tmp_path, train={"max_steps": 2, "eval_every": 2})
    with pytest.raises(ValueError, match="a bug in generate"):
        run(cfg, quiet=True)
