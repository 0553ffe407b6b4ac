"""Config: every shipped YAML validates; defaults < YAML < --set; each problem is reported
in one line that names the file, key, value and what is allowed."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import torch

from fbtrain.config import SECTIONS, Config, ConfigError, describe_fields, load_config

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
    return sum(cfg.batch_size_at(s) * cfg.seq_len_at(s) for s in range(cfg.train.max_steps))


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
    assert cfg.max_seq_len <= cfg.model.max_rel_pos
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
    assert cfg.batch_size_at(0) == 32 and cfg.batch_size_at(cfg.train.max_steps - 1) == 16
    assert load_config(Path(CONFIGS[0].parent, "tiny_shakespeare_fixed.yaml")).curriculum[0] \
        .seq_len == 64


def test_tiny_config_is_tiny():
    cfg = load_config(Path(CONFIGS[0].parent, "tiny.yaml"))
    assert cfg.model.d_model <= 16 and cfg.train.max_steps <= 30
    assert total_tokens(cfg) < 10_000


def test_describe_fields_covers_every_section():
    text = describe_fields()
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
    assert cfg.seq_len_at(9) == 8 and cfg.seq_len_at(10) == 16


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
        (["model.kind=rnn"],
         r"model\.kind = 'rnn': must be one of feedback, feedback_kv, transformer$"),
        (["model.kind=feedbak"], r"must be one of feedback, feedback_kv, transformer "
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
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read config file"):
        load_config(tmp_path)  # a directory


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
    from fbtrain.data import DataError, split

    with pytest.raises(DataError, match=r"^data.val_fraction = 0.7: must be > 0 and <= 0.5$"):
        split(torch.arange(100), 0.7)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_total_tokens_is_the_sum_over_steps(path: Path):
    cfg = load_config(path)
    assert cfg.total_tokens() == total_tokens(cfg) * cfg.train.grad_accum
    short = load_config(path, ["train.max_steps=7", "train.grad_accum=3",
                               "curriculum=[{until_step: 5, seq_len: 8}, {until_step: 9, "
                               "seq_len: 16}, {seq_len: 32}]", "model.max_rel_pos=64"])
    assert short.total_tokens() == total_tokens(short) * 3
