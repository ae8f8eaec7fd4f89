"""The gateway's web page in a real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium): a key entered, a template uploaded, a mask drawn with the mouse, the edit submitted, its
progress shown step by step, the result displayed and listed among the results."""

from __future__ import annotations

import io
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from app.embedded import EmbeddedStack
from tests.support.gateway import ROOT, Gateway, auth, make_key
from tests.test_service import template

pytestmark = pytest.mark.integration

STEPS = 20


def browser_binaries() -> tuple[str, str]:
    """Chromium and its driver, installed from Debian's packages if missing (idempotent)."""
    out = subprocess.run(["bash", str(ROOT / "ops" / "deploy" / "install_chromium.sh"), "--driver"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    chromium, driver = out.stdout.split()[-2:]
    return chromium, driver


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = browser_binaries()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1300,1100"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    chrome.set_script_timeout(30)
    try:
        yield chrome
    finally:
        chrome.quit()


def test_an_edit_through_the_page(stack: EmbeddedStack, gateway: Gateway, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    tenant = f"page-{uuid.uuid4().hex[:8]}"
    key = make_key(stack, tenant)
    image = template(61)
    image_path = tmp_path / "template.png"
    image.save(image_path)
    wait = WebDriverWait(browser, 30)

    browser.get(gateway.url + "/")
    assert browser.title == "Stencil"
    browser.find_element(By.ID, "api-key").send_keys(key)
    browser.find_element(By.ID, "use-key").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "who"), f"tenant {tenant}"))
    browser.find_element(By.ID, "template-file").send_keys(str(image_path))
    mask = browser.find_element(By.ID, "mask-canvas")
    wait.until(lambda d: mask.get_attribute("data-loaded") == "1")
    assert browser.execute_script("return [arguments[0].width, arguments[0].height]", mask) == [128, 128]
    assert not browser.find_element(By.ID, "submit").is_enabled()  # nothing painted yet

    # Paint a stroke: 200 CSS px right then 80 down, from (-100, -40) off the canvas's centre. The canvas
    # shows the 128 px template at 512 px: 4 CSS px per image pixel; brush 48 CSS px = 12 image px.
    browser.execute_script("document.getElementById('brush').value = 48")
    actions = ActionChains(browser).move_to_element_with_offset(mask, -100, -40).click_and_hold()
    for _ in range(40):
        actions.move_by_offset(5, 0)
    for _ in range(16):
        actions.move_by_offset(0, 5)
    actions.release().perform()
    browser.find_element(By.ID, "prompt").send_keys("a red scarf")
    steps = browser.find_element(By.ID, "steps")
    steps.clear()
    steps.send_keys(str(STEPS))
    browser.find_element(By.ID, "submit").click()

    WebDriverWait(browser, 180).until(
        lambda d: d.execute_script("const r = document.getElementById('result'); "
                                   "return r.src.startsWith('blob:') && r.complete && r.naturalWidth > 0"))
    log = browser.execute_script("return [...document.querySelectorAll('#progress-log li')]"
                                 ".map(li => [li.dataset.status, +li.dataset.step, +li.dataset.total])")
    # The stream starts at the job's status when it connects (before denoising: a busy machine may
    # have routed the job already), then follows it in lifecycle order to done.
    order = ["queued", "routed", "preparing", "waiting", "denoising", "finalizing", "done"]
    assert log[0][0] in ("queued", "routed", "preparing") and log[-1] == ["done", STEPS, STEPS], log
    assert [order.index(status) for status, _, _ in log] == sorted(order.index(status) for status, _, _ in log), log
    assert any(0 < step < STEPS for _, step, _ in log), f"no progress shown between the first and last step: {log}"
    assert browser.find_element(By.ID, "progress").get_attribute("value") == str(STEPS)
    assert browser.execute_script("return document.getElementById('result').naturalWidth") == 128

    # The job exists for this tenant, and the drawn mask is where the result changed (keep_unmasked:
    # outside the mask the result is the template's own pixels).
    job_id = browser.find_element(By.ID, "result").get_attribute("data-job-id")
    job = requests.get(gateway.url + f"/v1/jobs/{job_id}", headers=auth(key), timeout=10).json()
    assert job["status"] == "done" and job["record"]["prompt"] == "a red scarf"
    result = np.asarray(Image.open(io.BytesIO(requests.get(gateway.url + job["result_url"], headers=auth(key),
                                                           timeout=10).content)).convert("RGB"), dtype=np.int16)
    original = np.asarray(image, dtype=np.int16)
    changed = np.abs(result - original).max(axis=2) > 1
    stroke = np.zeros_like(changed)
    stroke[50:60, 45:85] = True  # well inside the painted band (image px: y 48-62 along x 39-89)
    assert changed[stroke].mean() > 0.5, "the painted stroke was not edited"
    assert not changed[:30, :].any() and not changed[:, :25].any() and not changed[100:, :].any(), \
        "pixels far from the stroke changed: the mask is not the one drawn"

    WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('#gallery img')].some(i => i.dataset.jobId === arguments[0] "
        "&& i.complete && i.naturalWidth > 0)", job_id))
