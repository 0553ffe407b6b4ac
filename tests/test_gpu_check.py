"""scripts/gpu_check.py, the first GPU check, on its CPU stand-in: it starts with a Python
that has the dependencies but not fbtrain installed, writes each section's file as the
section ends, keeps them when killed, holds its budget, and ends with its table."""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_report  # noqa: E402
from gpu_check_report import SKIPPED, Budget  # noqa: E402

SECTIONS = ("a_env", "b_correctness", "c_speed", "d_train", "e_cuda_tests")


def bare_python(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """A command prefix and environment for a Python that imports torch and the other
    dependencies but not fbtrain, as on a lent GPU machine: no site processing (so no
    editable install's path hook), the environment's packages by PYTHONPATH alone. The
    C++ core comes from the build folder the other tests use (an explicit
    TORCH_EXTENSIONS_DIR wins over gpu_check's own; torch's default root would not do:
    without the variable torch builds in a subfolder of it, <python>_<accelerator>), so it
    is not rebuilt here."""
    from fbtrain.models.core import native

    core_folder = native.build_directory(native.extension_name(*native._core_recipe()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FBTRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    env["TORCH_EXTENSIONS_DIR"] = str(core_folder.parent)
    env["PYTHONUNBUFFERED"] = "1"
    return [sys.executable, "-S"], env


def gpu_check(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, str], Path]:
    python, env = bare_python(tmp_path)
    out = tmp_path / "out"
    return [*python, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out), *args], env, out


def test_the_bare_python_has_no_fbtrain(tmp_path):
    """The stand-in interpreter of the tests below really lacks fbtrain (away from the
    repo root), while torch imports."""
    python, env = bare_python(tmp_path)
    proc = subprocess.run([*python, "-c", "import torch\nimport fbtrain"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert "No module named 'fbtrain'" in proc.stderr


def test_cpu_stand_in_writes_every_section_and_ends_with_its_table(tmp_path):
    """From the repo root, without CUDA: every section runs its toy version (or says it
    needs CUDA) within the budget, each section's file is written and whole, and the last
    lines printed are the summary table, one row per section, in order. The C++ core is
    loaded from the tests' own build, not compiled again (a minute of the suite)."""
    from fbtrain.models.core import native

    native.native_ops()  # (built here first, where no test has yet)
    cmd, env, out = gpu_check(tmp_path, "--budget", "150", "--steps", "6")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiling the C++ core" not in proc.stdout + proc.stderr
    reports = {name: json.loads((out / f"{name}.json").read_text()) for name in SECTIONS}
    assert [r["section"] for r in reports.values()] == list(SECTIONS)
    assert reports["a_env"]["versions"]["torch"] == torch.__version__
    assert reports["a_env"]["core_build"]["ok"]
    assert reports["a_env"]["copy"]["tb_per_s"] > 0
    assert reports["a_env"]["empty_kernel_graph_node"] == "needs CUDA"
    b = reports["b_correctness"]
    assert b["status"] == "PASS"
    for case in ("feedback_kv/memory_norm=none", "feedback/memory_norm=layernorm"):
        assert b[f"aten_float64/{case}"]["max_abs_diff"] < 1e-9
    c = reports["c_speed"]["rows"]
    assert c["toy/T=8/batch=2/fp32/aten_eager"]["ms_per_step"] > 0
    # The whole-step graph's row runs its code on the CPU stand-in of the graph.
    assert c["toy/T=8/batch=2/fp32/aten_step_graph"]["step_graph_captured"]
    assert reports["d_train"]["status"] == "PASS"
    assert reports["d_train"]["last"][1] < reports["d_train"]["first"][1]
    assert reports["e_cuda_tests"]["status"] == "needs CUDA"
    summary = json.loads((out / "summary.json").read_text())
    assert [s["section"] for s in summary["sections"]] == list(SECTIONS)
    assert summary["seconds"] <= 150
    lines = proc.stdout.rstrip().splitlines()
    table = lines[-len(SECTIONS):]
    assert [line.split()[0] for line in table] == list(SECTIONS)
    assert lines[-len(SECTIONS) - 2].startswith("== summary:")
    assert "no CUDA: a toy run on the CPU" in lines[0]


def test_killed_after_a_section_it_keeps_the_finished_sections(tmp_path):
    """SIGKILL as soon as section a's file appears: that file is whole, and every other
    section's file is either absent or whole (no half-written file under a final name)."""
    cmd, env, out = gpu_check(tmp_path, "--budget", "150")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "a_env.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads((out / "a_env.json").read_text())["status"] == "ok"
    for path in out.glob("*.json"):
        json.loads(path.read_text())
    assert not (out / "summary.json").exists()


def test_the_budget_cuts_a_run_wherever_it_is(tmp_path):
    """A budget that runs out inside a unit of work (here one that never ends): the
    watchdog writes the section in progress as cut, prints the table and ends the run
    (exit 3) at the budget, without waiting for the unit. The unit is one section a runs
    whatever the budget says (the versions), and the heavy imports come before the budget
    starts, so a loaded machine cannot move the cut out of that section."""
    cmd, env, out = gpu_check(tmp_path, "--budget", "6")
    hang = ("import sys, threading, runpy\n"
            f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'scripts')!r}]\n"
            "import torch, gpu_check_env, gpu_check_steps\n"
            "gpu_check_env.versions = lambda: threading.Event().wait()\n"
            f"sys.argv = {cmd[2:]!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    # Only the watchdog ends the hang: a run that waited for it would time out here.
    proc = subprocess.run([*cmd[:2], "-c", hang], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert json.loads((out / "a_env.json").read_text())["status"] == "cut: budget"
    assert json.loads((out / "summary.json").read_text())["sections"][0]["status"] == \
        "cut: budget"
    assert proc.stdout.rstrip().splitlines()[-1].split()[:3] == ["a_env", "cut:", "budget"]


def test_a_section_whose_units_the_budget_skipped_says_so(monkeypatch):
    """With no time left section a records each unit as skipped and ends with a status,
    not a traceback (a skipped build was read as a dict: AttributeError under load)."""
    import gpu_check_env

    monkeypatch.setattr(gpu_check_env, "core_build",
                        lambda: pytest.fail("ran past the budget"))
    data: dict = {}
    status, summary = gpu_check_env.run(data, torch.device("cpu"), Budget(0.0))
    assert status == "ok" and data["core_build"] == data["copy"] == SKIPPED
    assert "C++ core - s" in summary


def test_each_unit_asks_the_budget_first(monkeypatch):
    """With no time left every unit of sections b and c is recorded as skipped, and none
    runs."""
    import gpu_check_steps

    monkeypatch.setattr(gpu_check_steps.benchmark, "check_exact",
                        lambda *a, **k: pytest.fail("ran past the budget"))
    monkeypatch.setattr(gpu_check_steps, "speed_row",
                        lambda *a, **k: pytest.fail("ran past the budget"))
    spent = Budget(0.0)
    data: dict = {}
    status, summary = gpu_check_steps.run_correctness(data, torch.device("cpu"), spent)
    units = [k for k in data if "/" in k]
    assert units and all(data[k] == SKIPPED or str(data[k]).startswith("not run")
                         for k in units)
    assert "skipped: budget" in summary
    data = {}
    assert gpu_check_steps.run_speed(data, torch.device("cpu"), spent, 1)[0] == "FAIL"
    assert set(data["rows"].values()) == {SKIPPED}


def test_section_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails part-way leaves the old file and no temporary beside it."""
    path = tmp_path / "a_env.json"
    gpu_check_report.write_json_atomic(path, {"status": "ok"})

    def broken_dump(obj, f, **kwargs):
        f.write('{"status": "ha')
        raise OSError("disk full")

    monkeypatch.setattr(gpu_check_report.json, "dump", broken_dump)
    with pytest.raises(OSError):
        gpu_check_report.write_json_atomic(path, {"status": "new"})
    assert json.loads(path.read_text()) == {"status": "ok"}
    assert [p.name for p in tmp_path.iterdir()] == ["a_env.json"]


def test_gpu_check_counts_kernels_launch_calls_and_busy_time_once():
    """The profile's device work: each kernel's time once (not again through the CPU op
    that launched it), no user annotation counted as a kernel, and the host's launch
    calls apart from the kernels they ran (a graph replay: one call, many kernels)."""
    from types import SimpleNamespace as Event

    import gpu_check_steps

    events = [
        Event(key="aten::mm", device_type="DeviceType.CPU", count=10,
              self_device_time_total=900.0),  # the launching op, carrying its kernels' time
        Event(key="ampere_sgemm", device_type="DeviceType.CUDA", count=10,
              self_device_time_total=900.0),
        Event(key="Optimizer.step#AdamW.step", device_type="DeviceType.CUDA", count=1,
              self_device_time_total=5000.0, is_user_annotation=True),
        Event(key="cudaLaunchKernel", device_type="DeviceType.CPU", count=4,
              self_device_time_total=0.0),
        Event(key="cudaGraphLaunch", device_type="DeviceType.CPU", count=2,
              self_device_time_total=0.0),
    ]
    assert gpu_check_steps.device_work(events) == {"kernels": 10, "launch_calls": 6,
                                                   "busy_ms": 0.9}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_required_cuda_fails_at_once_without_it(tmp_path):
    """``make gpu-check`` (--require-cuda) without CUDA fails in one line instead of
    passing on the CPU stand-in, and writes nothing."""
    cmd, env, out = gpu_check(tmp_path, "--require-cuda")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: no CUDA device (torch ")
    assert proc.stderr.strip().endswith("this check is for a CUDA machine")
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_make_gpu_check_runs_on_a_python_that_has_torch_without_pip(tmp_path):
    """``make gpu-check`` with no virtual environment but a ``PY`` that imports torch (a
    lent GPU machine's own python3): it runs the check on that python (here it stops at
    once: no CUDA) and builds no environment, so nothing is pip-installed."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make here")
    venv = tmp_path / "no-venv"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"VENV={venv}",
                           f"PY={sys.executable}", f"GPU_CHECK_DIR={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stdout.splitlines()[0] == (f"{sys.executable} scripts/gpu_check.py "
                                           f"--require-cuda --out {tmp_path / 'out'}")
    assert "error: no CUDA device" in proc.stderr
    assert not venv.exists()
