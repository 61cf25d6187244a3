"""What a person sees on /ui/ in a real browser, against a real control plane and real agents.

Headless Chromium (Debian's, driven by its chromedriver through Selenium) signs in with a
``read`` token and, with no reload, watches: a rollout moving from step to step, its abort rolling
the canary back (shown within 2 s of the API answering), and a node whose fetch is stuck, named
with the reason its agent reported. A screenshot of each state is kept under the test's
``tmp_path``. ``make test`` installs Chromium (``scripts/chromium.sh``) and sets
``WEIGHTSHIP_TEST_CHROMEDRIVER``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.agent.agent_processes import AgentProcess, eventually
from tests.agent.controlplane_process import ControlPlaneProcess
from weightship.manifest import parse_manifest
from weightship.schemas import VersionState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

DRIVER = os.environ.get("WEIGHTSHIP_TEST_CHROMEDRIVER", "")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """Headless Chromium, driven through Debian's chromedriver."""
    if not DRIVER:
        pytest.skip("WEIGHTSHIP_TEST_CHROMEDRIVER is not set; `make test` installs Chromium and sets it")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1600"):
        options.add_argument(argument)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER, log_output=str(tmp_path / "chromedriver.log")))
    try:
        yield driver
    finally:
        driver.quit()


def text(browser: webdriver.Chrome, css: str) -> str:
    """The visible text of every element ``css`` selects, read in one step (the page swaps sections in while we read)."""
    script = "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.innerText).join(' ')"
    return str(browser.execute_script(script, css))


def shown(browser: webdriver.Chrome, css: str, within: float, what: str, test: Callable[[str], bool]) -> str:
    """Wait until the text of ``css`` on the page passes ``test``; that text."""

    seen: list[str] = []

    def found(_: object) -> str | None:
        now = text(browser, css)
        if not seen or seen[-1] != now:
            seen.append(now)
        return now if now and test(now) else None

    try:
        return str(WebDriverWait(browser, within, poll_frequency=0.05).until(found))
    except Exception as exc:
        raise AssertionError(f"the page did not show {what} within {within} s (at {css!r}; it showed {seen})") from exc


async def test_a_person_sees_a_rollout_step_its_rollback_and_a_stuck_node_without_reloading(
    tmp_path: Path, make_model: Callable[..., Path], browser: webdriver.Chrome, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_ROLLOUT_TICK_SECONDS", "0.2")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    cp = ControlPlaneProcess(tmp_path / "controlplane")
    cp.start()
    agents: list[AgentProcess] = []
    try:
        await cp.ready()
        with cp.client() as admin:
            v1 = admin.publish_directory(make_model("v1", tensors_mb=0.25, seed=1), "m", ["v1"], chunk_size=65536)
            v2 = admin.publish_directory(make_model("v2", tensors_mb=0.25, seed=2), "m", ["v2"], chunk_size=65536)
            v3 = admin.publish_directory(make_model("v3", tensors_mb=0.25, seed=3), "m", ["v3"], chunk_size=65536)
            kept = {f.sha256 for v in (v1, v2) for f in parse_manifest(admin.get_manifest("m", v.version.digest)).files}
            gone = [f.sha256 for f in parse_manifest(admin.get_manifest("m", v3.version.digest)).files if f.sha256 not in kept]
            agent_token = admin.create_token("ui-agents", "agent").token
            reader = admin.create_token("ui-watcher", "read").token
            for name, ref in (("chat", "v1"), ("batch", "v1")):
                admin.create_deployment(name, "m")
                admin.set_pointer(name, ref, expected_epoch=0)
        # v3's weights vanish from the origin: a node told to fetch them is stuck, and says why
        for sha in gone:
            (cp.workdir / "origin" / "blobs" / "sha256" / sha).unlink()
        (tmp_path / "fleet").mkdir()
        for name, deployment in (("node-a", "chat"), ("node-b", "chat"), ("node-stuck", "batch")):
            agents.append(AgentProcess(tmp_path / "fleet", name, cp.url, agent_token, [deployment]))
        for agent in agents:
            agent.start()
        for agent in agents:
            await agent.ready()
        await asyncio.gather(*(a.serving(v1.version.digest, a.deployments[0], within=60) for a in agents))

        browser.get(cp.url + "/ui/")
        browser.find_element(By.ID, "token").send_keys(reader)
        browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        shown(browser, "#deployments .deployment h3", 10, "the deployments", lambda t: "chat" in t and "batch" in t)
        shown(browser, "#live", 10, "the stream connected", lambda t: t.startswith("live"))
        browser.execute_script("window.__notReloaded = true")
        browser.save_screenshot(str(shots / "1-signed-in.png"))

        with cp.client() as admin:
            rollout = admin.start_rollout(
                "chat",
                {"version": "v2", "steps": [{"setWeight": 50}, {"pause": {"duration": "1s"}}, {"setWeight": 100}, {"pause": {}}]},
            )
        chat = "#dep-chat .rollout"
        shown(browser, chat + " .weight", 10, "the canary at 50 %", lambda t: t == "50%")
        first = text(browser, chat + " .stepno")
        assert first in ("step 1 of 4", "step 2 of 4"), first
        browser.save_screenshot(str(shots / "2-rollout-at-50.png"))
        shown(browser, chat + " .stepno", 30, "the rollout's last step", lambda t: t == "step 4 of 4")
        assert text(browser, chat + " .weight") == "100%"
        assert "v2" in text(browser, "#dep-chat dd.canary")
        browser.save_screenshot(str(shots / "3-rollout-step-4.png"))

        with cp.client() as admin:
            admin.act_on_rollout("chat", "abort", rollout.id)
        aborted_at = time.monotonic()
        shown(browser, "#dep-chat dd.canary", 2, "the canary rolled back", lambda t: t == "none")
        took = time.monotonic() - aborted_at
        assert text(browser, "#dep-chat dd.stable") == "v1"
        assert text(browser, "#dep-chat .timeline li:first-child > b") == "abort"
        browser.save_screenshot(str(shots / "4-rolled-back.png"))

        with cp.client() as admin:
            admin.set_pointer("batch", "v3", expected_epoch=admin.get_deployment("batch").epoch, reason="stuck on purpose")

            def stuck_reason() -> str | None:
                node = next(n for n in admin.list_nodes() if n.name == "node-stuck")
                item = next((i for i in node.inventory if i.digest == v3.version.digest and i.problem), None)
                return item.problem.reason.value if item and item.problem and item.state != VersionState.ready else None

            reason = await eventually(stuck_reason, 30, "node-stuck to report its fetch of v3 stuck")
        row = shown(browser, "#problems tr", 15, "node-stuck with its reason", lambda t: "node-stuck" in t and reason in t)
        assert "v3" in row
        browser.save_screenshot(str(shots / "5-stuck-node.png"))
        assert browser.execute_script("return window.__notReloaded === true"), "the page reloaded"
        print(f"rollback shown {took:.2f} s after the abort answered; screenshots in {shots}")
    finally:
        for agent in agents:
            await agent.close()
        cp.stop()
