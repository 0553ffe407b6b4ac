"""The README's config reference is generated from the config dataclasses; keep it true."""

from pathlib import Path

from fbtrain.config import describe_fields

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_lists_every_config_key_with_its_default():
    text = README.read_text(encoding="utf-8")
    missing = [line for line in describe_fields().splitlines() if line not in text]
    assert not missing, "README config table is stale; regenerate from describe_fields():\n" + \
        "\n".join(missing)
