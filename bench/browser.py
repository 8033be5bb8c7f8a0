"""A real browser for the report's page: Debian's headless Chromium driven by Selenium 4 through chromedriver.

Shared by ``bench/report_scale.py`` and the browser tests (tests/reporting/test_explorer_browser.py loads this file by
its path). Every helper acts as a reader does: open the page from ``file://``, read the console, hover and click
cells of a plotly heat map at their pixel positions (found from plotly's own axes), press the method switch.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMEDRIVER = ("/usr/bin/chromedriver",)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000")


def found(paths: tuple[str, ...]) -> str | None:
    """The first of ``paths`` that exists (or one on PATH by its name)."""
    for p in paths:
        if Path(p).is_file():
            return p
    return next((w for w in (shutil.which(Path(p).name) for p in paths) if w), None)


def available() -> str | None:
    """None when Chromium, chromedriver and Selenium are all here, else what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e .[dev])"
    if found(CHROMIUM) is None or found(CHROMEDRIVER) is None:
        return "chromium or chromedriver is missing (make install adds Debian's chromium and chromium-driver)"
    return None


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Chromium (a fresh profile folder, removed after) whose console log the driver can read."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="headsweep-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = found(CHROMIUM) or CHROMIUM[0]
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(found(CHROMEDRIVER) or CHROMEDRIVER[0]), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(driver, page: Path, timeout: float = 60.0, everything: bool = False) -> float:
    """Load ``page`` from ``file://`` and wait until its first figure is drawn (the explorer draws the others as
    they come near the viewport; ``everything``: draw and wait for all of them); returns the seconds from the start
    of navigation to that moment, as the page's own clock says."""
    driver.get(page.resolve().as_uri())
    wait_for(driver, "const d = document.querySelector('.plot[id]'); return d !== null && d.dataset.drawn === 'yes'",
             timeout)
    first = float(driver.execute_script("return Number(document.querySelector('.plot[id]').dataset.drawnAt)"))
    if everything:
        driver.execute_script("window.headsweepDrawAll()")
        wait_for(driver, "return Array.from(document.querySelectorAll('.plot[id]'))"
                         ".every(d => d.dataset.drawn === 'yes')", timeout)
    return first / 1000.0


def wait_for(driver, script: str, timeout: float = 10.0) -> None:
    """Wait until the JavaScript ``script`` returns true."""
    end = time.monotonic() + timeout
    while not driver.execute_script(script):
        if time.monotonic() > end:
            raise TimeoutError(f"the page never satisfied: {script}")
        time.sleep(0.02)


def console_errors(driver) -> list[str]:
    """The console's messages at level SEVERE (errors) since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


CELL_JS = """
const div = document.getElementById(arguments[0]);
const name = arguments[1];
const full = div._fullData;
for (let i = 0; i < full.length; i++) {
  const t = full[i];
  if (t.type !== 'heatmap' || t.visible !== true) continue;
  for (let y = 0; y < t.customdata.length; y++) {
    const x = t.customdata[y].indexOf(name);
    if (x < 0) continue;
    const xa = t.xaxis === 'x' ? div._fullLayout.xaxis : div._fullLayout['xaxis' + t.xaxis.slice(1)];
    const ya = t.yaxis === 'y' ? div._fullLayout.yaxis : div._fullLayout['yaxis' + t.yaxis.slice(1)];
    // Selenium's offsets count from the element's in-view centre: the centre of its part inside the viewport.
    const box = div.getBoundingClientRect();
    const left = Math.max(box.left, 0), right = Math.min(box.right, window.innerWidth);
    const top = Math.max(box.top, 0), bottom = Math.min(box.bottom, window.innerHeight);
    const cx = (left + right) / 2 - box.left, cy = (top + bottom) / 2 - box.top;
    return [xa._offset + xa.l2p(x) - cx, ya._offset + ya.l2p(y) - cy];
  }
}
return null;
"""


def cell_offset(driver, element: str, head: str) -> tuple[int, int]:
    """The pixel offset, from the figure's centre, of head ``head``'s cell on heat map ``element``."""
    offset = driver.execute_script(CELL_JS, element, head)
    if offset is None:
        raise LookupError(f"no visible cell of {head} on {element}")
    return round(offset[0]), round(offset[1])


def hover_cell(driver, element: str, head: str) -> str:
    """Move the mouse onto ``head``'s cell and return the hover label's text plotly shows."""
    from selenium.webdriver.common.action_chains import ActionChains

    div = driver.find_element("id", element)
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", div)
    wait_for(driver, f"return document.getElementById('{element}').dataset.drawn === 'yes'", 30)
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", div)  # where it is once drawn
    x, y = cell_offset(driver, element, head)
    ActionChains(driver).move_to_element_with_offset(div, x, y).perform()
    wait_for(driver, f"return document.querySelector('#{element} .hoverlayer .hovertext') !== null", 5)
    return driver.execute_script(f"return document.querySelector('#{element} .hoverlayer .hovertext').textContent")


def click_cell(driver, element: str, head: str, key: str, timeout: float = 10.0) -> float:
    """Click ``head``'s cell and wait for drill-down ``drill-<key>`` to show it; returns the seconds it took."""
    from selenium.webdriver.common.action_chains import ActionChains

    div = driver.find_element("id", element)
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", div)
    wait_for(driver, f"return document.getElementById('{element}').dataset.drawn === 'yes'", timeout)
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", div)  # where it is once drawn
    x, y = cell_offset(driver, element, head)
    start = time.perf_counter()
    ActionChains(driver).move_to_element_with_offset(div, x, y).click().perform()
    wait_for(driver, f"const p = document.getElementById('drill-{key}'); return p && !p.hidden && "
                     f"p.dataset.head === {head!r}", timeout)
    return time.perf_counter() - start


def press_button(driver, element: str, label: str) -> None:
    """Click the button labelled ``label`` of figure ``element``'s switch (plotly's update menu)."""
    from selenium.webdriver.common.action_chains import ActionChains

    div = driver.find_element("id", element)
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", div)
    for button in div.find_elements("css selector", "g.updatemenu-button"):
        if button.text.strip() == label or label in button.text:
            ActionChains(driver).move_to_element(button).click().perform()
            return
    raise LookupError(f"no button {label!r} on {element}")


def visible_heatmap(driver, element: str) -> list:
    """The z values of the first visible heat map trace of figure ``element``."""
    return driver.execute_script(
        "const d = document.getElementById(arguments[0]);"
        "const t = d._fullData.find(t => t.type === 'heatmap' && t.visible === true);"
        "return t ? Array.from(t.z, row => Array.from(row)) : null",
        element)


def screenshot(driver, path: Path, element: str | None = None) -> Path:
    """A PNG of the window (or of one element) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if element is None:
        driver.save_screenshot(str(path))
    else:
        driver.find_element("id", element).screenshot(str(path))
    return path
