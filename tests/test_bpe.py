"""data.tokenizer: bpe end to end at tiny sizes (a generated text, a vocabulary of a few
dozen pieces), and bits per character on one scale for every tokenizer."""

from __future__ import annotations

import io
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fbtrain import evaluate, sample
from fbtrain.checkpoint import load_checkpoint
from fbtrain.checkpoint.contents import export_model
from fbtrain.config import DataConfig, config_from_dict
from fbtrain.config.errors import ConfigError
from fbtrain.data import bpe
from fbtrain.data.corpus import load_corpus
from fbtrain.data.errors import DataError
from fbtrain.data.samplers import fixed_windows
from fbtrain.data.streams import split_point
from fbtrain.data.tokenizers import BpeTokenizer, ByteTokenizer, Tokenizer
from fbtrain.train import run

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

WORDS = ["the", "then", "there", "king", "kingdom", "queen", "café", "naïve", "and", "of"]
VOCAB = 48  # the text's distinct bytes (about 30) and a few dozen merges
ROOT = Path(__file__).resolve().parents[1]


def make_text(lines: int = 260, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
                     for _ in range(lines)) + "\n"


def text_file(folder: Path, text: str | None = None) -> Path:
    path = folder / "text.txt"
    path.write_text(text if text is not None else make_text(), encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own download cache, where a BPE corpus keeps its encoded ids."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FBTRAIN_CACHE", str(cache))
    return cache


def bpe_data(path: Path, vocab_size: int = VOCAB) -> DataConfig:
    return DataConfig(path=str(path), tokenizer="bpe", vocab_size=vocab_size)


