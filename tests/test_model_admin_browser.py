"""The admin's Models page in a real browser: a GGUF file chosen in the add form goes up in parts through
/api/models/ (the page's script), and the model appears in the list with the figures read from the file."""

from __future__ import annotations

import os

import pytest

from nodes.agent.engine.local import bundled_model_path
from tests.test_pages_browser import browser, login  # noqa: F401 - the browser fixture, reused

pytestmark = pytest.mark.slow


def test_a_model_uploaded_in_the_admin_goes_up_in_parts_and_is_listed(browser, fresh_head):  # noqa: F811
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    head = fresh_head

    login(browser, head)
    browser.get(f"{head.url}/admin/nodes/model/add/")
    browser.find_element(By.ID, "model-name").send_keys("tiny-chat")
    browser.find_element(By.ID, "model-file").send_keys(bundled_model_path())
    browser.find_element(By.ID, "model-upload-go").click()
    # The page leaves for the list once the upload is done: a status element found just before it left is stale.
    WebDriverWait(browser, 180, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(
        lambda b: "/admin/nodes/model/?q=tiny-chat" in b.current_url
        or "Refused" in b.find_element(By.ID, "model-upload-status").text)
    assert "?q=tiny-chat" in browser.current_url, browser.page_source[-2000:]
    row = browser.find_element(By.XPATH, "//tr[.//a[text()='tiny-chat']]").text
    assert "llama" in row and "Q4_1" in row and "8192" in row.replace(",", "")
    parts = head.log_path.read_text().count('"PUT /api/models/uploads/')
    assert parts == -(-os.path.getsize(bundled_model_path()) // (4 * 1024 * 1024 - 4096))  # one request a part


def test_a_file_that_is_not_a_model_is_refused_on_the_page(browser, fresh_head, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    head = fresh_head

    junk = tmp_path / "notes.gguf"
    junk.write_text("not a model at all\n" * 100)
    login(browser, head)
    browser.get(f"{head.url}/admin/nodes/model/add/")
    browser.find_element(By.ID, "model-name").send_keys("junk")
    browser.find_element(By.ID, "model-file").send_keys(str(junk))
    browser.find_element(By.ID, "model-upload-go").click()
    status = WebDriverWait(browser, 60).until(
        lambda b: b.find_element(By.ID, "model-upload-status").text if "Refused" in
        b.find_element(By.ID, "model-upload-status").text else None)
    assert status.startswith("Refused: the file is refused: it is not a GGUF file"), status
