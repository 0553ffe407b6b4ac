"""Command line: ``fbtrain train | sample | eval | export``.

Thin on purpose (as torchtitan's ``train.py`` and litgpt's ``__main__.py``): each command
parses its flags, calls one ``run()`` and maps the errors a user can cause to one line on
stderr and an exit code. Nothing else happens here.

Exit codes and the one-line errors: :mod:`fbtrain.cli_errors`; the flags several commands
share and the callbacks that check them: :mod:`fbtrain.cli_options`.

Heavy modules (torch and everything that imports it) are imported inside the commands, so
``fbtrain --help`` and ``fbtrain --version`` answer at once.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from fbtrain import __version__
from fbtrain.cli_errors import OneLineErrors, fail, user_errors
from fbtrain.cli_options import (
    CheckpointOption,
    Context,
    DeviceOption,
    PrecisionOption,
    Split,
    count_rule,
    sampling_rule,
)
from fbtrain.messages import format_bytes
from fbtrain.startup import prepare_process


def _examples(*lines: str) -> str:
    """An epilog of example commands, kept verbatim (click's ``\\b`` stops rewrapping)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


app = typer.Typer(
    name="fbtrain",
    cls=OneLineErrors,
    epilog=_examples(
        "# the main job: 1.5M tokens; its status line shows the ETA",
        "fbtrain train --config configs/tiny_shakespeare.yaml   # download, train",
        "fbtrain sample --checkpoint runs/tiny_shakespeare      # generate text",
        "fbtrain eval --checkpoint runs/tiny_shakespeare        # bits per character",
        "fbtrain export -c runs/tiny_shakespeare -o exports/ts  # weights to share",
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # real bugs keep a plain traceback
    rich_markup_mode=None,  # help text is printed as written: no [markup] eaten
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"fbtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True,
                     help="Print the version and exit."),
    ] = False,
) -> None:
    """Train Feedback Transformers (Fan et al. 2020) on Tiny Shakespeare, then sample from
    them and evaluate them. Run `fbtrain COMMAND --help` for a command's flags.
    """


@app.command(
    epilog=_examples(
        "fbtrain train --config configs/tiny_shakespeare.yaml",
        "fbtrain train --config configs/tiny_shakespeare.yaml --resume auto",
        "fbtrain train --config configs/tiny.yaml --set data.path=input.txt \\",
        "    --set train.max_steps=100 --set 'curriculum=[{seq_len: 32}]'",
        "fbtrain train --config configs/gpu.yaml --device cuda:1",
        "fbtrain train --config configs/tiny.yaml --print-config",
        "fbtrain train --list-keys",
    ),
)
def train(
    config: Annotated[
        str | None,
        typer.Option("--config", metavar="FILE", show_default=False,
                     help="YAML config (see configs/). Without it the built-in defaults "
                     "are used."),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", metavar="SECTION.KEY=VALUE", show_default=False,
                     help="Override one config key; repeatable. VALUE is read as YAML "
                     "(1e-3, true, null, [1, 2]). Precedence: defaults < --config < --set."),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", metavar="auto|PATH", show_default=False,
                     help="Continue a run: auto (this run's last.pt, else its newest "
                     "checkpoint that loads; afresh if it saved none) or a checkpoint file / "
                     "run directory."),
    ] = None,
    device: DeviceOption = None,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="Print only the one-line summary at the end "
                     "(and errors); no progress, no evaluation lines."),
    ] = False,
    print_config: Annotated[
        bool,
        typer.Option("--print-config",
                     help="Print the resolved config as YAML and exit without training."),
    ] = False,
    list_keys: Annotated[
        bool,
        typer.Option("--list-keys",
                     help="List every config key with its default and meaning, and exit "
                     "(the same as docs/configuration.md)."),
    ] = False,
) -> None:
    """Train a model from a config.

    Downloads (or reads) the text, tokenizes it, then trains, evaluates and checkpoints into
    <run.out_dir>/<run.name>/ (config.yaml, vocab.json, metrics.jsonl, history.jsonl,
    checkpoints/, TensorBoard events: training's in the folder itself, validation's in val/).
    A run that already has checkpoints is continued only with --resume, never overwritten.
    """
    if list_keys:
        from fbtrain.config.reference import text_table

        typer.echo(text_table())
        return
    overrides = list(overrides or [])
    if device is not None:
        overrides.append(f"run.device={device}")
    with user_errors():
        from fbtrain.config import load_config

        cfg = load_config(config, overrides)
        if print_config:
            if cfg.run.device not in ("auto", "cpu"):  # refused here as train refuses it
                from fbtrain.device import resolve_device

                resolve_device(cfg.run.device)
            import yaml

            typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False), nl=False)
            return
        from fbtrain import train as trainer
        from fbtrain.checkpoint import CheckpointError
        from fbtrain.config import ConfigError

        if config is None and not quiet:  # forgetting --config is the newcomer's slip
            typer.echo(f"note: no --config given: training the built-in defaults into "
                       f"{cfg.run.out_dir}/{cfg.run.name}", err=True)
        try:
            trainer.run(cfg, resume=resume, quiet=quiet)
        except (ConfigError, CheckpointError) as e:  # a refusal about the run directory
            if config is None:
                from fbtrain.rundir_names import CONFIG

                raise ConfigError([f"{e} (no --config was given: these are the built-in "
                                   f"defaults; the run's own settings are in "
                                   f"{cfg.run.out_dir}/{cfg.run.name}/{CONFIG})"]) from None
            raise


