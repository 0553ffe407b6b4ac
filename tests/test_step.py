"""One optimizer step's loss normalisation: the mean over every scored target of the step;
and its one read on the host.

Two gloo ranks on halves of a global batch, two accumulated micro-batches, and one process
on the whole batch must give the same loss, accuracy and gradients (to float tolerance), on
a text (every target scored) and on the state-tracking programs (a few targets scored,
unevenly). A divisor per rank or per micro-batch would make the loss a mean of means.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from fbtrain.config import config_from_dict
from fbtrain.data.corpus import load_corpus
from fbtrain.data.samplers import BatchSampler
from fbtrain.data.streams import IGNORE_INDEX
from fbtrain.distributed import DistContext
from fbtrain.rundir import RunDirectory
from fbtrain.train.setup import set_up
from fbtrain.train.signals import StopSignals
from fbtrain.train.step import HOST_SYNC, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

REPO = Path(__file__).resolve().parents[1]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
BATCH, SEQ_LEN = 6, 24  # the global batch: BATCH windows of SEQ_LEN
LOSS_TOLERANCE = 1e-6  # relative: float32 sums in another order
GRAD_TOLERANCE = 1e-6  # absolute, on gradients of order 1e-2 .. 1

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


class FixedBatches:
    """The step's micro-batches, given: ``parts`` of (x, y) ``[rows, T]``, no memory."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]]):
        self.parts = parts

    def micro_batches(self, seq_len: int, batch: int, device: torch.device) -> list[Any]:
        return [(x.to(device), y.to(device), None) for x, y in self.parts]

    def keep(self, micro: int, state: Any) -> None:
        """Nothing carried."""


