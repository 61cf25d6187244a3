"""The epoch book: lower epochs refused, the highest accepted epoch persisted across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.epochs import EpochBook, StaleEpochError

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64


def test_lower_epoch_is_refused_and_equal_or_higher_accepted(tmp_path: Path) -> None:
    book = EpochBook(tmp_path / "deployments.json")
    book.accept("chat", 4, "m", D2)
    book.apply("chat", 4, D2, "m")
    with pytest.raises(StaleEpochError, match="epoch 3 is lower than epoch 4"):
        book.accept("chat", 3, "m")
    assert book.accept("chat", 4, "m", D2).accepted_epoch == 4
    assert book.accept("chat", 9, "m").accepted_epoch == 9
    # applying epoch 9 later keeps the record consistent
    record = book.apply("chat", 9, D1, "m")
    assert (record.applied_epoch, record.digest, record.accepted_epoch) == (9, D1, 9)


def test_accepted_epoch_survives_a_restart_even_before_it_is_applied(tmp_path: Path) -> None:
    path = tmp_path / "deployments.json"
    book = EpochBook(path)
    book.apply("chat", 2, D1, "m")
    book.accept("chat", 7, "m")  # accepted, version still being fetched
    reopened = EpochBook(path)
    record = reopened.get("chat")
    assert record is not None
    assert (record.accepted_epoch, record.applied_epoch, record.digest) == (7, 2, D1)
    with pytest.raises(StaleEpochError):
        reopened.accept("chat", 6, "m")


def test_deployments_are_independent(tmp_path: Path) -> None:
    book = EpochBook(tmp_path / "deployments.json")
    book.accept("a", 10, "m")
    assert book.accept("b", 1, "m").accepted_epoch == 1
    assert [r.name for r in book.records()] == ["a", "b"]


def test_the_accepted_epoch_naming_another_digest_is_refused(tmp_path: Path) -> None:
    book = EpochBook(tmp_path / "epochs.json")
    v1, v2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    book.accept("chat", 3, "m", v1)
    assert book.accept("chat", 3, "m", v1).accepted_epoch == 3  # the same pointer again is fine
    with pytest.raises(StaleEpochError, match="already accepted naming"):
        EpochBook(tmp_path / "epochs.json").accept("chat", 3, "m", v2)
    assert book.accept("chat", 4, "m", v2).accepted_digest == v2
