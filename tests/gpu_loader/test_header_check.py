"""The quick header comparison agrees with the full safetensors parse whenever it says "same"."""

from __future__ import annotations

import json

import pytest

from gpu_loader.version import _same_header
from weightship.errors import ManifestError
from weightship.safetensors_header import parse_header

BASE = {
    "__metadata__": {"format": "pt"},
    "a.weight": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
    "b.bias": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
}
DATA = 16


def header(doc: dict[str, object], **dumps: object) -> bytes:
    return json.dumps(doc, **dumps).encode()  # type: ignore[arg-type]


def with_entry(name: str, **changes: object) -> dict[str, object]:
    doc: dict[str, object] = json.loads(json.dumps(BASE))
    entry = doc[name]
    assert isinstance(entry, dict)
    entry.update(changes)
    return doc


EXPECTED_RAW = header(BASE)
EXPECTED = parse_header(EXPECTED_RAW, len(EXPECTED_RAW), 8 + len(EXPECTED_RAW) + DATA, "x")

CASES = [
    ("same bytes", EXPECTED_RAW, True),
    ("other key order and spacing", header(dict(reversed(list(BASE.items()))), indent=2), True),
    ("dtype differs", header(with_entry("a.weight", dtype="F16")), False),
    ("offsets differ", header(with_entry("b.bias", data_offsets=[12, 17])), False),
    ("bool in a shape", EXPECTED_RAW.replace(b"[1]", b"[true]"), False),
    ("float in offsets", EXPECTED_RAW.replace(b"[12, 16]", b"[12.0, 16]"), False),
    ("extra field in an entry", header(with_entry("a.weight", extra=1)), False),
    ("metadata differs", header({**BASE, "__metadata__": {"format": "np"}}), False),
    ("no metadata", header({k: v for k, v in BASE.items() if k != "__metadata__"}), False),
    ("a tensor missing", header({k: v for k, v in BASE.items() if k != "b.bias"}), False),
    ("not JSON", b"{not json", False),
    ("not UTF-8", b'{"\xff": 1}', False),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("raw", "quick"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_quick_header_check_says_same_only_when_the_full_parse_does(raw: bytes, quick: bool) -> None:
    assert _same_header(raw, EXPECTED) is quick
    if quick:
        assert parse_header(raw, len(EXPECTED_RAW), EXPECTED.data_start + DATA, "x") == EXPECTED
    else:
        try:
            full = parse_header(raw, len(EXPECTED_RAW), EXPECTED.data_start + DATA, "x")
        except ManifestError:
            return
        # The quick check may defer to the full one on a header that is in fact equal (extra fields).
        assert full != EXPECTED or raw == header(with_entry("a.weight", extra=1))
