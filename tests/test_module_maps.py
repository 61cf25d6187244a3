"""Each component's ``__init__`` names its modules, the architecture page its layers, and no test module imports another."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(30)


def modules_of(package: str) -> list[str]:
    """The modules (``name``) and subpackages (``name/``) directly inside ``package``."""
    folder = REPO / package
    found = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
    found += [f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return sorted(found)


@pytest.mark.parametrize("package", ["controlplane", "agent", "gpu_loader", "weightship"])
def test_the_package_map_names_every_module(package: str) -> None:
    doc = importlib.import_module(package).__doc__ or ""
    listed = set(re.findall(r"^- ``([\w/]+)``: \S", doc, re.MULTILINE))
    missing = [name for name in modules_of(package) if name not in listed]
    assert not missing, f"add a one-line entry for {missing} to the module map in {package}/__init__.py"


def test_the_architecture_page_puts_every_control_plane_module_in_a_layer() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    table = page[page.index("| layer | modules | holds |") :].split("\n\n")[0]
    named = set(re.findall(r"`([\w]+)/?`", table))
    missing = [name for name in modules_of("controlplane") if name.rstrip("/") not in named]
    assert not missing, f"docs/architecture.md's layer table leaves out {missing}"


def test_no_test_module_imports_another() -> None:
    """Shared helpers and fixtures live in helper modules and conftest files, never in a ``test_*.py``."""
    pattern = re.compile(r"^\s*(?:from tests(?:\.\w+)*\.test_\w+ import|import tests(?:\.\w+)*\.test_\w+)", re.MULTILINE)
    offenders = [
        str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("*.py") if pattern.search(path.read_text())
    ]
    assert not offenders, f"these import a test module; move what they share to a helper module or conftest: {offenders}"


def test_no_check_skips_because_a_project_file_is_missing() -> None:
    """A missing file of the project fails its checks; it never turns them into skips."""
    pattern = re.compile(r"(?:skipif\([^)]*(?:exists|is_file)\(\)|if not [^\n]*(?:exists|is_file)\(\):\n\s*pytest\.skip)")
    offenders = [
        str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("*.py") if pattern.search(path.read_text())
    ]
    assert not offenders, f"these skip when a file is missing; let the check fail instead: {offenders}"