@app.command(
    epilog=_examples(
        "fbtrain sample --checkpoint runs/tiny_shakespeare",
        "fbtrain sample -c runs/tiny_shakespeare/checkpoints/last.pt \\",
        "    --prompt 'ROMEO:' --length 300 --temperature 0.7 --top-k 20 \\",
        "    --num-samples 3",
    ),
)
def sample(
    checkpoint: CheckpointOption,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", metavar="TEXT",
                     show_default="a newline; END for a word vocabulary",
                     help="Text to continue; every character (word, for a word vocabulary) "
                     "must be in the vocabulary."),
    ] = None,
    length: Annotated[
        int,
        typer.Option("--length", "-n", metavar="N", callback=sampling_rule("length"),
                     help="Tokens to generate per sample: characters (bytes for enwik8, "
                          "words for algorithmic programs)."),
    ] = 500,
    temperature: Annotated[
        float,
        typer.Option("--temperature", "-t", metavar="T",
                     callback=sampling_rule("temperature"),
                     help="Softmax temperature: lower is more conservative."),
    ] = 0.8,
    top_k: Annotated[
        int | None,
        typer.Option("--top-k", metavar="K", callback=sampling_rule("top_k"), show_default=False,
                     help="Sample only from the K most likely characters."),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option("--top-p", metavar="P", show_default=False, callback=sampling_rule("top_p"),
                     help="Nucleus sampling: the smallest set of characters whose "
                     "probability adds up to P (0 < P <= 1)."),
    ] = None,
    num_samples: Annotated[
        int, typer.Option("--num-samples", metavar="N", callback=sampling_rule("num_samples"),
                          help="Independent samples to draw."),
    ] = 1,
    seed: Annotated[
        int, typer.Option("--seed", metavar="S", callback=sampling_rule("seed"),
                          help="Random seed (same seed, same text)."),
    ] = 1337,
    device: DeviceOption = None,
    precision: PrecisionOption = None,
) -> None:
    """Generate text from a checkpoint.

    The text is streamed to stdout as it is produced.
    """
    with user_errors():
        from fbtrain import sample as sampler

        sampler.run(
            checkpoint, prompt=prompt, length=length, temperature=temperature, top_k=top_k,
            top_p=top_p, num_samples=num_samples, seed=seed, device=device or "auto",
            stream=sys.stdout, precision=precision.value if precision else None,
        )


