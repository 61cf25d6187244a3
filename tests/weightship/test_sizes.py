"""The one size parser and formatter: binary units whatever the spelling, clear errors for anything else."""

from __future__ import annotations

import pytest

from weightship.errors import ValidationError
from weightship.sizes import format_size, parse_size

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1048576),
        ("0", 0),
        (7, 7),
        ("500M", 500 * 2**20),
        ("500MB", 500 * 2**20),
        ("500MiB", 500 * 2**20),
        ("500m", 500 * 2**20),
        ("20GiB", 20 * 2**30),
        ("20G", 20 * 2**30),
        ("20gb", 20 * 2**30),
        ("64k", 64 * 1024),
        ("64 KiB", 64 * 1024),
        ("2T", 2 * 2**40),
        ("1P", 2**50),
        ("1.5KiB", 1536),
        ("0.5G", 2**29),
        ("12B", 12),
        (" 3 M ", 3 * 2**20),
    ],
)
def test_sizes_use_binary_units_whatever_the_spelling(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "M", "-1", "1e6", "five", "10 parsecs", "1.5", "0.3K", "1,5G", "1KiBB", "1iB", "1X"]
)
def test_anything_else_is_a_validation_error_that_shows_the_form(text: str) -> None:
    with pytest.raises(ValidationError, match=r"500MiB|smaller unit"):
        parse_size(text)


def test_negative_integers_are_refused() -> None:
    with pytest.raises(ValidationError, match="negative"):
        parse_size(-1)


def test_the_cli_and_the_agent_read_a_size_the_same_way() -> None:
    from agent.config import load_config
    from weightship.cli.commands import _parse_size

    config = load_config(["--control-plane", "http://cp:8080", "--quota", "500M"], {})
    assert config.quota_bytes == _parse_size("500M") == 500 * 2**20


@pytest.mark.parametrize(
    ("size", "shown"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (12 * 2**20, "12.0 MiB"), (3 * 2**40, "3.0 TiB"), (2**52, "4096.0 TiB")],
)
def test_format_size_shows_binary_units_that_parse_back(size: int, shown: str) -> None:
    assert format_size(size) == shown
    assert parse_size(shown.replace(" ", "")) == size