def raw_config(tmp_path: Path, name: str = "run", tokenizer: str | None = "bpe",
               steps: int = 4) -> dict:
    data = {"path": str(text_file(tmp_path) if not (tmp_path / "text.txt").exists()
                        else tmp_path / "text.txt")}
    if tokenizer is not None:
        data["tokenizer"] = tokenizer
    if tokenizer == "bpe":
        data["vocab_size"] = VOCAB
    return {
        "run": {"name": name, "out_dir": str(tmp_path / "runs"), "device": "cpu", "seed": 7},
        "data": data,
        "model": {"kind": "feedback_kv", "d_model": 16, "n_heads": 2, "d_ff": 32,
                  "n_layers": 2, "max_rel_pos": 16},
        "train": {"max_steps": steps, "batch_size": 4, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 1, "eval_every": 2, "eval_windows": 4, "log_every": 1,
                  "sample_length": 12},
        "curriculum": [{"seq_len": 16}],
        "checkpoint": {"every": 2, "keep_last": 2},
        "logging": {"tensorboard": False, "progress": False},
    }


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in
            (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------- learning


def test_learned_from_the_training_split_alone(tmp_path: Path) -> None:
    # The validation part repeats a word the training part never holds: learned from
    # it, its pairs would be the most frequent of all.
    train_text = make_text(200)
    text = train_text + ("zyzzyva\n" * len(train_text))[:len(train_text)]
    data = bpe_data(text_file(tmp_path, text), vocab_size=60)
    data.val_fraction = 0.5
    corpus = load_corpus(data)
    tokenizer = corpus.tokenizer
    assert isinstance(tokenizer, BpeTokenizer) and tokenizer.vocab_size == 60
    n_train = split_point(len(text), 0.5)
    assert n_train == len(train_text)
    alphabet = sorted(set(text.encode("utf-8")))
    alone = BpeTokenizer.learn(text[:n_train], 60, alphabet)
    assert tokenizer.tokens == alone.tokens
    assert not any("zy" in p or "yz" in p for p in tokenizer.vocab_pieces)
    # Ids are compact, and the splits are the character split's text.
    assert corpus.splits["train"].inputs.dtype == torch.uint16
    train, val = corpus.splits["train"], corpus.splits["val"]
    assert tokenizer.decode(torch.cat([train.inputs[:1], train.targets])) == text[:n_train]
    assert tokenizer.decode(torch.cat([val.inputs[:1], val.targets])) == text[n_train:]


LEARN = """
import json, sys
from fbtrain.data.bpe import chunks, learn
text = open(sys.argv[1], encoding="utf-8").read()
print(json.dumps(learn(chunks(text), 60, sorted(set(text.encode("utf-8"))))))
"""


def test_the_same_merges_whatever_the_threads_and_hash_seed(tmp_path: Path) -> None:
    path = text_file(tmp_path, make_text(400, seed=3))
    runs = []
    for threads, seed in (("1", "1"), ("2", "2")):
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", LEARN, str(path)], env=env, check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out))
    text = path.read_text(encoding="utf-8")
    here = bpe.learn(bpe.chunks(text), 60, sorted(set(text.encode("utf-8"))))
    assert runs[0] == runs[1] == here
    assert 40 < len(here) <= 60  # fewer when every word is one piece already


def test_a_text_cut_into_chunks_gives_the_tokens_of_the_whole(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    text = make_text(120, seed=1).replace("queen\n", "queen \n\n").replace("king\n", "king\n  ")
    text += "end\n\tof\n\n\nthe café \n"
    tokenizer = BpeTokenizer.learn(text, 70, sorted(set(text.encode("utf-8"))))
    whole = tokenizer.encode(text)
    monkeypatch.setattr(bpe, "CHUNK_CHARS", 7)
    assert len(list(bpe.chunks(text, 7))) > 50
    tokenizer._encoder = None
    assert torch.equal(tokenizer.encode(text), whole)


@pytest.mark.parametrize("ends", ["\r\n", " "], ids=["crlf", "one line"])
def test_a_text_with_crlf_or_no_line_ends_is_cut_too(ends: str) -> None:
    # Cut only after a newline between two non-blanks, a CRLF text (or one line) was one
    # part, and the library's per-token records for all of it outgrew memory.
    text = make_text(120, seed=2).replace("\n", ends)
    parts = list(bpe.chunks(text, 40))
    assert "".join(parts) == text and len(parts) > 20
    assert max(map(len, parts)) < 40 + max(map(len, WORDS)) + 2
    tokenizer = BpeTokenizer.learn(text, 70, sorted(set(text.encode("utf-8"))))
    whole = tokenizer.encode(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bpe, "CHUNK_CHARS", 40)
        tokenizer._encoder = None
        assert torch.equal(tokenizer.encode(text), whole)


def test_every_cut_falls_where_the_pre_tokenizer_splits() -> None:
    # Blanks the library reads as punctuation (U+001C), as words of their own, CRLF,
    # contractions, runs of blanks: the pre-tokens of the parts are those of the whole.
    pre = bpe._pre_tokenizer()
    rng = random.Random(5)
    alphabet = [*"ab'1.!é ", "\n", "\r", "\t", "\x0b", "\x1c", "\x85", "\xa0", "\u3000",
                "\u0301", "'s", "  ", "\r\n"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        for size in (1, 3):
            parts = list(bpe.chunks(text, size))
            assert "".join(parts) == text
            cut = [t for part in parts for t, _ in pre.pre_tokenize_str(part)]
            assert cut == [t for t, _ in pre.pre_tokenize_str(text)], (text, parts)


def test_a_long_run_without_a_break_is_cut_into_words_of_bounded_length() -> None:
    # One word of a text (a run of NULs padding a file, of blank lines, of digits) was
    # learned whole, in time quadratic in its length.
    pre = bpe._pre_tokenizer()
    words = [w for w, _ in pre.pre_tokenize_str("the " + "7" * 600 + "\n" * 300 + "end")]
    limit = bpe.MAX_WORD_BYTES
    assert words == ["the", "Ġ" + "7" * (limit - 1), "7" * limit, "7" * (601 - 2 * limit),
                     "Ċ" * limit, "Ċ" * (299 - limit), "Ċ", "end"]
    text = make_text(40) + "\x00" * 5000 + make_text(20, seed=1)
    tokenizer = BpeTokenizer.learn(text, 60, sorted(set(text.encode("utf-8"))))
    assert max(len(piece) for piece in tokenizer.vocab_pieces) <= limit
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_too_small_a_vocabulary_is_one_line(tmp_path: Path) -> None:
    distinct = len(set(make_text().encode("utf-8")))
    with pytest.raises(DataError, match=rf"data.vocab_size = 5: below the {distinct} distinct "
                                        rf"bytes of the text.*at least {distinct}"):
        load_corpus(bpe_data(text_file(tmp_path), vocab_size=5))


def test_config_names_the_tokenizer_keys() -> None:
    with pytest.raises(ConfigError, match=r"data.tokenizer = 'bpe'.*does not apply to "
                                          r"data.dataset = algorithmic"):
        config_from_dict({"data": {"dataset": "algorithmic", "tokenizer": "bpe"}})
    with pytest.raises(ConfigError, match=r"data.vocab_size = 100.*applies only to "
                                          r"data.tokenizer = bpe"):
        config_from_dict({"data": {"vocab_size": 100}})
    with pytest.raises(ConfigError, match=r"data.tokenizer = 'words'.*one of char, byte, bpe"):
        config_from_dict({"data": {"tokenizer": "words"}})


def test_a_text_read_as_bytes(tmp_path: Path) -> None:
    text = make_text()
    corpus = load_corpus(DataConfig(path=str(text_file(tmp_path, text)), tokenizer="byte"))
    assert isinstance(corpus.tokenizer, ByteTokenizer)
    train, val = corpus.splits["train"], corpus.splits["val"]
    assert train.inputs.dtype == torch.uint8
    assert len(train.inputs) + len(val.inputs) + 2 == len(text.encode("utf-8"))


# ----------------------------------------------------------------------------- encoded once


def test_the_encoded_ids_are_mapped_from_the_cache_on_a_later_start(
        tmp_path: Path, own_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start encodes and keeps the ids; the next, with the vocabulary a checkpoint
    holds, maps them (no encoding) and gets the same splits. Other encoding rules, or another
    text, are encoded anew."""
    data = bpe_data(text_file(tmp_path))
    first = load_corpus(data)
    vocab = first.tokenizer.tokens
    assert [p.suffix for p in sorted((own_cache / "bpe-ids").iterdir())] == [".ids", ".json"]

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("encoded again")

    monkeypatch.setattr(BpeTokenizer, "encode_compact", refused)
    again = load_corpus(data, vocab)
    for name in ("train", "val"):
        assert torch.equal(again.splits[name].inputs, first.splits[name].inputs)
        assert again.splits[name].inputs.dtype == torch.uint16
    with monkeypatch.context() as changed:  # rules of encoding other than the entry's
        changed.setattr(bpe, "ENCODING", bpe.ENCODING + ", changed")
        with pytest.raises(AssertionError, match="encoded again"):
            load_corpus(data, vocab)
    (tmp_path / "text.txt").write_text(make_text(seed=1), encoding="utf-8")
    with pytest.raises(AssertionError, match="encoded again"):
        load_corpus(data, vocab)


def test_a_damaged_or_unwritable_cache_costs_the_speed_up_not_the_run(
        tmp_path: Path, own_cache: Path) -> None:
    data = bpe_data(text_file(tmp_path))
    first = load_corpus(data)
    vocab = first.tokenizer.tokens
    entry = next((own_cache / "bpe-ids").glob("*.ids"))
    entry.write_bytes(entry.read_bytes()[:-2])  # one id short: the record says otherwise
    again = load_corpus(data, vocab)
    assert torch.equal(again.splits["train"].inputs, first.splits["train"].inputs)
    assert entry.stat().st_size == 2 * sum(len(s.inputs) + 1 for s in first.splits.values())
    whole = entry.read_bytes()  # the size as recorded, an id changed in place: past the vocab
    entry.write_bytes(whole[:10] + b"\xff\xff" + whole[12:])
    again = load_corpus(data, vocab)
    assert torch.equal(again.splits["train"].inputs, first.splits["train"].inputs)
    assert entry.read_bytes() == whole
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder would be")
    elsewhere = DataConfig(path=data.path, tokenizer="bpe", vocab_size=VOCAB,
                           cache_dir=str(blocked))
    assert torch.equal(load_corpus(elsewhere, vocab).splits["val"].inputs,
                       first.splits["val"].inputs)


# ----------------------------------------------------------------------------- saved form


def test_the_saved_list_is_the_whole_tokenizer(tmp_path: Path) -> None:
    text = make_text()
    tokenizer = BpeTokenizer.learn(text, VOCAB, sorted(set(text.encode("utf-8"))))
    assert any(" " in entry for entry in tokenizer.tokens)  # merges, written "left right"
    again = Tokenizer.load(tokenizer.save(tmp_path))
    assert isinstance(again, BpeTokenizer) and again.tokens == tokenizer.tokens
    assert torch.equal(again.encode(text), tokenizer.encode(text))
    assert again.decode(again.encode(text)) == text


@pytest.mark.parametrize("entries, problem", [
    (["a", "b", "a c"], r"entry 2 \('a c'\) is neither a byte's symbol nor a merge"),
    (["a", "b", "a b", "ab"], r"entry 3 \('ab'\) is neither"),
    (["a", "b", "a b", "b a", "ab", "a ba"], r"entry 4"),
    (["a", "b", "ab", "c"], r"entry 2"),
    (["a", "b", "a b", "a", "b"], r"vocabulary has repeated pieces"),
])
def test_a_damaged_vocabulary_is_refused(entries: list[str], problem: str) -> None:
    with pytest.raises(DataError, match=problem):
        BpeTokenizer(entries)


def test_a_merge_that_repeats_a_piece_is_refused() -> None:
    with pytest.raises(DataError, match=r"entry 6 \('a bc'\) repeats the piece 'abc'"):
        BpeTokenizer(["a", "b", "c", "a b", "ab c", "b c", "a bc"])


# ----------------------------------------------------------------------------- characters


def test_pieces_cover_the_characters_of_their_text() -> None:
    text = "naïve café, 日本語 and the kingdom\n" * 3
    alphabet = sorted(set(text.encode("utf-8")))
    for size in (len(alphabet), len(alphabet) + 30):  # bytes alone; merges across bytes
        tokenizer = BpeTokenizer.learn(text, size, alphabet)
        ids = tokenizer.encode(text)
        per_piece = tokenizer.characters()
        assert int(per_piece[ids].sum()) == len(text)
        assert len(ids) < len(text.encode("utf-8")) or size == len(alphabet)


def test_sampling_holds_back_a_partial_character() -> None:
    text = "日本 and 日本\n"
    tokenizer = BpeTokenizer.learn(text, len(set(text.encode("utf-8"))),
                                   sorted(set(text.encode("utf-8"))))
    ids = tokenizer.encode("日").tolist()
    assert len(ids) == 3  # one piece a byte
    decoder = tokenizer.decoder()
    assert [decoder.feed(i) for i in ids] == ["", "", "日"]
    assert decoder.end() == ""


def test_a_prompt_with_a_byte_that_is_not_utf8_is_one_line() -> None:
    # A shell passes --prompt $'\xc3' to Python as the lone surrogate U+DCC3: encoding it
    # as UTF-8 was a bare UnicodeEncodeError, for BPE and for bytes alike, even where the
    # vocabulary holds the byte (é's first byte, here).
    text = "café and the king\n" * 20
    raw = text.encode("utf-8")
    for tokenizer in (BpeTokenizer.learn(text, 30, sorted(set(raw))),
                      ByteTokenizer.from_bytes(raw)):
        for prompt, shown in ((b"caf\xc3".decode("utf-8", "surrogateescape"), "3 is byte 0xc3"),
                              ("the\ud800", "3 is U\\+D800")):
            with pytest.raises(DataError, match=rf"^prompt: character {shown}, which is not "
                                                r"UTF-8 text; give UTF-8 text$"):
                sample.encode_prompt(tokenizer, prompt)


# ----------------------------------------------------------------------------- end to end


def test_a_steps_bits_per_character_are_over_its_own_characters(tmp_path: Path) -> None:
    """A step's bpc divides its loss by the characters its own scored targets cover (each
    piece's count, summed on the device and read with the step's other figures), not by a
    split's average."""
    from fbtrain.distributed import DistContext
    from fbtrain.rundir import RunDirectory
    from fbtrain.train.report import step_metrics
    from fbtrain.train.setup import set_up
    from fbtrain.train.signals import StopSignals
    from fbtrain.train.step import train_step

    cfg = config_from_dict(raw_config(tmp_path))
    parts, _, _ = set_up(cfg, DistContext(torch.device("cpu")),
                         RunDirectory(tmp_path / "runs" / "run", 1), None)
    drawn = []
    draw = parts.batches.micro_batches

    def recorded(*args: object) -> list:
        batches = draw(*args)
        drawn.extend(y for _, y, _ in batches)
        return batches

    parts.batches.micro_batches = recorded  # type: ignore[method-assign]
    result = train_step(parts, 0, StopSignals(), tmp_path / "none.pt")
    targets = torch.cat([y.reshape(-1) for y in drawn])
    chars = int(parts.data.tokenizer.characters()[targets].sum())
    assert result.chars_per_token == pytest.approx(chars / targets.numel(), rel=1e-6)
    assert result.chars_per_token != pytest.approx(parts.data.chars_per_token[0], rel=1e-4)
    bpc = step_metrics(parts, result, 0, None)["bpc"]
    assert bpc == pytest.approx(result.loss / math.log(2) * targets.numel() / chars, rel=1e-6)


def test_train_sample_eval_export_from_the_checkpoint(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = run(config_from_dict(raw_config(tmp_path)))
    text = (tmp_path / "text.txt").read_text(encoding="utf-8")
    saved = json.loads((run_dir / "vocab.json").read_text(encoding="utf-8"))["pieces"]
    payload = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert payload["tokenizer"] == "bpe" and payload["vocab"] == saved and len(saved) == VOCAB
    tokenizer = BpeTokenizer(saved)

    # Bits per character: nats over the characters the scored pieces cover; each step's
    # own (test_a_steps_bits_per_character_are_over_its_own_characters), between the
    # fewest and the most characters a piece covers, and not the same for every step.
    n_train = split_point(len(text), 0.1)
    logged = [r for r in records(run_dir) if "loss" in r]
    per_piece = [r["loss"] / math.log(2) / r["bpc"] for r in logged]
    widest = int(tokenizer.characters().max())
    assert logged and all(1.3 < p < widest for p in per_piece)  # bpc is not loss / ln 2
    assert len({round(p, 9) for p in per_piece}) > 1
    # Validation: over the characters its fixed windows' targets cover.
    val = load_corpus(bpe_data(tmp_path / "text.txt"), saved).splits["val"]
    _, val_y = fixed_windows(val, 16, 4)
    val_per_piece = int(tokenizer.characters()[val_y].sum()) / val_y.numel()
    evaluated = [r for r in records(run_dir) if "val/loss" in r]
    assert evaluated and all(
        r["val/bpc"] == pytest.approx(r["val/loss"] / math.log(2) / val_per_piece, rel=1e-9)
        for r in evaluated)
    # A run already trained (which loads no data) closes with the bpc its checkpoint keeps.
    assert payload["progress"]["val_bpc"] == evaluated[-1]["val/bpc"]
    capsys.readouterr()
    run(config_from_dict(raw_config(tmp_path)), resume="auto")
    assert f"(bpc {evaluated[-1]['val/bpc']:.4f})" in capsys.readouterr().out

    # eval scores every piece of the validation text and names both counts.
    result = evaluate.run(str(run_dir), device="cpu")
    val_ids = tokenizer.encode(text[n_train:])
    chars = len(text) - n_train - len(tokenizer.decode(val_ids[:1]))
    assert result["tokens"] == len(val_ids) - 1 and result["characters"] == chars
    assert result["bpc"] == pytest.approx(
        result["loss"] * result["tokens"] / chars / math.log(2), rel=1e-9)
    shown = evaluate.format_result(result)
    assert f"characters  {chars:,}" in shown and "nats/token" in shown

    # sample: the prompt in pieces, the text decoded as it comes; a byte the text never
    # held is one line naming it.
    texts = _sample(run_dir)
    assert texts[0].startswith("the café") or len(texts[0]) > 0
    with pytest.raises(DataError, match=r"prompt: 1 byte value\(s\) not in the vocabulary: "
                                        r"0x51; the vocabulary comes from the training data"):
        sample.run(str(run_dir), prompt="Q", device="cpu", stream=io.StringIO())

    # export: the folder alone samples the same text.
    export_model(run_dir, tmp_path / "export")
    assert _sample(tmp_path / "export") == texts


def _sample(path: Path) -> list[str]:
    """What ``fbtrain sample`` writes and returns for a fixed prompt and seed."""
    out = io.StringIO()
    texts = sample.run(str(path), prompt="the café", length=12, seed=3, device="cpu",
                       stream=out)
    assert out.getvalue().startswith("the café")
    return [out.getvalue(), *texts]


def test_a_resume_reads_the_checkpoints_vocabulary_and_continues_bitwise(tmp_path: Path
                                                                         ) -> None:
    straight = run(config_from_dict(raw_config(tmp_path, "straight", steps=4)))
    raw = raw_config(tmp_path, "halves", steps=2)
    run(config_from_dict(raw))
    raw["train"]["max_steps"] = 4
    raw["data"]["vocab_size"] = VOCAB + 10  # not used: the checkpoint's vocabulary is
    halves = run(config_from_dict(raw), resume="auto")
    losses = [[(r["step"], r["loss"]) for r in records(d) if "loss" in r]
              for d in (straight, halves)]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_a_resume_refuses_another_tokenizer_by_name(tmp_path: Path) -> None:
    run(config_from_dict(raw_config(tmp_path, tokenizer=None, steps=2)))
    raw = raw_config(tmp_path, steps=4)
    with pytest.raises(DataError, match=r"checkpoint .*last\.pt was trained with "
                                        r"data.tokenizer char, but the config asks for bpe"):
        run(config_from_dict(raw), resume="auto")


def test_a_resume_names_the_checkpoint_whose_vocabulary_is_damaged(tmp_path: Path) -> None:
    run_dir = run(config_from_dict(raw_config(tmp_path, steps=2)))
    last = run_dir / "checkpoints" / "last.pt"
    payload = torch.load(last, weights_only=False)
    payload["vocab"][-1] = "zz"  # neither a byte's symbol nor a merge
    torch.save(payload, last)
    with pytest.raises(DataError, match=rf"^vocabulary of checkpoint {last}: not a BPE "
                                        r"vocabulary: entry \d+ \('zz'\) is neither"):
        run(config_from_dict(raw_config(tmp_path, steps=4)), resume="auto")


def test_for_characters_bits_per_character_are_the_loss_over_ln2(tmp_path: Path) -> None:
    run_dir = run(config_from_dict(raw_config(tmp_path, tokenizer=None)))
    rows = records(run_dir)
    assert any("val/bpc" in r for r in rows)
    for r in rows:
        if "loss" in r:
            assert r["bpc"] == r["loss"] / math.log(2)
        if "val/loss" in r:
            assert r["val/bpc"] == r["val/loss"] / math.log(2)
    result = evaluate.run(str(run_dir), device="cpu")
    assert result["bpc"] == result["loss"] / math.log(2) and "characters" not in result


NO_TOKENIZERS = """
import sys
sys.modules["tokenizers"] = None  # importing it raises ImportError
import fbtrain.cli, fbtrain.sample, fbtrain.evaluate, fbtrain.data.corpus
from fbtrain.config import config_from_dict
from fbtrain.train import run
import json
raw = json.loads(sys.argv[1])
run_dir = run(config_from_dict(raw), quiet=True)
print(fbtrain.evaluate.run(str(run_dir), device="cpu")["bpc"])
"""


def test_characters_train_without_the_tokenizers_library(tmp_path: Path) -> None:
    raw = raw_config(tmp_path, tokenizer="char", steps=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", NO_TOKENIZERS, json.dumps(raw)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert math.isfinite(float(done.stdout.split()[-1]))


def test_a_bpe_run_without_the_tokenizers_library_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = BpeTokenizer.learn(make_text(), VOCAB, sorted(set(make_text().encode("utf-8"))))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # importing it raises ImportError
    needs = r"data.tokenizer = bpe needs Hugging Face's tokenizers library.*pip install 'tokenizers"
    with pytest.raises(DataError, match=needs):  # learning a vocabulary
        load_corpus(bpe_data(text_file(tmp_path)))
    with pytest.raises(DataError, match=needs):  # encoding a prompt with a saved one
        tokenizer.encode("the king")
