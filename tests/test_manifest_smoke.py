"""Placeholder smoke test of the manifest build/parse round trip (full tests: tests/weightship)."""

from pathlib import Path

from weightship.manifest import build_manifest, parse_manifest


def test_built_manifest_round_trips(make_model) -> None:  # type: ignore[no-untyped-def]
    root: Path = make_model(shards=2)
    manifest = build_manifest(root, "tiny", chunk_size=65536)
    assert parse_manifest(manifest.raw).digest == manifest.digest
