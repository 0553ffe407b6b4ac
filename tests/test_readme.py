"""The README is the front door: short, quickstart first, in the order a newcomer reads it,
and true to pyproject.toml and the Makefile (Python versions, what `make install` installs,
the license)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYPROJECT_TEXT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
SECTIONS = ["Quickstart", "Results at a glance", "TensorBoard", "Commands", "Configuration",
            "GPU", "Documentation", "License and citation"]


def readme() -> str:
    return README.read_text(encoding="utf-8")


def project_field(name: str) -> str:
    """A one-line ``name = ...`` field of pyproject.toml's [project] (tomllib is 3.11+)."""
    m = re.search(rf"^{re.escape(name)} = (.+)$", PYPROJECT_TEXT, flags=re.M)
    assert m, f"pyproject.toml has no {name}"
    return m.group(1).strip()


def test_readme_is_short():
    """Read in two minutes: what a user needs, the figures and their provenance in docs/."""
    assert len(readme().splitlines()) < 180


def test_readme_carries_no_provenance():
    """Commits, load averages and CI wall times belong to docs/results.md, linked from the
    README; the front page has what a newcomer needs."""
    text = readme()
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", text)
    assert "load average" not in text.lower()
    assert "CI=true" not in text and ".ci/run" not in text
    assert "(docs/results.md)" in text


def test_readme_eval_block_is_what_eval_prints():
    """The quickstart's ``eval`` block, line for line, in the form ``fbtrain eval`` prints
    (its precision line included)."""
    from fbtrain.evaluate import format_result

    quickstart = readme().split("## Quickstart", 1)[1]
    block = quickstart.split("`eval` scores every character", 1)[1]
    block = block.split("```text\n", 1)[1].split("```", 1)[0].rstrip("\n")
    shown = dict(line.split(None, 1) for line in block.splitlines())
    result = {"checkpoint": shown["checkpoint"], "step": int(shown["step"]),
              "split": shown["split"], "context": shown["context"],
              "seq_len": int(shown["seq_len"]), "precision": shown["precision"],
              "tokens": int(shown["tokens"].replace(",", "")),
              "loss": float(shown["loss"].split()[0]), "bpc": float(shown["bpc"]),
              "perplexity": float(shown["perplexity"])}
    assert format_result(result) == block
    # eval's default precision is the run's own run.precision (the main job's config's).
    config = yaml.safe_load((ROOT / "configs" / "tiny_shakespeare.yaml").read_text())
    assert shown["precision"] == config["run"]["precision"]


def test_readme_says_what_make_test_does_and_what_to_expect():
    """``make test`` installs ruff but does not run it (``make lint`` does); the time of
    the main job on an idle machine, the ETA, the size of ``.venv``, how to resume."""
    text = readme()
    block = text.split("```sh", 1)[1].split("```", 1)[0]
    make_test = next(line for line in block.splitlines() if line.startswith("make test"))
    assert "install pytest and ruff" in make_test and "run ruff" not in make_test
    assert "`make lint` runs ruff" in text
    assert "about 5 minutes on an idle 2-core machine" in text and "ETA" in text
    assert "2.1 GB" in text and "`make train` again continues" in text
    # The figures shown are one machine's; what to expect on another is a range
    # (test_docs checks it against results.md's machines).
    assert "one machine's" in text and re.search(r"expect\s+\*\*", text)


