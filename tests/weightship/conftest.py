"""Fixtures for the contract's and the CLI's tests."""

from __future__ import annotations

from tests.weightship.cli_parts import controlplane as controlplane  # a control plane serving in a thread
from tests.weightship.cli_parts import models as models  # models published to it