@app.command(
    name="eval",
    epilog=_examples(
        "fbtrain eval --checkpoint runs/tiny_shakespeare",
        "fbtrain eval -c runs/tiny_shakespeare --seq-len 256 --context carry --json",
        "fbtrain eval -c runs/tiny_shakespeare/checkpoints/best.pt \\",
        "    --data-path other.txt  # any text in the checkpoint's vocabulary",
    ),
)
def evaluate(
    checkpoint: CheckpointOption,
    split: Annotated[
        Split, typer.Option("--split", help="Which part of the data to score (test: only "
                            "data that has one: enwik8, text8, algorithmic)."),
    ] = Split.val,
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", metavar="N", callback=count_rule("seq_len"), show_default=False,
                     help="Window length (default: the last curriculum stage's length)."),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option("--batch-size", "-b", metavar="B", callback=count_rule("batch_size"),
                     help="Windows per forward pass."),
    ] = 64,
    data_path: Annotated[
        str | None,
        typer.Option("--data-path", metavar="FILE", show_default=False,
                     help="Score this text file instead of the run's own data."),
    ] = None,
    context: Annotated[
        Context,
        typer.Option("--context",
                     help="reset: every window starts from empty memory; carry: memory "
                     "flows from one window into the next."),
    ] = Context.reset,
    device: DeviceOption = None,
    precision: PrecisionOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table."),
    ] = False,
) -> None:
    """Score a checkpoint: loss, bits per character, perplexity.

    Loss is the mean cross-entropy in nats per token; bpc is the nats over the characters
    the tokens cover, / ln 2 (loss / ln 2 where a token is a character).
    """
    with user_errors():
        from fbtrain import evaluate as evaluator

        result = evaluator.run(
            checkpoint, split=split.value, seq_len=seq_len, batch_size=batch_size,
            data_path=data_path, context=context.value, device=device or "auto",
            precision=precision.value if precision else None,
        )
        from fbtrain.io import json_safe, writing

        with writing("stdout"):  # > /dev/full: one line naming stdout
            if as_json:  # strict JSON: a non-finite figure is null, never NaN or Infinity
                typer.echo(json.dumps(json_safe(result), default=str, allow_nan=False))
            else:
                typer.echo(evaluator.format_result(result))


@app.command(epilog=_examples("fbtrain export -c runs/tiny_shakespeare --out exports/ts",
                              "fbtrain sample -c exports/ts"))
def export(
    checkpoint: CheckpointOption,
    out: Annotated[str, typer.Option(
        "--out", "-o", metavar="DIR", help="Folder to write into (created if needed; the "
        "three files are replaced if there).")],
) -> None:
    """Export a model's weights to share, as safetensors.

    Writes DIR/model.safetensors (the weights; no optimizer state), DIR/config.json (the
    model config) and DIR/vocab.json. fbtrain sample and fbtrain eval accept DIR as they
    accept a run.
    """
    with user_errors():
        from fbtrain.checkpoint.contents import export_model
        from fbtrain.io import writing

        source, written = export_model(checkpoint, out)
        size = written[0].stat().st_size
        weights = format_bytes(size)
        # Two lines, each within 80 columns for the usual paths (one ran to 130 and wrapped).
        with writing("stdout"):  # the export is written; > /dev/full says so of stdout
            typer.echo(f"exported {source}\n  to {written[0].parent}: {written[0].name} "
                       f"({weights}), {', '.join(p.name for p in written[1:])}")


def main() -> None:
    """Entry point of the ``fbtrain`` script and of ``python -m fbtrain``."""
    prepare_process()  # closed standard streams, SIGTERM / SIGHUP: before anything else
    try:
        app(prog_name="fbtrain")
    except BrokenPipeError as e:  # a result printed after the reader left (eval | true)
        fail(e)


if __name__ == "__main__":
    main()