def one_step(raw: dict[str, Any], ctx: DistContext, run_dir: Path,
             parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Set the run up from ``raw`` as training does, train one step on ``parts``; its loss,
    accuracy and every parameter's gradient (what DDP left, the same on every rank)."""
    import dataclasses

    run, _, _ = set_up(config_from_dict(raw), ctx, RunDirectory(run_dir, 1), None)
    run = dataclasses.replace(run, batches=FixedBatches(parts))
    result = train_step(run, 0, StopSignals(), run_dir / "last.pt")
    grads = {name: p.grad.detach().clone() for name, p in run.raw_model.named_parameters()}
    return {"loss": result.loss, "accuracy": result.accuracy, "grads": grads}


# Each rank trains one step on its half of the global batch (rank r: rows r*B/2..), then
# saves what one_step returns; the test compares it with one process on the whole batch.
DDP_DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    from test_step import one_step
    from fbtrain.distributed import session
    cases = json.loads(open(sys.argv[1]).read())
    with session("cpu") as ctx:
        for name, raw in cases.items():
            x, y = torch.load(f"{sys.argv[2]}/{name}-batch.pt")
            half = x.shape[0] // ctx.world_size
            rows = slice(ctx.rank * half, (ctx.rank + 1) * half)
            out = one_step(raw, ctx, Path(sys.argv[2]) / f"{name}-rank{ctx.rank}",
                           [(x[rows], y[rows])])
            torch.save(out, f"{sys.argv[2]}/{name}-rank{ctx.rank}.pt")
    # The threads left once the session is over (Linux): none of the group's may outlive it.
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.exists() else []
    Path(f"{sys.argv[2]}/threads-rank{ctx.rank}.json").write_text(json.dumps(names))
""")


def write_text(path: Path) -> Path:
    rng = random.Random(0)
    words = ["the", "king", "queen", "and", "to", "of", "my", "lord", "ROMEO:", "JULIET:"]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
                              for _ in range(200)) + "\n", encoding="utf-8")
    return path


def make_raw(tmp_path: Path, data: dict[str, Any], batch: int, grad_accum: int = 1
             ) -> dict[str, Any]:
    return {
        "run": {"name": "run", "out_dir": str(tmp_path / "runs"), "device": "cpu", "seed": 3},
        "data": data,
        "model": {"kind": "feedback_kv", "d_model": 16, "n_heads": 2, "d_ff": 32,
                  "n_layers": 2, "max_rel_pos": 32},
        "train": {"max_steps": 1, "batch_size": batch, "grad_accum": grad_accum,
                  "grad_clip": 0.0, "eval_windows": 2, "constant_tokens": False},
        "curriculum": [{"seq_len": SEQ_LEN}],
        "logging": {"tensorboard": False, "progress": False},
    }


CASES = {
    "text": lambda tmp: {"path": str(write_text(tmp / "text.txt"))},
    # The state-tracking programs: only the value after each print is scored (~6%).
    "labelled": lambda tmp: {"dataset": "algorithmic", "variables": 3, "program_len": 12,
                             "train_programs": 60, "valid_programs": 8, "test_programs": 8,
                             "seed": 0},
}


def global_batch(raw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH training windows drawn from the run's own training split."""
    corpus = load_corpus(config_from_dict(raw).data)
    return BatchSampler(corpus.splits["train"], 11).sample(BATCH, SEQ_LEN, torch.device("cpu"))


def scored_per_half(y: torch.Tensor) -> list[int]:
    return [int((half != IGNORE_INDEX).sum()) for half in y.chunk(2)]


def assert_same_step(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_TOLERANCE)
    if a["accuracy"] is not None or b["accuracy"] is not None:
        assert a["accuracy"] == pytest.approx(b["accuracy"], rel=LOSS_TOLERANCE)
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in a["grads"].items():
        torch.testing.assert_close(grad, b["grads"][name], rtol=0, atol=GRAD_TOLERANCE,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_grad_accum_equals_one_batch_of_twice_the_size(tmp_path: Path, case: str) -> None:
    """Two micro-batches of B/2 are one step over B rows: on the programs their scored
    counts differ, so a divisor per micro-batch would weigh their targets unequally."""
    whole_raw = make_raw(tmp_path, CASES[case](tmp_path), BATCH)
    x, y = global_batch(whole_raw)
    if case == "labelled":
        first, second = scored_per_half(y)
        assert first != second and 0 < first + second < y.numel() / 4
    single = DistContext(device=torch.device("cpu"))
    whole = one_step(whole_raw, single, tmp_path / "whole", [(x, y)])
    accum_raw = make_raw(tmp_path, CASES[case](tmp_path), BATCH // 2, grad_accum=2)
    halves = list(zip(x.chunk(2), y.chunk(2), strict=True))
    accumulated = one_step(accum_raw, single, tmp_path / "accum", halves)
    assert_same_step(accumulated, whole)


def test_two_gloo_ranks_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    """Rank r trains rows [r B/2, (r+1) B/2) of the batch one process trains whole: the
    same loss, accuracy and (all-reduced) gradients, for a text and for the programs,
    whose halves score different numbers of targets."""
    cases = {name: make_raw(tmp_path, data(tmp_path), BATCH // 2)
             for name, data in CASES.items()}
    for name, raw in cases.items():
        torch.save(global_batch(raw), tmp_path / f"{name}-batch.pt")
    first, second = scored_per_half(torch.load(tmp_path / "labelled-batch.pt")[1])
    assert first != second
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "ddp_driver.py").write_text(DDP_DRIVER)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(tmp_path / "ddp_driver.py"), str(tmp_path / "cases.json"), str(tmp_path),
         str(Path(__file__).parent)],
        env=CHILD_ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = DistContext(device=torch.device("cpu"))
    for name, raw in cases.items():
        x, y = torch.load(tmp_path / f"{name}-batch.pt")
        whole_raw = {**raw, "train": {**raw["train"], "batch_size": BATCH}}
        whole = one_step(whole_raw, single, tmp_path / f"{name}-whole", [(x, y)])
        rank0, rank1 = (torch.load(tmp_path / f"{name}-rank{r}.pt") for r in (0, 1))
        assert_same_step(rank0, whole)
        assert_same_step(rank1, rank0)
    for r in (0, 1):  # fbtrain.distributed._import_before_the_group: the group really ended
        threads = json.loads((tmp_path / f"threads-rank{r}.json").read_text())
        assert not [name for name in threads if "gloo" in name], threads


def test_ranks_above_0_draw_their_own_dropout_masks(tmp_path: Path) -> None:
    """Every rank builds the same initial weights (run.seed), then a rank above 0 draws
    from a stream of its own: its dropout masks are not rank 0's (with them, two ranks
    would train one set of masks on twice the data). Set up in one process as each rank
    would be (world_size 1 here: no process group is needed to build the run)."""
    raw = make_raw(tmp_path, CASES["text"](tmp_path), BATCH)
    raw["model"]["dropout"] = 0.5
    tokens = torch.zeros(2, 8, dtype=torch.long)
    weights, logits = {}, {}
    for rank in (0, 1, 2):
        ctx = DistContext(device=torch.device("cpu"), rank=rank)
        run, _, _ = set_up(config_from_dict(raw), ctx,
                           RunDirectory(tmp_path / f"rank{rank}", 1), None)
        weights[rank] = run.raw_model.state_dict()
        assert run.model.training
        logits[rank] = run.model(tokens)[0].detach()  # the first masks the rank draws
    for rank in (1, 2):
        assert all(torch.equal(weights[rank][k], w) for k, w in weights[0].items())
    assert not torch.equal(logits[1], logits[0])
    assert not torch.equal(logits[2], logits[0])
    assert not torch.equal(logits[2], logits[1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_reads_the_host_once(tmp_path: Path, case: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A training step on the ATen path (the GPU's) reads the device once: its figures
    (loss, gradient norm, accuracy, memory RMS, whether anything was scored) in one copy.
    A labelled step used to read its scored count a second time (``bool(scored)``).
    (Fused AdamW's CPU kernel reads its step counts with item(); CUDA's does not, and the
    counter does not count them.)"""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("FBTRAIN_CORE_ATEN", "1")
    raw = make_raw(tmp_path, CASES[case](tmp_path), BATCH)
    run, _, _ = set_up(config_from_dict(raw), DistContext(torch.device("cpu")),
                       RunDirectory(tmp_path / "run", 1), None)
    import dataclasses

    run = dataclasses.replace(run, batches=FixedBatches([global_batch(raw)]))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = train_step(run, 0, StopSignals(), tmp_path / "last.pt")
    def reads_on_a_gpu(event) -> bool:  # fused AdamW's CPU kernel reads its step counts
        while event is not None:
            if event.name == "aten::_fused_adamw_":
                return False
            event = event.cpu_parent
        return True

    reads = [e.name for e in prof.events()
             if e.name in (HOST_SYNC, "aten::_local_scalar_dense") and reads_on_a_gpu(e)]
    assert reads == [HOST_SYNC]
    assert result.memory_rms.device.type == "cpu" and result.loss > 0


def test_the_eager_step_clips_its_gradients(tmp_path: Path) -> None:
    """train.grad_clip holds on the eager step (the graphed one runs the same body): after
    step_body the gradients' norm is the clip, where their norm before it was larger."""
    from fbtrain.train.step import step_body

    raw = make_raw(tmp_path, CASES["text"](tmp_path), BATCH)
    raw["train"]["grad_clip"] = 1e-3
    run, _, _ = set_up(config_from_dict(raw), DistContext(torch.device("cpu")),
                       RunDirectory(tmp_path / "run", 1), None)
    stats = step_body(run, [(*global_batch(raw), None)])
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.params]))
    assert stats[1].item() > 1e-2  # the norm before clipping, logged
    assert norm.item() == pytest.approx(1e-3, rel=1e-4)


def test_a_session_frees_its_wrappers_reducers_while_the_group_lives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP wrapper's Reducer holds the process group; freed after the group was destroyed,
    it destroys the gloo group inside a decref with the GIL held, and a gloo worker that
    needs the GIL then deadlocks the rank at exit. The session frees every wrapper's
    Reducer (and the Logger holding it) before it leaves the group."""
    import socket

    import torch.distributed as dist

    from fbtrain.distributed import session

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        monkeypatch.setenv("WORLD_SIZE", "2")  # a group the session finds made (and keeps)
        monkeypatch.setenv("RANK", "0")
        with session("cpu") as ctx:
            wrapper = ctx.wrap(torch.nn.Linear(2, 2))
            assert isinstance(wrapper.__dict__.get("reducer"), dist.Reducer)
        assert "reducer" not in wrapper.__dict__ and "logger" not in wrapper.__dict__
        assert dist.is_initialized()  # only the wrappers' hold on it was let go
    finally:
        dist.destroy_process_group()
