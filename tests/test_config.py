"""Config: every shipped YAML validates; defaults < YAML < --set; each problem is reported
in one line that names the file, key, value and what is allowed."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from conftest import bounded_run

from fbtrain.config import SECTIONS, Config, ConfigError, load_config
from fbtrain.config.curriculum import Curriculum
from fbtrain.config.kinds import KINDS
from fbtrain.config.reference import markdown_table

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
CPU_BUDGET_TOKENS = 1_536_000  # what a 2-core CPU trains in ~15 minutes (see the configs)


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems(*overrides: str, path: Path | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def total_tokens(cfg: Config) -> int:
    plan = Curriculum(cfg)
    return sum(plan.batch_size_at(s) * plan.seq_len_at(s) for s in range(cfg.train.max_steps))


# ----------------------------------------------------------------------------- shipped configs


def test_configs_are_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"tiny_shakespeare", "tiny_shakespeare_feedback", "tiny_shakespeare_transformer",
            "tiny_shakespeare_fixed", "tiny_shakespeare_carry", "gpu", "tiny"} <= names


@pytest.mark.parametrize("prefix", ["algorithmic", "algorithmic_reach"])
def test_benchmark_pairs_differ_only_in_the_model_compared(prefix: str):
    """The state-tracking comparison is fair: the 4-layer feedback model and the 8-layer
    transformer see the same programs, width, heads, window, streams, schedule and tokens."""
    feedback = load_config(Path(CONFIGS[0].parent, f"{prefix}_feedback.yaml")).to_dict()
    transformer = load_config(Path(CONFIGS[0].parent, f"{prefix}_transformer.yaml")).to_dict()
    assert (feedback["model"]["kind"], feedback["model"]["n_layers"]) == ("feedback_kv", 4)
    assert (transformer["model"]["kind"], transformer["model"]["n_layers"]) == ("transformer", 8)
    for cfg in (feedback, transformer):
        cfg["run"].pop("name")
        for key in ("kind", "n_layers", "memory_init"):  # memory_init: feedback kinds only
            cfg["model"].pop(key)
    assert feedback == transformer


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_validates(path: Path):
    cfg = load_config(path)
    assert cfg.run.name == path.stem  # runs/<stem>: configs never overwrite each other's runs
    assert Curriculum(cfg).max_seq_len <= cfg.model.max_rel_pos
    # Every key in the file was meant: the file round-trips through the resolved config.
    assert load_config(path, [f"run.name={path.stem}"]).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("stem", ["tiny_shakespeare", "tiny_shakespeare_feedback",
                                  "tiny_shakespeare_transformer", "tiny_shakespeare_fixed",
                                  "tiny_shakespeare_carry"])
def test_cpu_configs_share_one_token_budget(stem: str):
    cfg = load_config(Path(CONFIGS[0].parent, f"{stem}.yaml"))
    assert total_tokens(cfg) == CPU_BUDGET_TOKENS
    main = load_config(Path(CONFIGS[0].parent, "tiny_shakespeare.yaml"))
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.max_rel_pos) == (
        main.model.d_model, main.model.n_layers, main.model.max_rel_pos)


def test_main_config_is_the_described_job():
    cfg = load_config(Path(CONFIGS[0].parent, "tiny_shakespeare.yaml"))
    assert cfg.model.kind == "feedback_kv"
    assert [s.seq_len for s in cfg.curriculum] == [32, 64]
    assert Curriculum(cfg).batch_size_at(0) == 32
    assert Curriculum(cfg).batch_size_at(cfg.train.max_steps - 1) == 16
    assert load_config(Path(CONFIGS[0].parent, "tiny_shakespeare_fixed.yaml")).curriculum[0] \
        .seq_len == 64


def test_tiny_config_is_tiny():
    cfg = load_config(Path(CONFIGS[0].parent, "tiny.yaml"))
    assert cfg.model.d_model <= 16 and cfg.train.max_steps <= 30
    assert total_tokens(cfg) < 10_000


def test_the_key_reference_covers_every_section():
    text = markdown_table()
    for key in ("run.name", "model.d_model", "train.lr", "checkpoint.keep_last",
                "logging.tensorboard"):
        assert f"`{key}`" in text


# ----------------------------------------------------------------------------- precedence


def test_defaults_yaml_set_precedence(tmp_path: Path):
    path = write(tmp_path, "model:\n  d_model: 64\n  n_layers: 3\ntrain:\n  lr: 0.005\n")
    default = load_config(None)
    from_file = load_config(path)
    overridden = load_config(path, ["model.n_layers=2", "train.max_steps=7"])

    assert from_file.model.d_model == 64 != default.model.d_model  # YAML beats defaults
    assert from_file.model.n_heads == default.model.n_heads  # untouched keys keep defaults
    assert from_file.model.n_layers == 3
    assert overridden.model.n_layers == 2  # --set beats YAML
    assert overridden.train.max_steps == 7  # --set beats defaults
    assert overridden.model.d_model == 64 and overridden.train.lr == 0.005  # YAML kept


def test_later_set_wins():
    assert load_config(None, ["train.max_steps=5", "train.max_steps=9"]).train.max_steps == 9


def test_empty_yaml_means_defaults(tmp_path: Path):
    assert load_config(write(tmp_path, "# nothing\n")).to_dict() == load_config(None).to_dict()


# ----------------------------------------------------------------------------- --set values


@pytest.mark.parametrize(
    ("override", "get", "expected"),
    [
        ("train.max_steps=12", lambda c: c.train.max_steps, 12),
        ("train.lr=0.0005", lambda c: c.train.lr, 0.0005),
        ("train.lr=5.0e-4", lambda c: c.train.lr, 5e-4),
        ("train.lr=1", lambda c: c.train.lr, 1.0),  # an int is fine where a float is wanted
        ("logging.tensorboard=false", lambda c: c.logging.tensorboard, False),
        ("train.constant_tokens=true", lambda c: c.train.constant_tokens, True),
        ("data.sha256=null", lambda c: c.data.sha256, None),
        ("data.path=", lambda c: c.data.path, None),  # empty value means null
        ("data.path=/tmp/some text.txt", lambda c: c.data.path, "/tmp/some text.txt"),
        ("run.name='007'", lambda c: c.run.name, "007"),  # quoted: unquoted 007 is the int 7
        ("model.kind=transformer", lambda c: c.model.kind, "transformer"),
        ("run.device=cuda:1", lambda c: c.run.device, "cuda:1"),
    ],
)
def test_set_parses_yaml_scalars(override: str, get, expected):
    value = get(load_config(None, [override]))
    assert value == expected and type(value) is type(expected)


def test_set_curriculum_list():
    cfg = load_config(None, ["curriculum=[{until_step: 10, seq_len: 8}, {seq_len: 16}]"])
    assert [(s.seq_len, s.until_step) for s in cfg.curriculum] == [(8, 10), (16, None)]
    assert Curriculum(cfg).seq_len_at(9) == 8 and Curriculum(cfg).seq_len_at(10) == 16


def test_set_curriculum_single_length():
    cfg = load_config(None, ["curriculum=48"])
    assert [(s.seq_len, s.until_step) for s in cfg.curriculum] == [(48, None)]


def test_set_float_without_dot():
    assert load_config(None, ["train.lr=1e-3"]).train.lr == 1e-3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.max_steps", r"--set 'train.max_steps': must look like section.key=value"),
        ("=3", r"must look like section.key=value"),
        ("max_steps=3", r"key must be section.key \(or curriculum\)"),
        ("train.lr.x=3", r"key must be section.key"),
        (".max_steps=3", r"key must be section.key \(or curriculum\); did you mean "
                         r"train.max_steps=3\?"),
        ("train.=3", r"key must be section.key"),
        ("train.lr=[1, 2", r"--set 'train.lr=\[1, 2': value '\[1, 2' is not valid YAML"),
    ],
)
def test_bad_set_syntax(override: str, message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


# ----------------------------------------------------------------------------- problems


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.d_modle=64"],
         r"unknown key model\.d_modle \(did you mean model\.d_model\?\); allowed: kind, "
         r"d_model, n_heads"),
        (["train.max_stpes=5"], r"did you mean train\.max_steps\?"),
        (["modle.d_model=64"],
         r"unknown section modle \(did you mean model\?\); allowed: run, data, model"),
        (["zzz.d_model=64"], r"unknown section zzz; allowed:"),
        (["train.lr=fast"], r"train\.lr = 'fast': must be float"),
        (["train.max_steps=2.5"], r"train\.max_steps = 2\.5: must be int"),
        (["model.n_layers=true"], r"model\.n_layers = True: must be int"),
        (["data.path=[a, b]"], r"data\.path = \['a', 'b'\]: must be str or null"),
        (["model.d_model=130"], r"model\.d_model = 130: must be divisible by n_heads \(4\)"),
        (["train.lr=-0.001"], r"train\.lr = -0\.001: must be > 0"),
        (["train.max_steps=0"], r"train\.max_steps = 0: must be >= 1"),
        (["model.dropout=1.5"], r"model\.dropout = 1\.5: must be <= 0\.9"),
        (["model.max_rel_pos=16", "curriculum=[{seq_len: 32}]"],
         r"curriculum\[0\]\.seq_len = 32: must be <= model\.max_rel_pos \(16\)"),
        # Every kind the registry holds, in its order (none named by hand).
        (["model.kind=rnn"], rf"model\.kind = 'rnn': must be one of {', '.join(KINDS)}$"),
        (["model.kind=feedbak"], rf"must be one of {', '.join(KINDS)} "
                                 r"\(did you mean 'feedback'\?\)"),
        (["run.precision=fp8"], r"run\.precision = 'fp8': must be one of auto, fp32, bf16"),
        (["run.device=tpu"], r"run\.device = 'tpu': must be auto, cpu, cuda or cuda:N"),
        (["train.min_lr=0.1"], r"train\.min_lr = 0\.1: must be <= train\.lr"),
        (["curriculum=[{seq_len: 8}, {seq_len: 16}]"],
         r"curriculum\[0\]\.until_step is missing"),
        (["curriculum=[{until_step: 5, seq_len: 8}, {until_step: 5, seq_len: 16}, "
          "{seq_len: 32}]"], r"curriculum\[1\]\.until_step = 5: must be an integer > 5"),
        (["curriculum=[{seq_len: 8, until: 3}]"], r"unknown key curriculum\[0\]\.until"),
        (["curriculum=[]"], r"curriculum = \[\]: must be a list of stages"),
        (["model=3"], r"--set 'model=3': key must be section.key \(or curriculum\)"),
        (["train.context=carry"],  # the default curriculum has two lengths
         r"train\.context = carry with train\.constant_tokens = true and curriculum lengths "
         r"\[32, 64\]: carried streams keep one batch size"),
        (["train.context=stream"], r"train\.context = 'stream': must be one of reset, carry"),
        (["model.memory_norm=rms"], r"model\.memory_norm = 'rms': must be one of none, "
                                    r"layernorm"),
        (["model.memory_init=zero"], r"model\.memory_init = 'zero': must be one of "
                                     r"uniform, embedding"),
        (["model.kind=transformer", "model.memory_init=embedding"],
         r"model\.memory_init = 'embedding': applies to the feedback kinds only"),
        (["model.position_init=alibi"], r"model\.position_init = 'alibi': must be one of "
                                        r"zero, recency"),
    ],
)
def test_problem_messages(overrides: list[str], message: str):
    found = problems(*overrides)
    assert any(re.search(message, line) for line in found), found
    assert all(line.startswith(("<defaults> (with --set): ", "--set ")) for line in found)


def test_problem_names_the_file(tmp_path: Path):
    path = write(tmp_path, "model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError, match=rf"^{path}: unknown key model\.d_modle "
                       r"\(did you mean model\.d_model\?\)"):
        load_config(path)


def test_missing_file(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"^{missing}: config file not found$"):
        load_config(missing)


def test_unreadable_file(tmp_path: Path):
    path = write(tmp_path, "run: {}\n")
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("running as a user who reads any file")
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read config file: Permission"):
        load_config(path)


@pytest.mark.parametrize(("where", "kind"), [("/dev/zero", "a character device"),
                                             ("/dev/urandom", "a character device"),
                                             ("folder", "a folder"),
                                             ("fifo", "a pipe (FIFO)")])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, where: str, kind: str):
    """/dev/zero took the memory, /dev/urandom never ended, a FIFO waits for a writer: each
    is refused before a byte is read (a subprocess, so a hang is a timeout, not a stuck run)."""
    path = Path(where) if where.startswith("/") else tmp_path / where
    if where == "folder":
        path.mkdir()
    elif where == "fifo":
        os.mkfifo(path)  # no writer ever comes: opening it to read would wait for ever
    if not path.exists():
        pytest.skip(f"{path} does not exist here")
    code = ("import sys; from fbtrain.config import ConfigError, load_config\n"
            "try:\n    load_config(sys.argv[1])\nexcept ConfigError as e:\n    print(e)\n")
    result = bounded_run([sys.executable, "-c", code, str(path)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"{path}: is {kind}, not a config file; --config takes a YAML "
                             "file\n")


def test_a_config_file_over_one_mib_is_refused_unparsed(tmp_path: Path):
    """A 100 MB text took 112 s to be refused; now its size alone refuses it."""
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:
        f.truncate(100 * 2**20)  # sparse: 100 MiB of nothing, made at once
    with pytest.raises(ConfigError, match=rf"^{path}: 100\.0 MiB is too big for a config file "
                       r"\(at most 1\.0 MiB; a config is a few KiB\): is it the right file\?$"):
        load_config(path)
    path.write_text("run: {name: x}\n# " + "x" * (2**20 - 20) + "\n", encoding="utf-8")
    assert len(path.read_bytes()) <= 2**20 and load_config(path).run.name == "x"


def test_not_utf8(tmp_path: Path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read config file"):
        load_config(path)


def test_malformed_yaml_gives_line(tmp_path: Path):
    path = write(tmp_path, "model:\n  d_model: 64\n  n_heads: [4\ntrain:\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match=rf"^{path}: line \d+, column \d+: malformed YAML"):
        load_config(path)
    path = write(tmp_path, "model:\n  d_model: 64\n n_heads: 4\n", "indent.yaml")
    with pytest.raises(ConfigError, match=r"line 3, column 2: malformed YAML"):
        load_config(path)


def test_top_level_must_be_mapping(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_config(write(tmp_path, "- just\n- a list\n"))


def test_section_must_be_mapping(tmp_path: Path):
    path = write(tmp_path, "model: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}: model = 3: must be a mapping of keys"):
        load_config(path)


def test_every_problem_reported_at_once(tmp_path: Path):
    path = write(tmp_path, "\n".join([
        "modle: {}",                      # unknown section
        "model:",
        "  d_modle: 64",                  # unknown key
        "  kind: rnn",                    # bad choice
        "  n_heads: 3",                   # 128 % 3 != 0
        "train:",
        "  lr: fast",                     # wrong type
        "  max_steps: 0",                 # below minimum
        "curriculum: [{seq_len: 8192}]",  # above max_rel_pos
        "",
    ]))
    found = problems(path=path)
    assert len(found) == 7, found
    assert all(line.startswith(f"{path}: ") for line in found)
    for fragment in ("unknown section modle", "unknown key model.d_modle", "model.kind = 'rnn'",
                     "model.d_model = 128: must be divisible by n_heads (3)",
                     "train.lr = 'fast'", "train.max_steps = 0",
                     "curriculum[0].seq_len = 8192"):
        assert sum(fragment in line for line in found) == 1, (fragment, found)


def test_set_problems_reported_together():
    found = problems("model.d_modle=64", "train.lr=-1.0", "model.kind=rnn")
    for fragment in ("model.d_modle", "train.lr = -1.0: must be > 0", "model.kind = 'rnn'"):
        assert sum(fragment in line for line in found) == 1, (fragment, found)


def test_defaults_are_the_main_job_but_for_the_position_table_size():
    """`fbtrain train` without --config trains the main job's model and schedule; only
    max_rel_pos keeps the general default (4096) that the main job trims to its length."""
    main = load_config(Path(CONFIGS[0].parent, "tiny_shakespeare.yaml")).to_dict()
    defaults = load_config(None).to_dict()
    assert defaults["model"].pop("max_rel_pos") == 4096
    assert main["model"].pop("max_rel_pos") == 64
    assert defaults == main


def test_set_keeps_text_fields_as_written():
    assert load_config(None, ["run.name=007"]).run.name == "007"


# ----------------------------------------------------------------------------- numbers


FLOAT_KEYS = [f"{name}.{f.name}" for name, cls in SECTIONS.items()
              for f in dataclasses.fields(cls)
              if float in typing.get_args(typing.get_type_hints(cls)[f.name])
              or typing.get_type_hints(cls)[f.name] is float]
INT_KEYS = [f"{name}.{f.name}" for name, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)
            if int in typing.get_args(typing.get_type_hints(cls)[f.name])
            or typing.get_type_hints(cls)[f.name] is int]


def test_every_float_key_refuses_nan_and_infinity():
    assert {"train.lr", "train.min_lr", "train.beta1", "train.beta2", "model.dropout",
            "train.grad_clip", "data.val_fraction"} <= set(FLOAT_KEYS)
    for value in (".nan", ".inf", "-.inf", "1e400"):
        found = problems(*(f"{key}={value}" for key in FLOAT_KEYS))
        for key in FLOAT_KEYS:
            hits = [line for line in found if f" {key} = " in line]
            assert len(hits) == 1 and hits[0].endswith(
                ": must be a finite number (not NaN or infinity)"), (key, value, found)


def test_every_int_key_refuses_values_beyond_int64():
    assert {"run.seed", "train.max_steps", "model.d_model"} <= set(INT_KEYS)
    for value in (2**63, -(2**63) - 1, 99999999999999999999):
        found = problems(*(f"{key}={value}" for key in INT_KEYS))
        for key in INT_KEYS:
            hits = [line for line in found if f" {key} = " in line]
            assert len(hits) == 1 and "must fit in a 64-bit integer" in hits[0], (key, found)
    assert load_config(None, [f"run.seed={2**63 - 1}"]).run.seed == 2**63 - 1


def test_curriculum_refuses_values_beyond_int64():
    found = problems(f"curriculum=[{{until_step: {2**64}, seq_len: 8}}, {{seq_len: {2**64}}}]")
    assert any("curriculum[0].until_step = 18446744073709551616" in line for line in found)
    assert any("curriculum[1].seq_len = 18446744073709551616" in line for line in found)


def test_nan_in_a_file_is_named_with_the_file(tmp_path: Path):
    path = write(tmp_path, "train:\n  lr: .nan\n  beta1: .nan\nmodel:\n  dropout: .nan\n"
                           "run:\n  seed: 99999999999999999999\n")
    found = problems(path=path)
    assert sorted(found) == sorted([
        f"{path}: train.lr = nan: must be a finite number (not NaN or infinity)",
        f"{path}: train.beta1 = nan: must be a finite number (not NaN or infinity)",
        f"{path}: model.dropout = nan: must be a finite number (not NaN or infinity)",
        f"{path}: run.seed = 99999999999999999999: must fit in a 64-bit integer "
        f"({-(2**63)} to {2**63 - 1})",
    ])


# ----------------------------------------------------------------------------- messages


def test_duplicate_keys_are_refused_naming_both_lines(tmp_path: Path):
    path = write(tmp_path, "train:\n  lr: 0.1\n  max_steps: 5\n  lr: 0.2\nmodel: {}\n"
                           "model:\n  d_model: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"{path}: duplicate key 'lr' at line 4 (first given at line 2); give each key once",
        f"{path}: duplicate key 'model' at line 6 (first given at line 5); give each key once",
    ]


def test_a_bad_section_in_the_file_is_blamed_on_the_file(tmp_path: Path):
    path = write(tmp_path, "run: 5\n")
    found = problems("run.name=x", "train.lr=-1", path=path)
    assert f"{path}: run = 5: must be a mapping of keys to values" in found, found
    assert not any(line.startswith("--set") for line in found), found
    assert f"{path} (with --set): train.lr = -1.0: must be > 0" in found, found


def test_val_fraction_message_gives_the_real_limits():
    found = problems("data.val_fraction=.nan")
    assert found == ["<defaults> (with --set): data.val_fraction = nan: must be a finite "
                     "number (not NaN or infinity)"]
    from fbtrain.data.errors import DataError
    from fbtrain.data.streams import split

    with pytest.raises(DataError, match=r"^data.val_fraction = 0.7: must be > 0 and <= 0.5$"):
        split(torch.arange(100), 0.7)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_total_tokens_is_the_sum_over_steps(path: Path):
    cfg = load_config(path)
    assert Curriculum(cfg).total_tokens() == total_tokens(cfg) * cfg.train.grad_accum
    short = load_config(path, ["train.max_steps=7", "train.grad_accum=3",
                               "curriculum=[{until_step: 5, seq_len: 8}, {until_step: 9, "
                               "seq_len: 16}, {seq_len: 32}]", "model.max_rel_pos=64"])
    assert Curriculum(short).total_tokens() == total_tokens(short) * 3


def test_curriculum_stages_by_step():
    """A stage holds the steps before its until_step; the last one every step after."""
    cfg = load_config(None, ["curriculum=[{until_step: 3, seq_len: 8}, {until_step: 5, "
                             "seq_len: 16}, {seq_len: 32}]", "train.batch_size=2"])
    plan = Curriculum(cfg)
    assert [plan.stage_index_at(s) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    assert plan.stage_at(4) is cfg.curriculum[1]
    assert [plan.batch_size_at(s) for s in (0, 3, 5)] == [8, 4, 2]  # 64 tokens a step
    assert plan.max_seq_len == 32


def test_the_config_and_the_cli_load_without_torch():
    """``fbtrain --help`` and config checking never import torch (seconds at start-up):
    the memory estimate plans with fbtrain.config.curriculum.Curriculum, which must not
    import torch."""
    code = ("import sys, fbtrain.cli, fbtrain.config.budget; "
            "from fbtrain.config import load_config; load_config(None); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_config_knows_the_built_in_datasets():
    """config keeps only the names of the built-in corpora (it must not import the data
    layer); they must be those fbtrain/data/sources.py fetches."""
    from fbtrain.config import schema
    from fbtrain.data.sources import ARCHIVED, SOURCES

    assert tuple(SOURCES) == schema.DOWNLOADED
    assert schema.ARCHIVED == ARCHIVED


# ----------------------------------------------------------------------------- memory


GIB = 2**30


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> int:
    """This machine has 24 GiB, whatever it really has (messages quote the figure)."""
    from fbtrain.config import budget

    monkeypatch.setattr(budget, "physical_memory", lambda: 24 * GIB)
    return 24 * GIB


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.d_model=1048576"],
         r"model\.d_model = 1048576: training needs at least 160\.4 TiB of memory \(weights, "
         r"gradients and AdamW state: 160\.3 TiB\) but this machine has 24\.0 GiB; make it "
         r"smaller$"),
        (["model.max_rel_pos=1000000000000"],
         r"model\.max_rel_pos = 1000000000000: training needs at least 7\.5 PiB .*AdamW state"),
        (["model.d_ff=100000000000"], r"model\.d_ff = 100000000000: training needs at least "),
        (["model.n_layers=1000000000"], r"model\.n_layers = 1000000000: training needs "),
        (["train.batch_size=1000000000000"],
         r"train\.batch_size = 1000000000000: training needs at least 1\.4 EiB of memory "
         r"\(activations of one micro-batch: 1\.4 EiB\)"),
        # Every micro-batch of a step is drawn before the first forward.
        (["train.grad_accum=1000000000"],
         r"train\.grad_accum = 1000000000: training needs at least 15\.1 TiB of memory "
         r"\(token windows of one step's 1,000,000,000 micro-batches: 15\.1 TiB\)"),
        # With carried memory every one of batch_size x grad_accum streams keeps a window.
        (["train.context=carry", "train.constant_tokens=false",
          "train.grad_accum=1000000000"],
         r"train\.grad_accum = 1000000000: .*\(carried memory of train\.batch_size x "
         r"train\.grad_accum = 16,000,000,000 streams: 89\.4 PiB\)"),
        (["model.d_model=16384", "model.n_layers=64"],
         r"model\.d_model = 16384, model\.n_layers = 64: training needs at least 624\.5 GiB"
         r".*; make them smaller$"),
        (["curriculum=100000", "model.max_rel_pos=100000"],
         r"curriculum\[0\]\.seq_len = 100000, model\.max_rel_pos = 100000: training needs "),
        # The transformer keeps each position's probabilities over the slots it sees, as
        # the feedback models do: the window caps them.
        (["model.kind=transformer", "curriculum=65536", "model.max_rel_pos=65536"],
         r"curriculum\[0\]\.seq_len = 65536, model\.max_rel_pos = 65536: training needs at "
         r"least 1\.0 TiB of memory \(activations of one micro-batch: 1\.0 TiB\)"),
    ],
)
def test_sizes_that_cannot_fit_in_memory_are_refused(machine: int, overrides: list[str],
                                                     message: str):
    found = problems(*overrides)
    assert len(found) == 1, found
    assert re.search(r"^<defaults> \(with --set\): " + message, found[0]), found


def test_what_fits_is_not_refused(monkeypatch: pytest.MonkeyPatch, machine: int):
    """The estimate is held against the memory there is, and nothing else: the config
    refused on 24 GiB loads on a machine with more than it needs."""
    from fbtrain.config import budget

    sets = ["model.d_model=8192", "model.n_layers=8"]
    assert "training needs" in problems(*sets)[0]
    cfg = load_config(None)
    need = budget.estimate(dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, d_model=8192, n_layers=8))).total
    assert need > machine
    monkeypatch.setattr(budget, "physical_memory", lambda: need)
    assert load_config(None, sets).model.d_model == 8192


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("memory_norm", ["none", "layernorm"])
def test_parameter_count_is_the_models_but_for_the_vocabulary(kind: str, memory_norm: str):
    from fbtrain.config.budget import parameter_count
    from fbtrain.models import build_model

    cfg = load_config(None, [f"model.kind={kind}", f"model.memory_norm={memory_norm}",
                             "model.d_model=24", "model.n_heads=3", "model.d_ff=40",
                             "model.n_layers=3", "model.max_rel_pos=17",
                             "curriculum=16"]).model
    vocab = 11
    model = build_model(cfg, vocab)
    by_vocabulary = 2 * vocab * cfg.d_model + vocab  # embedding, head weight and bias
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters()) - by_vocabulary


ESTIMATE_FLOOR = 0.73  # of the bytes kept; measured 0.741 at the lowest (feedback, 2 heads)


def kept_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes a forward keeps for its backward, parameters aside: what autograd saves, and
    what the feedback core's autograd node holds itself (its buffers and tape)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def note(t: object) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(t, (list, tuple)):
            for item in t:
                note(item)
        elif dataclasses.is_dataclass(t):
            for f in dataclasses.fields(t):
                note(getattr(t, f.name))

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(x)
    todo, seen = [logits.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in ("buffers", "tape"):  # FeedbackCoreFunction's own
            note(getattr(node, name, None))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return sum(storages.values())


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("heads", "seq_len", "window"), [(2, 12, 8), (8, 24, 24)])
def test_activation_estimate_is_a_lower_bound(monkeypatch: pytest.MonkeyPatch, kind: str,
                                              heads: int, seq_len: int, window: int):
    """Never refuse what fits: the estimate of one micro-batch's activations stays below what
    a forward really keeps for its backward (the PyTorch core's tape: the C++ core keeps
    the same tensors). And it is no loose bound: it counts 74-85% of those bytes at these
    sizes (the rest is small tensors it leaves out), so a term dropped from it or halved
    falls below the floor."""
    from fbtrain.config.budget import estimate
    from fbtrain.models import build_model
    from fbtrain.models.core.select import CORE_ENV

    monkeypatch.setenv(CORE_ENV, "python")
    cfg = load_config(None, [f"model.kind={kind}", "model.d_model=32", f"model.n_heads={heads}",
                             "model.d_ff=48", "model.n_layers=2", f"model.max_rel_pos={seq_len}",
                             f"model.mem_len={window}",
                             "train.batch_size=3", f"curriculum={seq_len}",
                             "run.precision=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 5)
    x = torch.randint(0, 5, (3, seq_len))
    kept = kept_bytes(model, x)
    assert ESTIMATE_FLOOR * kept <= estimate(cfg).activations <= kept


# ----------------------------------------------------------------------------- YAML limits


def alias_bomb(levels: int = 9) -> str:
    """``a: &a [x, ... x]``, ``b: &b [*a, ... *a]``, ...: 9 ** levels strings in ~400 bytes."""
    lines = [f"a: &a [{', '.join(['x'] * 9)}]"]
    names = "abcdefghijklmnopqrstuvwxyz"
    for previous, name in zip(names[:levels - 1], names[1:levels], strict=True):
        lines.append(f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path: Path):
    path = write(tmp_path, alias_bomb() + "curriculum: *i\n")
    assert len(path.read_bytes()) < 500
    assert problems(path=path) == [
        f"{path}: the YAML expands to more than 100,000 values through its aliases (each "
        "*name repeats everything &name anchors); a config holds a few dozen: write the "
        "values out instead"]
    # The same anchors in one --set value (a flow list of the lists).
    flow = "[" + ", ".join(line.split(": ", 1)[1] for line in alias_bomb().splitlines()) + "]"
    found = problems(f"curriculum={flow}")
    assert len(found) == 1 and found[0].endswith(
        ": the value expands to more than 100,000 values through its aliases (each *name "
        "repeats everything &name anchors); a config holds a few dozen: write the values out "
        "instead"), found
    assert found[0].startswith("--set 'curriculum=[") and len(found[0]) < 300
    # A self-referencing anchor expands without end.
    assert "expands to more than" in problems(path=write(tmp_path, "run: &r {name: *r}\n",
                                                         "loop.yaml"))[0]


def test_messages_print_at_most_a_few_dozen_characters_of_a_value(tmp_path: Path):
    path = write(tmp_path, alias_bomb(4) + "run:\n  name: *d\ntrain:\n  lr: [" +
                 ", ".join(map(str, range(1000))) + "]\n")
    found = problems(path=path)
    name = next(line for line in found if "run.name" in line)
    assert name.startswith(f"{path}: run.name = [[[") and name.endswith("...: must be str")
    lr = next(line for line in found if "train.lr" in line)
    assert lr == f"{path}: train.lr = [0, 1, 2, 3, 4, 5, ...]: must be float"
    assert max(len(line) - len(str(path)) for line in found) < 200, found
    long_key = "k" * 1000
    assert all(len(line) < 300 for line in problems(f"model.{long_key}=1"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run:\n  name: " + "[" * 600 + "]" * 600 + "\n",
         r"malformed YAML: lists or mappings nested too deeply"),
        ("run:\n  seed: 2024-13-45\n",  # a date YAML cannot build
         r"malformed YAML: a value cannot be read: month must be in 1\.\.12"),
        ("run:\n  seed: " + "9" * 5000 + "\n",
         r"malformed YAML: a value cannot be read: Exceeds the limit \(4300 digits\)"),
    ],
)
def test_yaml_the_loader_cannot_build_is_one_line(tmp_path: Path, text: str, message: str):
    path = write(tmp_path, text)
    found = problems(path=path)
    assert len(found) == 1 and re.match(rf"{re.escape(str(path))}: {message}", found[0]), found
    found = problems(f"run.seed={text.split(': ', 1)[1].strip()}")
    assert len(found) == 1 and re.search(message, found[0]), found


# ----------------------------------------------------------------------------- cross checks


@pytest.mark.parametrize("key", ["path", "url"])
def test_algorithmic_refuses_a_file_or_address(key: str):
    found = problems("data.dataset=algorithmic", f"data.{key}=/tmp/corpus.txt")
    assert found == [f"<defaults> (with --set): data.{key} = '/tmp/corpus.txt': does not apply "
                     "to data.dataset = algorithmic (its programs are generated from "
                     "data.seed); remove the key, or name another dataset"]


@pytest.mark.parametrize("extra", [[], ["train.context=carry"], ["model.max_rel_pos=16"]])
def test_a_curriculum_problem_is_the_only_one_reported_about_it(extra: list[str]):
    """The default curriculum stands in for a broken one; nothing is checked against it."""
    assert problems("curriculum=[{seq_len: 8.5}]", *extra) == [
        "<defaults> (with --set): curriculum[0].seq_len = 8.5: must be an integer >= 1 (at "
        f"most {2**63 - 1})"]


def test_curriculum_keys_of_mixed_types_are_named():
    found = problems("curriculum=[{seq_len: 8, 1: 2, b: 3}]")
    assert found == ["<defaults> (with --set): unknown key curriculum[0].1; allowed: seq_len, "
                     "until_step"]


# ----------------------------------------------------------------------------- text fields


@pytest.mark.parametrize("text", ["2024-06-01", "007", "yes", "1e3", "0x1F", "12:30",
                                  "2024-06-01 10:00:00", "1_000"])
def test_text_fields_keep_the_text_written(tmp_path: Path, text: str):
    path = write(tmp_path, f"run:\n  name: {text}\n  out_dir: {text}\ndata:\n  path: {text}\n")
    cfg = load_config(path)
    assert (cfg.run.name, cfg.run.out_dir, cfg.data.path) == (text, text, text)
    assert load_config(None, [f"run.name={text}"]).run.name == text


def test_a_text_field_keeps_its_text_without_changing_an_alias_of_it(tmp_path: Path):
    cfg = load_config(write(tmp_path, "train:\n  max_steps: &n 1_000\nrun:\n  name: *n\n"))
    assert (cfg.run.name, cfg.train.max_steps) == ("1_000", 1000)


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(("key", "text", "why"), [
    ("train.max_steps", "010", "YAML 1.1 would read 010 as the octal 8; write it without the "
                               "leading 0"),
    ("train.max_steps", "-07", "YAML 1.1 would read -07 as the octal -7; write it without the "
                               "leading 0"),
    ("train.eval_every", "09", "write it without the leading 0"),
    ("train.max_steps", "1:30", "YAML 1.1 would read 1:30 in base 60, as 90; write it as one "
                                "decimal number"),
    ("run.seed", "1:00:00", "YAML 1.1 would read 1:00:00 in base 60, as 3600; write it as one "
                            "decimal number"),
    ("train.lr", "1:30.5", "YAML 1.1 would read 1:30.5 in base 60, as 90.5; write it as one "
                           "decimal number"),
])
def test_numbers_are_decimal_or_refused(tmp_path: Path, key: str, text: str, why: str):
    """YAML 1.1 read --set train.max_steps=010 as 8 and 1:00:00 as 3600, silently."""
    section, name = key.split(".")
    must = "float" if name == "lr" else "int"
    line = f"{key} = {text!r}: must be {must}; numbers are read in decimal"
    line += f": {why}" if why.startswith("YAML") else f"; {why}"
    assert problems(f"{key}={text}") == [f"<defaults> (with --set): {line}"]
    path = write(tmp_path, f"{section}:\n  {name}: {text}\n")
    assert problems(path=path) == [f"{path}: {line}"]


def test_curriculum_numbers_are_decimal_too():
    assert problems("curriculum=[{seq_len: 010}]") == [
        "<defaults> (with --set): curriculum[0].seq_len = '010': must be an integer >= 1 (at "
        f"most {2**63 - 1}); numbers are read in decimal: YAML 1.1 would read 010 as the octal "
        "8; write it without the leading 0"]


def test_decimal_hex_binary_and_underscores_still_read(tmp_path: Path):
    cfg = load_config(None, ["train.max_steps=1_000", "train.warmup_steps=0x10",
                             "train.eval_every=0b11", "run.seed=-0", "train.lr=010.5",
                             "train.min_lr=+1.5e-3", "curriculum=[{seq_len: 0x20}]",
                             "train.weight_decay=0"])  # lr x weight_decay must be < 1
    assert (cfg.train.max_steps, cfg.train.warmup_steps, cfg.train.eval_every, cfg.run.seed,
            cfg.train.lr, cfg.train.min_lr, cfg.curriculum[0].seq_len) == (
        1000, 16, 3, 0, 10.5, 1.5e-3, 32)
    # A text field keeps a text that is no number (or would have been one in base 60).
    assert load_config(None, ["run.name=1:30", "data.path=010"]).run.name == "1:30"


# ----------------------------------------------------------------------------- merge keys


def test_merge_keys_merge_and_the_mapping_overrides(tmp_path: Path):
    """``<<: *anchor`` failed with "could not determine a constructor for the tag merge"."""
    path = write(tmp_path, "model: &m {d_model: 16, n_heads: 2}\n"
                           "run:\n  <<: {name: 007, seed: 5}\n  seed: 9\n"
                           "curriculum:\n  - &s {seq_len: 8, until_step: 2}\n"
                           "  - {<<: *s, until_step: null, seq_len: 16}\n"
                           "train:\n  <<: [{lr: 0.1}, {max_steps: 7}]\n")
    cfg = load_config(path)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.run.name, cfg.run.seed) == (16, 2, "007", 9)
    assert [(s.seq_len, s.until_step) for s in cfg.curriculum] == [(8, 2), (16, None)]
    assert (cfg.train.lr, cfg.train.max_steps) == (0.1, 7)
    # A key given twice in the mapping itself is still a duplicate, merge or not.
    twice = write(tmp_path, "run:\n  <<: {seed: 5}\n  seed: 9\n  seed: 10\n", "twice.yaml")
    assert problems(path=twice) == [f"{twice}: duplicate key 'seed' at line 4 (first given at "
                                    "line 3); give each key once"]
    bad = write(tmp_path, "run:\n  <<: 3\n", "bad.yaml")
    assert problems(path=bad) == [f"{bad}: line 2, column 7: malformed YAML: expected a mapping "
                                  "or list of mappings for merging, but found scalar"]


def test_merge_keys_stay_under_the_alias_limit(tmp_path: Path):
    """Merges of merges repeat what they merge: the same bound as any alias."""
    lines = ["a: &a {" + ", ".join(f"k{i}: {i}" for i in range(9)) + "}"]
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} {{<<: [{', '.join(['*' + previous] * 9)}]}}")
    path = write(tmp_path, "\n".join(lines) + "\nrun:\n  <<: *i\n")
    assert problems(path=path) == [
        f"{path}: the YAML expands to more than 100,000 values through its aliases (each "
        "*name repeats everything &name anchors); a config holds a few dozen: write the "
        "values out instead"]


def test_text_fields_still_take_null_and_quotes(tmp_path: Path):
    path = write(tmp_path, "run:\n  name: '2024'\ndata:\n  path: null\n  url: ~\n"
                           "  cache_dir:\n  sha256: \"auto\"\n")
    cfg = load_config(path)
    assert (cfg.run.name, cfg.data.path, cfg.data.url, cfg.data.cache_dir, cfg.data.sha256) == (
        "2024", None, None, None, "auto")
    assert problems(path=write(tmp_path, "run:\n  name: null\n", "null.yaml")) == [
        f"{tmp_path / 'null.yaml'}: run.name = None: must be str"]


@pytest.mark.parametrize("name", ["''", ".", "..", "../x", "a/b", "/tmp/run", "a\\b",
                                  '"a\\0b"', "x/", '"a\\nb"', '"a\\x1b[31mb"',
                                  '"a\\u2028b"'])
def test_run_name_is_one_folder_name(name: str):
    found = problems(f"run.name={name}")
    assert len(found) == 1 and re.match(
        r"<defaults> \(with --set\): run\.name = .*: must be a plain folder name \(one path "
        r"component: not empty, '\.' or '\.\.', no / or \\ or control character\); the run "
        r"directory is <run\.out_dir>/<run\.name>, so put the path in run\.out_dir$",
        found[0]), found
    assert len(found[0].splitlines()) == 1  # a newline in the name does not split it
    assert load_config(None, ["run.name=a.b-c_d e"]).run.name == "a.b-c_d e"
    assert load_config(None, ["run.name=é 日本"]).run.name == "é 日本"


def test_stages_training_never_reaches_are_not_counted(machine: int):
    """max_steps ends training in the first stage: the second's length needs no memory."""
    sets = ["model.max_rel_pos=1000000", "model.mem_len=64", "train.constant_tokens=false",
            "train.max_steps=10"]
    stages = "curriculum=[{until_step: 10, seq_len: 64}, {seq_len: 1000000}]"
    assert Curriculum(load_config(None, [*sets, stages])).max_seq_len == 1000000
    assert "curriculum[1].seq_len = 1000000" in problems(*sets[:3], stages)[0]


