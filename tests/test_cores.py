"""Which core runs: FBTRAIN_CORE, the fallback to the PyTorch core and its notice, ninja
from PyPI. (The cores' numbers are checked against the reference in test_models.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fbtrain.config import ModelConfig
from fbtrain.errors import UserError
from fbtrain.models import build_model
from fbtrain.models.core import graphs, native, python, select
from fbtrain.models.core.autograd import flatten_layers
from fbtrain.models.core.spec import CoreInputs, CoreSpec

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "Running on the PyTorch core instead"


@pytest.fixture
def fresh_resolution() -> Iterator[None]:
    """Forget which core each FBTRAIN_CORE value resolved to, before and after the test."""
    select._resolve.cache_clear()
    yield
    select._resolve.cache_clear()


@pytest.fixture
def broken_build(monkeypatch, fresh_resolution) -> native.CoreBuildError:
    """native_ops fails as it does without a compiler."""
    error = native.CoreBuildError(
        "could not build fbtrain's C++ core (x.cpp); it needs a C++ compiler (g++) on PATH: "
        "'c++' not found (set CXX to name another compiler)")

    def fail():
        raise error

    monkeypatch.setattr(native, "native_ops", fail)
    return error


@pytest.mark.parametrize("value", ["", "auto", "native", "python", " Python "])
def test_core_choice_accepts(value, monkeypatch):
    monkeypatch.setenv("FBTRAIN_CORE", value)
    assert select.core_choice() == (value.strip().lower() or "auto")


def test_invalid_core_choice_is_one_clear_line(monkeypatch):
    """Checked when a feedback model is built, not at its first step; a CoreError is a
    UserError, which the CLI prints as one ``error:`` line (exit 2)."""
    monkeypatch.setenv("FBTRAIN_CORE", "fast")
    with pytest.raises(select.CoreError) as info:
        build_model(ModelConfig(kind="feedback_kv", d_model=16, n_heads=2, d_ff=24,
                                n_layers=1), 11)
    assert str(info.value) == ("FBTRAIN_CORE='fast' is not a core; use one of auto, native, "
                               "python")
    assert isinstance(info.value, UserError)


def test_python_choice_never_builds(monkeypatch, broken_build, capsys):
    monkeypatch.setenv("FBTRAIN_CORE", "python")
    assert select.core() is python
    assert capsys.readouterr().err == ""


def test_auto_falls_back_with_one_notice_line_per_process(monkeypatch, broken_build, capsys):
    monkeypatch.setenv("FBTRAIN_CORE", "auto")
    assert select.core() is python
    assert select.core() is python
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count(NOTICE) == 1
    assert str(broken_build) in err  # why
    assert f"about {select.PYTHON_CORE_SLOWDOWN} slower" in err  # at what cost
    assert "install g++" in err and "FBTRAIN_CORE=python" in err  # what to do


def test_native_choice_fails_loudly(monkeypatch, broken_build, capsys):
    monkeypatch.setenv("FBTRAIN_CORE", "native")
    with pytest.raises(native.CoreBuildError, match="could not build fbtrain's C"):
        select.core()
    assert capsys.readouterr().err == ""


def test_auto_takes_the_native_core_where_it_builds(monkeypatch, fresh_resolution):
    monkeypatch.setenv("FBTRAIN_CORE", "auto")
    assert select.core() is native.NativeCore


def _no_compiler_env(tmp_path: Path, core: str) -> dict[str, str]:
    """PATH without a C++ compiler (nor anything else) and an empty extensions cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "FBTRAIN_CORE_ATEN")}
    env.update(PATH=str(bin_dir), FBTRAIN_CORE=core, OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    return env


def _train(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 60, encoding="utf-8")
    sets = [f"data.path={text}", f"run.out_dir={tmp_path / 'runs'}", "train.max_steps=3",
            "train.eval_every=3", "train.eval_windows=2", "checkpoint.every=3",
            "train.batch_size=4", "curriculum=8", "logging.tensorboard=false"]
    args = [sys.executable, "-m", "fbtrain", "train", "--config",
            str(ROOT / "configs" / "tiny.yaml"), "--device", "cpu", "--quiet"]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_trains_on_the_fallback_without_a_compiler(tmp_path):
    """A machine without g++: ``fbtrain train`` trains on the PyTorch core, after the notice
    (one line, once, although training and evaluation run the core many times)."""
    assert shutil.which("c++", path=str(tmp_path / "bin")) is None
    result = _train(tmp_path, _no_compiler_env(tmp_path, "auto"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "last.pt").is_file()
    notices = [line for line in result.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1 and result.stderr.count(NOTICE) == 1
    assert notices[0].startswith("fbtrain: could not build fbtrain's C++ core")
    assert "'c++' not found" in notices[0]


def _broken_compiler_env(tmp_path: Path, core: str) -> dict[str, str]:
    """CXX=false: a compiler that exists but fails the ``$CXX --version`` torch runs to
    check it (an empty extensions cache, so a build is attempted)."""
    env = _no_compiler_env(tmp_path, core)
    env.update(CXX="false", PATH=os.environ["PATH"])
    return env


def test_a_compiler_that_fails_its_check_falls_back_with_the_notice(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from fbtrain.models.core.select import core; "
         "print(core().__name__)"], env=_broken_compiler_env(tmp_path, "auto"),
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "fbtrain.models.core.python"
    assert "Traceback" not in result.stderr
    notices = [line for line in result.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1
    assert notices[0].startswith("fbtrain: could not build fbtrain's C++ core")
    assert "'false' does not work as a C++ compiler (false --version exited with status 1" \
        in notices[0]


@pytest.mark.parametrize("compiler, cause", [
    ("missing", "'c++' not found (set CXX to name another compiler)"),
    ("broken", "'false' does not work as a C++ compiler (false --version exited with status 1; "
               "set CXX to name another compiler)"),
])
def test_native_choice_without_a_working_compiler_exits_2(compiler, cause, tmp_path):
    """FBTRAIN_CORE=native with no compiler, or one failing torch's check: one error line
    naming the source and why, exit 2, no fallback notice."""
    env = {"missing": _no_compiler_env, "broken": _broken_compiler_env}[compiler]
    result = _train(tmp_path, env(tmp_path, "native"))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: could not build fbtrain's C++ core ({native.CSRC}); it "
                      f"needs a C++ compiler (g++) on PATH: {cause}"]
    assert NOTICE not in result.stderr and "Traceback" not in result.stderr


# CUDA graphs (fbtrain/models/core/graphs.py): off by default, CUDA calls only.

def _graph_model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(kind="feedback_kv", d_model=16, n_heads=2, d_ff=32,
                                   n_layers=2, max_rel_pos=16, dropout=dropout), 11)


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_cuda_graph_switch_leaves_the_cpu_path_as_it_was(switch, monkeypatch):
    """Off (or on, for a CPU call) the autograd Function runs the plain core object itself,
    exactly as without the graphs module."""
    if switch is None:
        monkeypatch.delenv(graphs.GRAPHS_ENV, raising=False)
    else:
        monkeypatch.setenv(graphs.GRAPHS_ENV, switch)
    model = _graph_model()
    top = model(torch.randint(0, 11, (2, 5)))[0]
    todo, seen = [top.grad_fn], []
    while todo:  # the graph down to the core's autograd node
        node = todo.pop()
        if hasattr(node, "core"):
            seen.append(node.core)
        todo += [n for n, _ in node.next_functions if n is not None]
    assert seen == [select.core()]
    assert graphs.maybe_graphed(native.NativeCore, torch.zeros(1)) is native.NativeCore


def test_graph_capture_failure_falls_back_to_eager_with_one_notice(monkeypatch, capsys):
    """A capture that fails (here: any, faked) leaves one notice line and the eager
    result, and no capture is tried again, for any shape."""
    tries = []

    def broken(fn, args):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graphs, "_Graph", broken)
    monkeypatch.setattr(graphs, "_capture_failed", False)
    model = _graph_model(0.0)
    layers, wkv, bkv = model.core_params(4)
    inputs = CoreInputs(torch.randn(2, 4, 16), torch.zeros(1, 4, 0, 8), torch.zeros(1, 4, 0, 8),
                        model.memory_weights().detach(), wkv.detach(), bkv,
                        [t.detach() for t in flatten_layers(layers)])
    spec = CoreSpec(n_layers=2, n_heads=2, shared_kv=True, window=16, dropout=0.0)
    graphed = graphs.GraphedCore(native.NativeCore)
    eager = native.NativeCore.core_forward(spec, inputs, keep_tape=True)
    for keep_tape in (True, True, False):  # the last: another graph key
        out = graphed.core_forward(spec, inputs, keep_tape=keep_tape)
        assert torch.equal(out.hidden, eager.hidden)
    assert len(tries) == 1 and graphs.capture_status()["failed"]
    graphs.release()  # forgets the graphs, not the failure
    assert graphs.capture_status() == {"captured": 0, "failed": True}
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fbtrain: CUDA graph capture of the core failed (operation not permitted "
                   "when stream is capturing); running it eagerly from now on"]


def test_graphs_are_asked_only_of_the_cpp_core_outside_torch_distributed(monkeypatch,
                                                                          capsys):
    """With the switch on, a CUDA call of the PyTorch core (which reads the memory weights
    on the host) or one under torch.distributed runs the plain core, after one notice
    each; the C++ core gets its GraphedCore. (``like`` stands in for a CUDA tensor.)"""
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    monkeypatch.setattr(graphs, "_said", set())
    monkeypatch.setattr(graphs, "_graphed", {})
    like = types.SimpleNamespace(is_cuda=True)
    for _ in range(2):
        assert graphs.maybe_graphed(python, like) is python
    assert isinstance(graphs.maybe_graphed(native.NativeCore, like), graphs.GraphedCore)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert graphs.maybe_graphed(native.NativeCore, like) is native.NativeCore
    assert capsys.readouterr().err.splitlines() == [
        "fbtrain: FBTRAIN_CUDA_GRAPHS is set, but CUDA graphs need the C++ core (the PyTorch "
        "core syncs with the host); running the core eagerly",
        "fbtrain: FBTRAIN_CUDA_GRAPHS is set, but CUDA graphs are not used under "
        "torch.distributed; running the core eagerly"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_graphed_training_steps_equal_eager_bitwise(dropout, monkeypatch):
    """Three training steps (same seed), graphed and eager, fp32: the same logits and
    gradients bit for bit, dropout masks included; the graphs are captured once."""
    monkeypatch.setattr(graphs, "_graphed", {})  # this test's captures alone
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(graphs.GRAPHS_ENV, switch)
        model = _graph_model(dropout).cuda().train()
        torch.manual_seed(1)
        x = torch.randint(0, 11, (4, 9), device="cuda")
        steps = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            logits = model(x)[0]
            logits.square().mean().backward()
            steps.append([logits.detach().clone()]
                         + [p.grad.clone() for p in model.parameters() if p.grad is not None])
        results[switch] = steps
    for eager, graphed in zip(results["0"], results["1"], strict=True):
        for a, b in zip(eager, graphed, strict=True):
            assert torch.equal(a, b)
    assert graphs.capture_status() == {"captured": 2, "failed": False}


def test_graphed_core_hands_each_call_its_own_inputs_and_outputs(monkeypatch):
    """GraphedCore's plumbing on the CPU, with a stand-in for the CUDA graph that records
    the call once and replays it from static copies of the inputs: a training step
    through it (forward, backward, two chunks carrying memory) equals the plain core's
    bit for bit, and each spec and shape is captured once."""
    captured = []

    class FakeGraph:
        def __init__(self, fn, args):
            captured.append(fn)
            self.fn, self.static = fn, [None if a is None else a.clone() for a in args]

        def __call__(self, args):
            for s, a in zip(self.static, args, strict=True):
                if s is not None:
                    s.copy_(a)
            return self.fn(self.static)

    monkeypatch.setattr(graphs, "_Graph", FakeGraph)
    tokens = torch.randint(0, 11, (2, 6))
    runs = []
    for graphed in (False, True):
        model = _graph_model(0.1)
        if graphed:
            wrapper = graphs.GraphedCore(select.core())
            monkeypatch.setattr("fbtrain.models.core.autograd.maybe_graphed",
                                lambda core, like, w=wrapper: w)
        torch.manual_seed(3)
        logits, state = model(tokens[:, :3])
        logits2, _ = model(tokens[:, 3:], state)  # carried memory: a second shape
        torch.cat([logits, logits2], 1).square().mean().backward()
        runs.append([logits.detach(), logits2.detach()]
                    + [p.grad for p in model.parameters() if p.grad is not None])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert len(captured) == 4  # forward and backward, for each of the two shapes


class _ReplayingStandIn:
    """A CPU stand-in for one captured call that behaves as a CUDA graph does where the
    clones matter: the first call "captures" (its outputs become the static outputs), and
    every replay copies its inputs into the static inputs and writes its results into those
    same output tensors."""

    def __init__(self, fn, args):
        self.fn = fn
        self.static = [None if a is None else a.clone() for a in args]
        self.out = fn(self.static)

    def __call__(self, args):
        with torch.inference_mode():  # the cores' outputs are inference tensors
            for s, a in zip(self.static, args, strict=True):
                if s is not None:
                    s.copy_(a)
            fresh = _tensors(self.fn(self.static))
            for kept, new in zip(_tensors(self.out), fresh, strict=True):
                kept.copy_(new)
        return self.out


def _tensors(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def test_graphed_outputs_outlive_the_next_replay_of_their_shape(monkeypatch):
    """Two forwards of one shape, then their backwards (a graph's replays write into the
    same buffers): each call's logits and gradients are those of an eager run, so the
    graphed core's outputs and the autograd Function's gradients are copies, never the
    graph's buffers."""
    from fbtrain.models.core import autograd

    model = _graph_model(0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    xs = [torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(s))
          for s in (1, 2)]

    def run_both() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        logits = [model(x)[0] for x in xs]  # both forwards before any backward
        seen = [lg.detach().clone() for lg in logits]
        grads = []
        for lg in logits:
            for p in params:
                p.grad = None
            lg.square().sum().backward()
            grads.append([p.grad for p in params])  # kept as they are, not cloned
        return seen, grads

    eager_logits, eager_grads = run_both()
    monkeypatch.setattr(graphs, "_Graph", _ReplayingStandIn)
    monkeypatch.setattr(graphs, "_capture_failed", False)
    graphed = graphs.GraphedCore(select.core())
    monkeypatch.setattr(autograd, "maybe_graphed", lambda core, like: graphed)
    graphed_logits, graphed_grads = run_both()
    assert len(graphed.graphs) == 2  # one forward, one backward: each replayed once
    for e, g in zip(eager_logits, graphed_logits, strict=True):
        assert torch.equal(e, g)
    for e, g in zip(eager_grads, graphed_grads, strict=True):
        for a, b in zip(e, g, strict=True):
            assert torch.equal(a, b)
