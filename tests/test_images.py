"""The main image builds here and its programs run from it, as `make images` builds it.

``scripts/images.sh`` builds with Docker when its daemon answers and otherwise with buildah and
podman (installed from Debian when missing) on a Debian base it makes, so on a machine without a
Docker daemon this is the same build a user gets. Layers are cached in the builder's storage from
one run to the next; from nothing the build takes a few minutes. ``WEIGHTSHIP_SKIP_IMAGES=1``
skips these tests, with that reason, on a machine that can build no image at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar, cast

import httpx
import pytest

from weightship.testing import eventually, free_port, terminate

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "images.sh"
IMAGE_REPO = "localhost/weightship-test"
IMAGE_TAG = "test"
IMAGE = f"{IMAGE_REPO}:{IMAGE_TAG}"
#: a build from nothing (base included) is about a minute here with overlay storage, a few with vfs
BUILD_TIMEOUT = 1200

_Test = TypeVar("_Test", bound=Callable[..., None])


def images(test: _Test) -> _Test:
    """Marks a test that needs the main image: slow, bounded by the build's time, skippable."""
    test = pytest.mark.slow(test)
    test = pytest.mark.timeout(BUILD_TIMEOUT + 300)(test)
    skip = os.environ.get("WEIGHTSHIP_SKIP_IMAGES") == "1"
    return cast(_Test, pytest.mark.skipif(skip, reason="WEIGHTSHIP_SKIP_IMAGES=1: this machine builds no image")(test))


def _script(*args: str) -> list[str]:
    return ["bash", str(SCRIPT), *args]


@pytest.fixture(scope="module")
def main_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The main image, built from this tree by ``scripts/images.sh build main``."""
    log = tmp_path_factory.mktemp("images") / "build.log"
    env = {**os.environ, "IMAGE_REPO": IMAGE_REPO, "IMAGE_TAG": IMAGE_TAG}
    with open(log, "wb") as out:
        built = subprocess.run(
            _script("build", "main"), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT
        )
    if built.returncode != 0:
        pytest.fail(f"scripts/images.sh build main failed ({built.returncode}); its log ends:\n{log.read_text()[-4000:]}")
    return IMAGE


@pytest.mark.parametrize(
    ("program", "says"),
    [
        ("weightship-controlplane", "serve"),
        ("weightship-agent", "--control-plane"),
        ("weightship-operator", "WEIGHTSHIP_URL"),
        ("weightship", "publish"),
    ],
)
@images
def test_each_program_prints_its_help_from_the_main_image(main_image: str, program: str, says: str) -> None:
    ran = subprocess.run(_script("run", main_image, program, "--help"), capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, f"{program} --help in {main_image} exited {ran.returncode}:\n{ran.stderr[-3000:]}"
    assert says in ran.stdout, ran.stdout


@pytest.fixture
def controlplane_container(main_image: str, tmp_path: Path) -> Iterator[str]:
    """The control plane from the image, on SQLite and a local-directory store in ``tmp_path``; its URL."""
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)  # the image runs as UID 10001
    port = free_port()
    name = f"weightship-test-controlplane-{port}"
    argv = _script(
        "run",
        "--name",
        name,
        "-v",
        f"{data}:/data",
        "-e",
        "WEIGHTSHIP_DATABASE_URL=sqlite:////data/cp.db",
        "-e",
        "WEIGHTSHIP_STORE=local:/data/origin",
        "-e",
        "WEIGHTSHIP_ADMIN_TOKEN=ws_image-tests-admin-token-0123456789abcdef",
        main_image,
        "weightship-controlplane",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    with open(tmp_path / "controlplane.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate(proc, grace=30)
        subprocess.run(_script("rm", name), timeout=60, check=False)
        sys.stdout.write((tmp_path / "controlplane.log").read_text()[-2000:])


@images
def test_control_plane_from_the_main_image_answers_readyz(controlplane_container: str) -> None:
    def ready() -> bool:
        with httpx.Client(timeout=2) as http:
            return http.get(controlplane_container + "/readyz").status_code == 200

    assert eventually(ready, 120, "the control plane in the main image to answer /readyz with 200")


def test_operator_help_names_its_settings_and_starts_nothing() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "controlplane.k8s", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert "usage: weightship-operator" in ran.stdout
    assert "WEIGHTSHIP_OPERATOR_NAMESPACES" in ran.stdout
