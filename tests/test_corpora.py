"""enwik8 and text8: download, unzip, size check, standard split and cache (against zips
served on 127.0.0.1 with the sizes shrunk), byte tokenization, compact streams, and
``eval --split`` on every kind of dataset. Offline and fast: no real 100 MB file."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
import sys
import zipfile
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from conftest import Server, bounded_run
from typer.testing import CliRunner

from fbtrain.cli import app
from fbtrain.config import ConfigError, DataConfig, load_config
from fbtrain.data import archives
from fbtrain.data.corpus import load_corpus
from fbtrain.data.errors import DataError
from fbtrain.data.fetch import address, download
from fbtrain.data.samplers import BatchSampler, SegmentReader, fixed_windows
from fbtrain.data.sources import SOURCES, TINY_SHAKESPEARE_SHA256, TINY_SHAKESPEARE_URL
from fbtrain.data.streams import Stream
from fbtrain.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SIZE, HELD_OUT = 4000, 400  # stand-ins for 100,000,000 and 5,000,000 bytes
runner = CliRunner()


@pytest.fixture(autouse=True)
def small_corpora(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size check and split at test scale (module constants: not a user setting)."""
    monkeypatch.setattr(archives, "SIZE", SIZE)
    monkeypatch.setattr(archives, "HELD_OUT", HELD_OUT)


def enwik8_bytes(size: int = SIZE, seed: int = 0) -> bytes:
    """Every byte value (invalid UTF-8 included) in a random order, like enwik8's mix."""
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(size - 256)) + bytes(range(256))


