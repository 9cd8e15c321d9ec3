"""The web page in a real browser: headless Debian Chromium, driven by Selenium through chromedriver.

Skips, printing why, when ``chromium`` / ``chromedriver`` (Debian packages ``chromium`` and
``chromium-driver``) or the ``selenium`` package are missing. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import CORPUS, WORKLOAD
from samples import pdf_bytes
from serve_helpers import BOUNDS, running_server, workload_page_with_text

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
)


def skip_loudly(reason: str) -> None:
    print(f"SKIPPED browser test: {reason}")
    pytest.skip(reason)


def browser(tmp_path):
    """A headless Chromium session with a fresh profile, or a skip with the reason printed."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            skip_loudly(f"{path} not found: apt-get install -y chromium chromium-driver (Debian package {package})")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        skip_loudly("selenium is not installed: pip install -e '.[dev]'")
    for module in ("fastapi", "uvicorn", "prometheus_client", "multipart", "httpx"):
        pytest.importorskip(module, reason="the serve extra is not installed: pip install 'mineru-fast[serve]'")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    return driver


def test_web_page_uploads_a_document_and_shows_markdown_and_layout(tiny_model, tmp_path, request):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser(tmp_path)
    trace_path, expected = None, None
    if WORKLOAD.exists():  # a replayed workload page: real text must show up
        found = workload_page_with_text(request.getfixturevalue("workload_traces"), 40 * 1024 * 1024)
        assert found is not None
        document, trace_path, blocks, trace = found
        texts = [c.strip() for b, c in zip(blocks, trace.contents, strict=True) if b.type in ("text", "title") and c]
        firsts = [t.splitlines()[0][:40].strip() for t in texts]
        plain = [f for f in firsts if not set(f) & set("*_`~$\\<>&#+-")]
        expected = plain[0] if plain else None  # text the Markdown writer leaves as it is
    else:  # a one-page PDF with a replayed text block of our own: the random-weight model's text is empty
        if (CORPUS / "academic_fig_eq_table_1p.pdf").exists():
            document = CORPUS / "academic_fig_eq_table_1p.pdf"
        else:
            document = tmp_path / "sample.pdf"
            document.write_bytes(pdf_bytes(1))
        expected = "mineru-fast browser check"
        layout = "<|box_start|>100 100 900 200<|box_end|><|ref_start|>text<|ref_end|><|rotate_up|>"
        trace_path = tmp_path / "trace.json"
        trace_path.write_text(json.dumps({"pages": [{"layout": layout, "contents": [expected]}]}))
    try:
        with running_server(tiny_model, tmp_path, "--allow-replay", "--max-new-tokens", BOUNDS) as server:
            driver.get(f"{server.url}/")
            assert driver.title == "mineru-fast"
            driver.find_element(By.ID, "file").send_keys(str(document))
            if trace_path is not None:
                driver.find_element(By.TAG_NAME, "summary").click()
                driver.find_element(By.ID, "replay").send_keys(str(trace_path))
            driver.find_element(By.ID, "submit").click()
            status = driver.find_element(By.ID, "status")
            WebDriverWait(driver, 120, poll_frequency=0.2).until(
                lambda d: status.get_attribute("data-state") in ("done", "failed")
            )
            assert status.get_attribute("data-state") == "done", status.text
            assert "1 page(s)" in status.text
            markdown = driver.find_element(By.ID, "markdown").text
            assert markdown.strip()
            if expected:
                assert expected in markdown
            overlays = driver.execute_script(
                "return Array.from(document.querySelectorAll('#overlays img'))"
                ".map(i => [i.complete, i.naturalWidth, i.naturalHeight]);"
            )
            assert len(overlays) == 1 and overlays[0][0] and overlays[0][1] > 100 and overlays[0][2] > 100
            driver.save_screenshot(str(tmp_path / "web-page.png"))
    finally:
        driver.quit()
