"""Headless Chromium for the page's tests: found (or fetched), launched through Playwright, and
every page watched for console errors, uncaught exceptions and requests that leave the server.

Where the browser comes from, first found wins:
  $BACKBOARD_CHROMIUM                   an executable
  chromium, chromium-browser, google-chrome on PATH   (Debian: apt-get install chromium;
                                        .ci/run installs it)
  Playwright's own build                `python -m playwright install chromium` (tried once
                                        here, when nothing else is found; it downloads from a CDN)
With none, the tests are skipped with a reason that says how to get one, unless
$BACKBOARD_REQUIRE_BROWSER=1 (set by .ci/run once it has installed one): then they fail.

Screenshots go to test-artifacts/browser/ at the repository root (or $BACKBOARD_TEST_ARTIFACTS);
the path is printed at the end of the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_TIMEOUT_S = 300
ARTIFACTS = Path(os.environ.get("BACKBOARD_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parents[2] / "test-artifacts") / "browser"
WRITTEN: list[Path] = []                # screenshots of this session (printed at the end)
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 360, "height": 740}


def _playwright_build() -> str | None:
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            path = p.chromium.executable_path
    except Exception:  # noqa: BLE001 - no playwright, no build
        return None
    return path if os.path.isfile(path) else None


def find_chromium() -> str | None:
    env = os.environ.get("BACKBOARD_CHROMIUM")
    if env:
        return env if os.path.isfile(env) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return _playwright_build()


def get_chromium() -> tuple[str | None, str]:
    """(executable, how it was found or why there is none)."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return None, "the playwright package is missing: pip install -e '.[test]'"
    path = find_chromium()
    if path:
        return path, f"found {path}"
    try:
        r = subprocess.run([sys.executable, "-m", "playwright", "install", "chromium"],
                           capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        why = (r.stderr or r.stdout).strip().splitlines()[-1:] if r.returncode else []
    except subprocess.TimeoutExpired:
        why = [f"timed out after {INSTALL_TIMEOUT_S} s"]
    path = _playwright_build()
    if path:
        return path, f"installed Playwright's build at {path}"
    return None, ("no Chromium: install Debian's package (apt-get install chromium), or set "
                  "BACKBOARD_CHROMIUM=/path/to/chrome; `playwright install chromium` failed: "
                  + (" ".join(why) or "no build after it"))


@dataclass
class Watched:
    """What a page said that it should not have."""

    origin: str
    errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def attach(self, page) -> None:
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                if m.type in ("error", "assert") else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("request", self._request)

    def _request(self, req) -> None:
        url = req.url
        if not url.startswith((self.origin, "data:", "blob:", "about:")):
            self.foreign.append(url)

    def check(self) -> None:
        assert self.errors == [], "the page logged errors"
        assert self.foreign == [], "the page loaded something from elsewhere"


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    WRITTEN.append(path)
    return path


@pytest.fixture(scope="module")
def chromium():
    """A launched headless Chromium, for one test module: Playwright's sync API runs an event
    loop in this thread while it is open, which asyncio.run() elsewhere would trip over."""
    path, how = get_chromium()
    if path is None:
        if os.environ.get("BACKBOARD_REQUIRE_BROWSER") == "1":
            pytest.fail(f"BROWSER TESTS CANNOT RUN: {how}")
        pytest.skip(f"BROWSER TESTS SKIPPED: {how}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield browser
        browser.close()