def test_readme_tensorboard_needs_the_venv_and_opens_unsmoothed():
    from fbtrain.metrics.tensorboard import LOSS_URL

    section = readme().split("## TensorBoard", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate; tensorboard --logdir runs" in section
    assert f"<{LOSS_URL}>" in section and "smoothing=0" in LOSS_URL
    assert "`<run>`" in section and "`<run>/val`" in section


def test_readme_sections_in_order():
    headings = re.findall(r"^## (.+)$", readme(), flags=re.M)
    assert headings == SECTIONS


def test_quickstart_is_on_the_first_screen():
    lines = readme().splitlines()
    first_block = next(i for i, line in enumerate(lines) if line.startswith("```sh"))
    assert first_block < 30, "the first command should be on the first screen"
    block = lines[first_block + 1:first_block + 4]
    assert block[0].startswith("make train") and block[1].startswith("make test")
    quickstart = readme().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    for command in ("fbtrain sample --checkpoint runs/tiny_shakespeare",
                    "fbtrain eval --checkpoint runs/tiny_shakespeare"):
        assert command in quickstart


def test_readme_python_versions_match_pyproject():
    requires = project_field("requires-python").strip('"')
    m = re.fullmatch(r">=\s*(3\.\d+)", requires)
    assert m, f"requires-python {requires!r}: update this test and the README together"
    assert f"Python {m.group(1)} or newer" in readme()
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert f"Python ({m.group(1)} or newer)" in makefile
    # ... and the Python running the tests (CI's) is one of them.
    assert sys.version_info >= tuple(int(x) for x in m.group(1).split("."))


def test_license_file_matches_pyproject():
    assert project_field("license") == '{ text = "MIT" }'
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text


def test_citation_cites_the_paper_and_the_software():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["version"] == project_field("version").strip('"')
    assert cff["license"] == "MIT"
    paper = cff["preferred-citation"]
    assert "Feedback Memory" in paper["title"] and "2002.09402" in paper["url"]
    assert "arXiv:2002.09402" in readme()  # the BibTeX block


def test_readme_picture_exists():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme())
    assert pictures and all((ROOT / p).is_file() for p in pictures)


def make_dry_run(target: str) -> str:
    """The commands ``make TARGET`` would run for a checkout without a virtual environment."""
    out = subprocess.run(["make", "-n", target, "VENV=/nonexistent/venv"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_installs_no_dev_tools_and_make_test_does():
    install = make_dry_run("install")
    assert re.search(r"pip install -q .*-e \.$", install, flags=re.M)
    assert "[dev]" not in install and "pytest" not in install
    train = make_dry_run("train")
    assert "[dev]" not in train
    # pip is quiet: each phase says first what it installs (torch's download takes minutes).
    lines = install.splitlines()
    for i, line in enumerate(lines):
        if " -m pip install" in line:
            package = line.split()[-1].strip("'")
            assert lines[i - 1].startswith('echo "make install: installing '), lines[i - 1]
            assert package in lines[i - 1] or "pyproject.toml" in lines[i - 1], lines[i - 1]
    for target in ("test", "lint"):
        assert re.search(r"pip install -q .*-e '\.\[dev\]'", make_dry_run(target))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_runs_the_numeric_tests_again_held_to_avx2():
    """An AVX-512 machine sees what an AVX2-only one computes: the second pass holds torch
    (and MKL) to AVX2 and refuses to run if torch still dispatches to AVX-512."""
    commands = make_dry_run("test").splitlines()
    passes = [c for c in commands if " -m pytest" in c]
    # Both in two processes (pytest-xdist), the first over the whole suite; each ends with
    # its slowest tests and, failing, a line naming the pass (its output may be long).
    pytest = " -m pytest -n 2 --dist worksteal --durations=25"
    assert len(passes) == 2 and passes[0].split(" || ")[0].endswith(pytest)
    assert "pass 1 of 2 (every test) failed" in passes[0].split(" || ")[1]
    held, failed = passes[1].split(" || ")
    assert "pass 2 of 2 (the numeric tests held to AVX2) failed" in failed
    assert held.startswith("ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ")
    files = held.split(pytest + " ", 1)[1].split()
    assert "tests/test_legacy_checkpoints.py" in files and "tests/test_train.py" in files
    assert all((ROOT / f.split("::")[0]).is_file() for f in files), files
    check = next(c for c in commands if "get_cpu_capability" in c)
    assert check.startswith("ATEN_CPU_CAPABILITY=avx2 ") and 'sys.exit(c == "AVX512")' in check
    assert commands.index(check) < commands.index(passes[1])


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    block = readme().split("```sh", 1)[1].split("```", 1)[0]
    test_command = next(line.split("#")[0].strip() for line in block.splitlines()
                        if "test" in line.split("#")[0])
    assert test_command == "make test"
    assert re.search(rf"^{re.escape(test_command)}$", ci, flags=re.M)