def text8_bytes(size: int = SIZE, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz ") for _ in range(size))


def zipped(member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
    return buf.getvalue()


def data_cfg(tmp_path: Path, name: str, url: str, **kw: object) -> DataConfig:
    return DataConfig(dataset=name, url=url, cache_dir=str(tmp_path / "cache"), **kw)


def cached(tmp_path: Path) -> list[str]:
    """The cache's files, temp files included, less the entries' lock files."""
    folder = tmp_path / "cache"
    return sorted(p.name for p in folder.iterdir()
                  if not p.name.endswith(".lock")) if folder.exists() else []


def key(name: str, url: str) -> str:
    """The cache entry of ``name`` from a URL other than its usual one (name@16 hex digits
    of the URL's sha256: the layout the docs describe)."""
    return f"{name}@{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def usual(monkeypatch: pytest.MonkeyPatch, name: str, url: str) -> None:
    """Make ``url`` the usual address of ``name`` (the real one is not reachable here)."""
    monkeypatch.setitem(SOURCES, name, dataclasses.replace(SOURCES[name], url=url))


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- fetch, cache


def test_enwik8_is_downloaded_unzipped_checked_split_and_cached(
    tmp_path: Path, server: Server
) -> None:
    raw = enwik8_bytes()
    server.routes["/enwik8.zip"] = zipped("enwik8", raw)
    cfg = data_cfg(tmp_path, "enwik8", server.url("/enwik8.zip"))
    corpus = load_corpus(cfg)
    assert server.hits["/enwik8.zip"] == 1
    entry = key("enwik8", server.url("/enwik8.zip"))
    assert cached(tmp_path) == [entry, entry + ".json"]  # the file and its record; no zip
    assert (tmp_path / "cache" / entry).read_bytes() == raw
    record = json.loads((tmp_path / "cache" / (entry + ".json")).read_text())
    assert record == {"url": server.url("/enwik8.zip"),
                      "archive_sha256": hashlib.sha256(server.routes["/enwik8.zip"]).hexdigest(),
                      "sha256": hashlib.sha256(raw).hexdigest()}
    tok = corpus.tokenizer
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.unit == "byte"
    # The standard split: the last HELD_OUT bytes test, the HELD_OUT before them val.
    bounds = {"train": raw[: SIZE - 2 * HELD_OUT], "val": raw[SIZE - 2 * HELD_OUT: -HELD_OUT],
              "test": raw[-HELD_OUT:]}
    assert list(corpus.splits) == ["train", "val", "test"]
    for name, part in bounds.items():
        stream = corpus.stream(name)
        assert stream.inputs.dtype == torch.uint8  # compact: 1 byte a token
        assert tok.decode_bytes(stream.inputs) == part[:-1]
        assert tok.decode_bytes(stream.targets) == part[1:]
    # Inputs and targets of every split are views of one buffer, not copies.
    storages = {s.untyped_storage().data_ptr() for st in corpus.splits.values() for s in st}
    assert len(storages) == 1

    again = load_corpus(cfg)  # from the cache: no second request, nothing unzipped
    assert server.hits["/enwik8.zip"] == 1
    assert again.tokenizer == tok
    assert torch.equal(again.stream("test").inputs, corpus.stream("test").inputs)


def test_text8_is_character_level(tmp_path: Path, server: Server) -> None:
    raw = text8_bytes()
    server.routes["/text8.zip"] = zipped("text8", raw)
    corpus = load_corpus(data_cfg(tmp_path, "text8", server.url("/text8.zip")))
    tok = corpus.tokenizer
    assert isinstance(tok, CharTokenizer) and tok.unit == "character"
    assert tok.tokens == sorted(set(raw.decode("ascii")))
    assert tok.decode(corpus.stream("test").inputs) == raw[-HELD_OUT:-1].decode("ascii")


def test_text8_refuses_non_ascii_and_caches_nothing(tmp_path: Path, server: Server) -> None:
    raw = enwik8_bytes()
    first = next(i for i, b in enumerate(raw) if b not in b"abcdefghijklmnopqrstuvwxyz ")
    server.routes["/text8.zip"] = zipped("text8", raw)
    url = server.url("/text8.zip")
    with pytest.raises(DataError, match=rf"^text8 in {url}: byte 0x{raw[first]:02x}( \(.+\))? "
                       rf"at offset {first:,} is not allowed: text8 holds only lowercase "
                       r"letters a-z and spaces; nothing was saved; check data.url"):
        load_corpus(data_cfg(tmp_path, "text8", url))
    assert cached(tmp_path) == []
    server.routes["/text8.zip"] = zipped("text8", text8_bytes())  # the next run is not stuck
    assert load_corpus(data_cfg(tmp_path, "text8", url)).tokenizer.vocab_size == 27
    assert server.hits["/text8.zip"] == 2


def text8_with(byte: bytes, at: int = 1234) -> bytes:
    """text8 with one byte outside its alphabet."""
    raw = text8_bytes()
    return raw[:at] + byte + raw[at + 1:]


def test_text8_refuses_other_ascii(tmp_path: Path, server: Server) -> None:
    server.routes["/text8.zip"] = zipped("text8", text8_with(b"A"))
    url = server.url("/text8.zip")
    with pytest.raises(DataError, match=rf"^text8 in {url}: byte 0x41 \('A'\) at offset 1,234 "
                       r"is not allowed: text8 holds only lowercase letters a-z and spaces; "
                       r"nothing was saved; "):
        load_corpus(data_cfg(tmp_path, "text8", url))
    assert cached(tmp_path) == []


def test_text8_local_copy_is_checked(tmp_path: Path, refused_url: str) -> None:
    local = tmp_path / "text8"
    local.write_bytes(text8_with(b"\n", at=3999))
    with pytest.raises(DataError, match=rf"^data.path {local}: byte 0x0a at offset 3,999 is not "
                       r"allowed: text8 holds only lowercase letters a-z and spaces; point "
                       r"data.path at the unzipped text8$"):
        load_corpus(data_cfg(tmp_path, "text8", refused_url, path=str(local)))


def test_refused_text8_cached_by_older_versions_is_prepared_again(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    usual(monkeypatch, "text8", server.url("/text8.zip"))
    raw = text8_bytes()
    server.routes["/text8.zip"] = zipped("text8", raw)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "text8").write_bytes(text8_with(b"\xe9"))  # what 0.1 cached, refused
    corpus = load_corpus(data_cfg(tmp_path, "text8", None))
    assert server.hits["/text8.zip"] == 1 and corpus.tokenizer.vocab_size == 27
    assert (tmp_path / "cache" / "text8").read_bytes() == raw


def test_truncated_archive_is_refused_and_leaves_nothing(tmp_path: Path, server: Server
                                                         ) -> None:
    whole = zipped("enwik8", enwik8_bytes())
    server.routes["/enwik8.zip"] = whole[: len(whole) // 2]
    url = server.url("/enwik8.zip")
    with pytest.raises(DataError) as e:
        load_corpus(data_cfg(tmp_path, "enwik8", url))
    assert one_line(e).startswith(f"{url}: not a complete zip archive (")
    assert "nothing was saved" in str(e.value)
    assert cached(tmp_path) == []


@pytest.mark.parametrize(("size", "shown"), [(SIZE - 1, "3,999"), (SIZE + 1, "more than 4,000")])
def test_wrong_size_is_refused_and_leaves_nothing(tmp_path: Path, server: Server, size: int,
                                                  shown: str) -> None:
    server.routes["/enwik8.zip"] = zipped("enwik8", enwik8_bytes(size))
    url = server.url("/enwik8.zip")
    with pytest.raises(DataError) as e:
        load_corpus(data_cfg(tmp_path, "enwik8", url))
    assert one_line(e).startswith(f"enwik8 in {url} is {shown} bytes, not 4,000: not the "
                                  "standard corpus; nothing was saved")
    assert cached(tmp_path) == []


def test_archive_without_the_file_is_refused(tmp_path: Path, server: Server) -> None:
    server.routes["/enwik8.zip"] = zipped("enwik9", enwik8_bytes())
    url = server.url("/enwik8.zip")
    with pytest.raises(DataError, match=rf"^{url}: the archive holds enwik9, not enwik8; "):
        load_corpus(data_cfg(tmp_path, "enwik8", url))
    assert cached(tmp_path) == []


def test_offline_names_the_way_out(tmp_path: Path, refused_url: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archives, "download", partial(download, backoff=0))  # no waiting
    with pytest.raises(DataError) as e:
        archives.fetch(data_cfg(tmp_path, "enwik8", refused_url), tmp_path / "cache" / "x")
    assert one_line(e).startswith(f"could not download {refused_url}: ")
    assert "--set data.path=FILE" in str(e.value)
    assert cached(tmp_path) == []


def test_cache_entry_of_the_wrong_size_is_rebuilt(tmp_path: Path, server: Server) -> None:
    raw = enwik8_bytes()
    server.routes["/enwik8.zip"] = zipped("enwik8", raw)
    (tmp_path / "cache").mkdir()
    entry = tmp_path / "cache" / key("enwik8", server.url("/enwik8.zip"))
    entry.write_bytes(raw[:100])  # a copy damaged by hand, say
    load_corpus(data_cfg(tmp_path, "enwik8", server.url("/enwik8.zip")))
    assert server.hits["/enwik8.zip"] == 1
    assert entry.read_bytes() == raw


def test_changing_the_url_prepares_the_new_archive(tmp_path: Path, server: Server) -> None:
    old, new = enwik8_bytes(seed=1), enwik8_bytes(seed=2)
    server.routes["/old.zip"], server.routes["/new.zip"] = zipped("enwik8", old), zipped(
        "enwik8", new)
    assert load_corpus(data_cfg(tmp_path, "enwik8", server.url("/old.zip"))).tokenizer
    corpus = load_corpus(data_cfg(tmp_path, "enwik8", server.url("/new.zip")))
    assert server.hits["/new.zip"] == 1
    assert corpus.tokenizer.decode_bytes(corpus.stream("test").inputs) == new[-HELD_OUT:-1]


def test_old_cache_entry_serves_the_usual_address(tmp_path: Path, server: Server,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual address keeps the plain name: an entry made before URLs were keyed (no
    record beside it) is used as it is, unless a sha256 asks for a check it cannot pass."""
    usual(monkeypatch, "enwik8", server.url("/enwik8.zip"))
    raw = enwik8_bytes()
    server.routes["/enwik8.zip"] = zipped("enwik8", raw)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "enwik8").write_bytes(raw)
    load_corpus(data_cfg(tmp_path, "enwik8", None))
    assert server.hits["/enwik8.zip"] == 0 and cached(tmp_path) == ["enwik8"]
    zip_sha = hashlib.sha256(server.routes["/enwik8.zip"]).hexdigest()
    load_corpus(data_cfg(tmp_path, "enwik8", None, sha256=zip_sha))  # nothing to check by:
    assert server.hits["/enwik8.zip"] == 1  # downloaded once more, checked, recorded
    assert cached(tmp_path) == ["enwik8", "enwik8.json"]


def test_given_sha256_is_checked_against_the_cached_file(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = enwik8_bytes()
    server.routes["/enwik8.zip"] = zipped("enwik8", raw)
    zip_sha = hashlib.sha256(server.routes["/enwik8.zip"]).hexdigest()
    url = server.url("/enwik8.zip")
    entry = tmp_path / "cache" / key("enwik8", url)
    load_corpus(data_cfg(tmp_path, "enwik8", url))  # sha256 auto: none pinned for enwik8
    wrong = "0" * 64
    with pytest.raises(DataError) as e:
        load_corpus(data_cfg(tmp_path, "enwik8", url, sha256=wrong))
    assert one_line(e).startswith(f"cached {entry} was unzipped from an archive with sha256 "
                                  f"{zip_sha}, but data.sha256 expects {wrong}; ")
    load_corpus(data_cfg(tmp_path, "enwik8", url, sha256=zip_sha))
    assert server.hits["/enwik8.zip"] == 1  # both answered from the cache
    damaged = bytearray(raw)
    damaged[7] ^= 1
    entry.write_bytes(bytes(damaged))  # same size: only the hash notices
    load_corpus(data_cfg(tmp_path, "enwik8", url, sha256=zip_sha))
    assert server.hits["/enwik8.zip"] == 2 and entry.read_bytes() == raw  # rebuilt

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} was hashed")

    monkeypatch.setattr(archives, "file_sha256", no_hashing)
    load_corpus(data_cfg(tmp_path, "enwik8", url))  # no sha256 given: a cache read stays fast


def test_leftovers_of_a_killed_preparation_are_removed(tmp_path: Path, server: Server) -> None:
    server.routes["/enwik8.zip"] = zipped("enwik8", enwik8_bytes())
    url = server.url("/enwik8.zip")
    entry = key("enwik8", url)
    (tmp_path / "cache").mkdir()
    for name in (f".{entry}.zip.a1b2c3d4.tmp", f"{entry}.zip", f".{entry}.a1b2c3d4.tmp",
                 f".{entry}.json.a1b2c3d4.tmp"):  # a kill -9 while downloading or unzipping
        (tmp_path / "cache" / name).write_bytes(b"partial")
    load_corpus(data_cfg(tmp_path, "enwik8", url))
    assert cached(tmp_path) == [entry, entry + ".json"]


def test_local_copy_is_used_and_checked(tmp_path: Path, refused_url: str) -> None:
    local = tmp_path / "enwik8"
    local.write_bytes(enwik8_bytes())
    corpus = load_corpus(data_cfg(tmp_path, "enwik8", refused_url, path=str(local)))
    assert len(corpus.stream("train").inputs) == SIZE - 2 * HELD_OUT - 1
    archive = tmp_path / "enwik8.zip"
    archive.write_bytes(zipped("enwik8", enwik8_bytes()))
    with pytest.raises(DataError, match=rf"^data.path {archive} is [\d,]+ bytes, not 4,000 "
                       r"\(a zip archive: unzip it first\); point data.path at the unzipped"):
        load_corpus(data_cfg(tmp_path, "enwik8", refused_url, path=str(archive)))


def test_checksum_of_the_archive_is_checked_when_given(tmp_path: Path, server: Server) -> None:
    server.routes["/enwik8.zip"] = zipped("enwik8", enwik8_bytes())
    with pytest.raises(DataError, match=r"^sha256 mismatch for .*nothing was saved"):
        load_corpus(data_cfg(tmp_path, "enwik8", server.url("/enwik8.zip"), sha256="0" * 64))
    assert cached(tmp_path) == []


def test_checkpoint_vocabulary_missing_a_byte_is_named(tmp_path: Path) -> None:
    local = tmp_path / "enwik8"
    local.write_bytes(enwik8_bytes())
    vocab = [chr(b) for b in range(255)]  # no 0xff
    with pytest.raises(DataError, match=r"1 byte value\(s\) not in the vocabulary: 0xff$"):
        load_corpus(DataConfig(dataset="enwik8", path=str(local)), vocab)


# ----------------------------------------------------------------------------- config


def test_usual_addresses_and_pinned_checksums() -> None:
    assert address(DataConfig()) == (TINY_SHAKESPEARE_URL, TINY_SHAKESPEARE_SHA256)
    assert address(DataConfig(sha256=None)) == (TINY_SHAKESPEARE_URL, None)
    assert address(DataConfig(dataset="enwik8")) == ("http://mattmahoney.net/dc/enwik8.zip", None)
    assert address(DataConfig(dataset="text8")) == (SOURCES["text8"].url, None)
    assert address(DataConfig(dataset="mine", url="http://x/y.txt")) == ("http://x/y.txt", None)


@pytest.mark.parametrize(("override", "line"), [
    ("data.val_fraction=0.2", "data.val_fraction = 0.2: does not apply to enwik8: its splits "
     "are fixed"),
    ("data.sha256=abc", "data.sha256 = 'abc': must be auto, null or 64 hex digits"),
])
def test_config_problems(override: str, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.dataset=enwik8", override])
    assert any(line in p for p in e.value.problems), e.value.problems


def test_unknown_dataset_needs_an_address() -> None:
    with pytest.raises(ConfigError, match=r"data.dataset = 'mine': has no usual address: use "
                       r"one of tinyshakespeare, enwik8, text8, algorithmic, or set data.url"):
        load_config(None, ["data.dataset=mine"])
    load_config(None, ["data.dataset=mine", "data.path=x.txt"])  # fine


def test_enwik8_config_parses_and_carries_a_long_memory() -> None:
    cfg = load_config(ROOT / "configs" / "enwik8.yaml")
    assert cfg.data.dataset == "enwik8" and cfg.train.context == "carry"
    assert cfg.model.memory_window >= 512


# ----------------------------------------------------------------------------- bytes


def test_byte_tokenizer_round_trips_any_bytes() -> None:
    data = bytes(range(256)) + b"\xff\xfe caf\xc3\xa9 \xc3" + "é€𝄞".encode()
    tok = ByteTokenizer.from_bytes(data)
    ids = tok.encode(data)
    assert ids.dtype == torch.long and len(ids) == len(data)
    assert tok.decode_bytes(ids) == data  # invalid UTF-8 included
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")
    assert tok.decode_bytes(tok.encode("é€")) == "é€".encode()  # text goes in as UTF-8
    # Streamed one id at a time, a multi-byte character appears once it is whole.
    decoder = tok.decoder()
    pieces = [decoder.feed(i) for i in tok.encode("é€").tolist()]
    assert pieces == ["", "é", "", "", "€"]
    decoder.feed(int(tok.encode(b"\xc3")[0]))
    assert decoder.end() == "\ufffd"


def test_byte_vocabulary_survives_vocab_json_and_checkpoints(tmp_path: Path) -> None:
    tok = ByteTokenizer([chr(b) for b in range(256)])
    path = tok.save(tmp_path)
    assert Tokenizer.load(path) == tok
    assert json.loads(path.read_text(encoding="utf-8"))["bytes"][0xE9] == "\u00e9"
    assert make_tokenizer(tok.tokens, "byte") == tok
    with pytest.raises(DataError, match=r"^2 byte\(s\) not in the vocabulary: 0xa9, 0xc3; "):
        ByteTokenizer(["a"]).encode("é")  # U+00E9 is the bytes c3 a9 in UTF-8


def test_compact_streams_draw_long_windows() -> None:
    ids = torch.randint(0, 200, (500,), dtype=torch.uint8)
    wide = ids.long()
    compact, long_ = Stream(ids[:-1], ids[1:]), Stream(wide[:-1], wide[1:])
    drawn = [(BatchSampler(data, seed=1).sample(4, 16), fixed_windows(data, 16, 5, context=8),
              SegmentReader(data, 4).segment(16)[:2]) for data in (compact, long_)]
    for (x, y), (x_long, y_long) in zip(*drawn, strict=True):
        assert x.dtype == y.dtype == torch.long  # widened: embeddings and losses take these
        assert torch.equal(x, x_long) and torch.equal(y, y_long)
    assert (drawn[0][1][1][:, :8] == -100).all()  # IGNORE_INDEX survives the widening


# ----------------------------------------------------------------------------- CLI


def train_and_eval(tmp_path: Path, config: str, sets: list[str], *eval_args: str):
    """Train two steps of a tiny model, then ``fbtrain eval --json`` with ``eval_args``."""
    out = tmp_path / "runs"
    args = ["train", "--config", config, "--device", "cpu", "--quiet",
            "--set", f"run.out_dir={out}", "--set", "run.name=r",
            "--set", "model.d_model=16", "--set", "model.n_heads=2", "--set", "model.d_ff=32",
            "--set", "model.n_layers=2", "--set", "model.max_rel_pos=16",
            "--set", "train.max_steps=2", "--set", "train.batch_size=2",
            "--set", "train.warmup_steps=1", "--set", "train.eval_every=2",
            "--set", "train.eval_windows=2", "--set", "checkpoint.every=2",
            "--set", "logging.tensorboard=false", "--set", "curriculum=[{seq_len: 8}]",
            "--set", "train.sample_every=0", *sum((["--set", s] for s in sets), [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return runner.invoke(app, ["eval", "-c", str(out / "r"), "--device", "cpu", *eval_args])


def test_enwik8_config_trains_samples_and_evaluates_on_test(tmp_path: Path, server: Server
                                                            ) -> None:
    raw = enwik8_bytes()
    server.routes["/enwik8.zip"] = zipped("enwik8", raw)
    sets = [f"data.url={server.url('/enwik8.zip')}", f"data.cache_dir={tmp_path / 'cache'}"]
    result = train_and_eval(tmp_path, str(ROOT / "configs" / "enwik8.yaml"), sets,
                            "--split", "test", "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["split"] == "test" and figures["tokens"] == HELD_OUT - 1
    assert 0 < figures["bpc"] < 10
    assert server.hits["/enwik8.zip"] == 1  # eval read the cache
    saved = torch.load(tmp_path / "runs" / "r" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["tokenizer"] == "byte" and len(saved["vocab"]) == 256
    sampled = runner.invoke(app, ["sample", "-c", str(tmp_path / "runs" / "r"), "--device",
                                  "cpu", "--length", "40", "--prompt", "é"])
    assert sampled.exit_code == 0, sampled.output
    assert sampled.stdout.startswith("é")


def test_text8_evaluates_on_test(tmp_path: Path, server: Server) -> None:
    server.routes["/text8.zip"] = zipped("text8", text8_bytes())
    sets = ["data.dataset=text8", f"data.url={server.url('/text8.zip')}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    result = train_and_eval(tmp_path, str(ROOT / "configs" / "tiny.yaml"), sets,
                            "--split", "test", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == HELD_OUT - 1


def test_eval_data_path_scores_any_text_with_the_byte_tokenizer(tmp_path: Path,
                                                                 server: Server) -> None:
    """An enwik8 checkpoint scores any file by bytes (was: "not 4,000 bytes"), split by
    data.val_fraction, invalid UTF-8 included; training on data.path keeps the size check."""
    server.routes["/enwik8.zip"] = zipped("enwik8", enwik8_bytes())
    sets = [f"data.url={server.url('/enwik8.zip')}", f"data.cache_dir={tmp_path / 'cache'}"]
    other = tmp_path / "other.bin"
    data = "Grüße, naïve café\n".encode() * 30 + b"\xff\xfe"
    other.write_bytes(data)
    result = train_and_eval(tmp_path, str(ROOT / "configs" / "enwik8.yaml"), sets,
                            "--data-path", str(other), "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    n_train = int(len(data) * 0.9)
    assert figures["split"] == "val" and figures["tokens"] == len(data) - n_train - 1
    assert 0 < figures["bpc"] < 10
    train = runner.invoke(app, ["eval", "-c", str(tmp_path / "runs" / "r"), "--device", "cpu",
                                "--data-path", str(other), "--split", "train", "--json"])
    assert json.loads(train.stdout)["tokens"] == n_train - 1
    with pytest.raises(DataError, match=rf"^data.path {other} is {len(data)} bytes, not 4,000; "
                       "point data.path at the unzipped enwik8"):
        load_corpus(DataConfig(dataset="enwik8", path=str(other)))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    refused = runner.invoke(app, ["eval", "-c", str(tmp_path / "runs" / "r"), "--device", "cpu",
                                  "--data-path", str(empty)])
    assert refused.exit_code == 2
    assert refused.stderr == (f"error: --data-path {empty} is empty; point it at a text file "
                              "with content\n")
    zero = bounded_run([sys.executable, "-m", "fbtrain", "eval", "-c", str(tmp_path / "runs" / "r"),
                        "--device", "cpu", "--data-path", "/dev/zero"])  # was a MemoryError
    assert zero.returncode == 2, zero.stderr
    assert zero.stderr == ("error: --data-path /dev/zero is a character device, not a text "
                           "file; point it at a text file\n")


def test_benchmark_data_path_that_is_a_device_is_named() -> None:
    """Not "is 0 bytes" (in a subprocess with bounded memory: main's zip check read it)."""
    code = ("from fbtrain.config import DataConfig\nfrom fbtrain.data.corpus import load_corpus\n"
            "from fbtrain.data.errors import DataError\ntry:\n"
            "    load_corpus(DataConfig(dataset='enwik8', path='/dev/zero'))\n"
            "except DataError as e:\n    print(e)\n")
    result = bounded_run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("data.path /dev/zero is a character device, not a file; point "
                             "data.path at the unzipped enwik8\n")


def test_text_without_a_test_split_says_which_splits_exist(tmp_path: Path) -> None:
    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40, encoding="utf-8")
    result = train_and_eval(tmp_path, str(ROOT / "configs" / "tiny.yaml"),
                            [f"data.path={text}"], "--split", "test")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: split = 'test': this data has the splits "
                                      f"train, val (data.path {text})")


def test_algorithmic_evaluates_on_test(tmp_path: Path) -> None:
    sets = ["data.train_programs=20", "data.valid_programs=4", "data.test_programs=4",
            "data.program_len=5"]
    result = train_and_eval(tmp_path, str(ROOT / "configs" / "algorithmic_feedback.yaml"), sets,
                            "--split", "test", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["split"] == "test"


def test_shipped_enwik8_config_is_documented() -> None:
    text = (ROOT / "configs" / "enwik8.yaml").read_text(encoding="utf-8")
    assert "estimate" in text.lower()
    assert yaml.safe_load(text)["data"]["dataset"] == "enwik8"
