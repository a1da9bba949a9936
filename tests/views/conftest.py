"""A headless Chromium from the system packages (``apt-get install chromium chromium-driver``), driven by selenium
with the system chromedriver (nothing is downloaded): one browser per test module.

`open_page` loads a page from a file, waits for its script to finish (``body[data-ready]``) and returns what
reached the console and the network; `screenshot` saves the window for the docs (``docs/assets/views``) and
returns its pixel variance.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[2] / "docs" / "assets" / "views"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _chromium() -> tuple[str | None, str | None, str | None]:
    """``(browser, driver, why not)``."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, None, "selenium is not installed (pip install selenium; it is in the test extras)"
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return None, None, ("no Chromium here (apt-get install -y chromium chromium-driver; .ci/run installs them): "
                            "the browser tests of the views cannot run")
    return browser, driver, None


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium, 1280 x 900, logging the console and the network; closed after the module."""
    binary, driver_path, why = _chromium()
    if why:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,900", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def open_page(driver, path: Path, timeout: float = 20.0) -> dict:
    """Load ``path``; wait for the view to be ready. Returns ``{"errors": console errors, "requests": URLs asked
    for besides the page itself, "ready_ms": ms from navigation to the view's first drawing}``."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser"), driver.get_log("performance")  # drop what earlier pages left
    url = Path(path).resolve().as_uri()
    driver.get(url)
    WebDriverWait(driver, timeout).until(
        lambda d: d.execute_script("return document.body && document.body.dataset.ready === '1' "
                                   "|| !!window.__viewFailed"))
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    requests = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            asked = message["params"]["request"]["url"]
            if asked != url:
                requests.append(asked)
    requests += driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return {"errors": errors, "requests": requests, "ready_ms": driver.execute_script("return window.viewReady")}


def screenshot(driver, name: str, save: bool = True) -> float:
    """The variance of the window's grey levels; with ``save``, the window saved as ``docs/assets/views/<name>.png``
    (the docs' pictures)."""
    from PIL import Image, ImageStat

    png = driver.get_screenshot_as_png()
    if save:
        ASSETS.mkdir(parents=True, exist_ok=True)
        (ASSETS / f"{name}.png").write_bytes(png)
    return float(ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).var[0])