# ----------------------------------------------------------------------------- integer bounds


@pytest.mark.parametrize(("command", "flag", "name"), [
    ("sample", "--seed", "seed"), ("sample", "--num-samples", "num_samples"),
    ("sample", "--length", "length"), ("sample", "--top-k", "top_k"),
    ("eval", "--seq-len", "seq_len"), ("eval", "--batch-size", "batch_size"),
])
@pytest.mark.parametrize("value", [2**63, 2**64])
def test_integer_flags_past_64_bits_name_the_bound_exceeded(command: str, flag: str, name: str,
                                                            value: int):
    """--seed 18446744073709551616 said "must be an integer >= 0", a bound it meets."""
    from typer.testing import CliRunner

    from fbtrain.cli import app

    result = CliRunner().invoke(app, [command, "-c", "nowhere", flag, str(value)])
    assert result.exit_code == 2
    assert result.stderr.endswith(f"{name} = {value}: must be at most {2**63 - 1} (2**63 - 1)\n")
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("key", ["run.seed", "train.max_steps", "data.seed", "model.d_model"])
def test_integer_keys_past_64_bits_name_the_bound(key: str):
    assert problems(f"{key}={2**64}") == [
        f"<defaults> (with --set): {key} = {2**64}: must fit in a 64-bit integer "
        f"({-2**63} to {2**63 - 1})"]
