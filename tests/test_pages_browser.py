"""The operator's pages in a real browser (headless Chromium): log in, the fleet page (live: pushed over its
websocket as nodes join and leave), a node action, a generation's and a node's pages, API docs, the playground.
The pages' screenshots go to docs/screenshots/ (docs/operations.md shows them)."""

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOTS = Path(__file__).resolve().parent.parent / "docs" / "screenshots"


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("Chromium and chromedriver are needed for the page tests: `make test` installs them "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def login(browser, head):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.delete_all_cookies()
    browser.get(f"{head.url}/admin/login/")
    browser.find_element(By.NAME, "username").send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys("test-password-1")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    # the login page carries the site header too: wait until the browser has left it for the admin index
    WebDriverWait(browser, 20).until(lambda b: "/admin/login/" not in b.current_url
                                     and b.execute_script("return document.readyState") == "complete")
    assert "Fleet administration" in browser.page_source and "Log out" in browser.page_source


def test_fleet_page_shows_the_live_node(browser, live_head, live_node, tmp_path):
    from selenium.webdriver.common.by import By

    login(browser, live_head)
    browser.find_element(By.LINK_TEXT, "Fleet overview").click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#fleet-nodes tbody tr")
    text = " ".join(r.text for r in rows)
    assert "node-a" in text and "online" in text and "smollm2" in text
    assert "smollm2" in browser.find_element(By.ID, "fleet-models").text
    browser.save_screenshot(str(tmp_path / "fleet.png"))
    assert (tmp_path / "fleet.png").stat().st_size > 10_000


def test_drain_and_uncordon_a_node_from_the_changelist(browser, live_head, live_node):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    login(browser, live_head)

    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    def act(action):
        browser.get(f"{live_head.url}/admin/nodes/node/")
        old = browser.find_element(By.ID, "result_list")
        browser.find_element(By.CSS_SELECTOR, "input.action-select").click()
        Select(browser.find_element(By.NAME, "action")).select_by_value(action)
        browser.find_element(By.NAME, "index").click()
        WebDriverWait(browser, 15).until(expected_conditions.staleness_of(old))  # the action's page loaded
        return browser.find_element(By.ID, "result_list").text

    try:
        assert "draining" in act("drain")
    finally:
        assert "online" in act("uncordon")


def test_api_docs_page_lists_the_endpoints(browser, live_head):
    browser.get(f"{live_head.url}/api/docs/")
    page = browser.page_source
    assert "/api/nodes/" in page and "/v1/chat/completions" in page


def test_the_playground_streams_an_answer_with_the_node_and_usage(browser, live_head, live_node, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    login(browser, live_head)
    browser.find_element(By.LINK_TEXT, "Playground").click()
    assert "smollm2" in browser.find_element(By.ID, "pg-model").text
    browser.find_element(By.ID, "pg-system").send_keys("You are a friendly assistant.")
    browser.find_element(By.ID, "pg-message").send_keys("Say hello")
    max_tokens = browser.find_element(By.ID, "pg-max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("32")
    browser.find_element(By.ID, "pg-send").click()
    usage = WebDriverWait(browser, 120).until(
        lambda b: b.find_element(By.ID, "pg-usage").text or b.find_element(By.ID, "pg-error").text)
    assert "node-a" in usage and "completion" in usage, usage
    assert browser.find_element(By.ID, "pg-answer").text.strip()
    assert not browser.find_element(By.ID, "pg-error").text
    browser.save_screenshot(str(tmp_path / "playground.png"))
    assert (tmp_path / "playground.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def speech_head(tmp_path_factory):
    """A head of its own whose one node serves only a speech model (`node_join --transcribe whisper-tiny.en`)."""
    from tests.live import make_head, start_node

    head = make_head(tmp_path_factory.mktemp("speech"))
    head.start()
    node = start_node(head, "--transcribe", "whisper-tiny.en", identity="ears", model="")
    head.wait_nodes(1, timeout=180)
    yield head
    node.stop()
    head.stop()


def test_the_playground_transcribes_an_audio_file_on_a_speech_model(browser, speech_head, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from tests.speech import SENTENCE, WORDS, speak

    wav = speak(SENTENCE, tmp_path / "speech.wav")
    login(browser, speech_head)
    browser.get(f"{speech_head.url}/admin/playground/")
    Select(browser.find_element(By.ID, "pg-model")).select_by_value("whisper-tiny.en")
    assert not browser.find_element(By.ID, "pg-message").is_displayed()
    browser.find_element(By.ID, "pg-audio").send_keys(str(wav))
    browser.find_element(By.ID, "pg-send").click()
    usage = WebDriverWait(browser, 60).until(
        lambda b: b.find_element(By.ID, "pg-usage").text or b.find_element(By.ID, "pg-error").text)
    assert "ears" in usage and "audio" in usage, usage
    heard = set(re.findall(r"[a-z]+", browser.find_element(By.ID, "pg-answer").text.lower()))
    assert len(WORDS & heard) >= len(WORDS) - 1, heard
    assert not browser.find_element(By.ID, "pg-error").text


@pytest.fixture(scope="module")
def vision_head(tmp_path_factory):
    """A head of its own whose one node reads images (`node_join --mmproj`, the test projector)."""
    from tests.live import make_head, start_node
    from tests.vision_projector import build_projector

    projector = build_projector(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf")
    head = make_head(tmp_path_factory.mktemp("vision"))
    head.start()
    node = start_node(head, "--mmproj", str(projector), "--max-batch", "2", "--max-context", "512", identity="eyes")
    head.wait_nodes(1, timeout=180)
    yield head
    node.stop()
    head.stop()


def test_the_playground_sends_an_image_attachment_on_a_model_with_vision(browser, vision_head, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.vision_projector import IMAGE_TOKENS, png

    image = tmp_path / "picture.png"
    image.write_bytes(png(seed=5))
    login(browser, vision_head)
    browser.get(f"{vision_head.url}/admin/playground/")
    assert browser.find_element(By.ID, "pg-image").is_displayed()
    browser.find_element(By.ID, "pg-message").send_keys("What is in this picture?")
    browser.find_element(By.ID, "pg-image").send_keys(str(image))
    browser.find_element(By.ID, "pg-send").click()
    usage = WebDriverWait(browser, 120).until(
        lambda b: b.find_element(By.ID, "pg-usage").text or b.find_element(By.ID, "pg-error").text)
    assert "eyes" in usage and "completion" in usage, usage
    from openai import OpenAI

    client = OpenAI(base_url=f"{vision_head.url}/v1", api_key=vision_head.api_key, max_retries=0)
    text_only = client.chat.completions.create(model="smollm2", max_tokens=1, messages=[
        {"role": "user", "content": "What is in this picture?"}]).usage.prompt_tokens
    assert f"prompt {text_only + IMAGE_TOKENS}" in usage, usage  # the image's tokens were read with the text
    assert not browser.find_element(By.ID, "pg-error").text


def screenshot(browser, name: str) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / name
    browser.save_screenshot(str(path))
    assert path.stat().st_size > 10_000


def node_row_text(browser, identity: str) -> str:
    from selenium.webdriver.common.by import By

    rows = browser.find_elements(By.CSS_SELECTOR, "#fleet-nodes tbody tr")
    return next((r.text for r in rows if identity in r.text), "")


def test_the_fleet_page_shows_a_node_join_and_leave_without_a_reload(browser, live_head):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.mock_node import start_mock_node

    login(browser, live_head)
    browser.find_element(By.LINK_TEXT, "Fleet overview").click()
    WebDriverWait(browser, 15).until(lambda b: b.find_element(By.ID, "fleet-live").text == "live")
    browser.execute_script("window.fleetPageMarker = 'set before the join';")
    assert "node-live-page" not in browser.find_element(By.ID, "fleet-nodes").text

    node = start_mock_node(live_head, "node-live-page", lanes=4)
    try:
        WebDriverWait(browser, 60).until(lambda b: "online" in node_row_text(b, "node-live-page"),
                                         f"the joined node never showed: {node.log()}")
        assert browser.execute_script("return window.fleetPageMarker") == "set before the join"
        WebDriverWait(browser, 30).until(lambda b: "0 / 4" in node_row_text(b, "node-live-page"))  # its heartbeat
        screenshot(browser, "fleet-live.png")
    finally:
        node.stop()
    WebDriverWait(browser, 30).until(lambda b: "offline" in node_row_text(b, "node-live-page"))
    assert browser.execute_script("return window.fleetPageMarker") == "set before the join"


def test_a_generations_page_shows_its_timeline_and_placement_evidence(browser, live_head, live_node):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    body = json.dumps({"model": "smollm2", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Name a colour."}]}).encode()
    request = urllib.request.Request(f"{live_head.url}/v1/chat/completions", data=body, headers={  # noqa: S310
        "Authorization": f"Bearer {live_head.api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:  # noqa: S310 - our own http URL
        gen_id = json.loads(response.read())["id"].removeprefix("chatcmpl-")

    login(browser, live_head)
    url = f"{live_head.url}/admin/inference_sessions/generation/{gen_id}/change/"

    def opened(b):
        b.get(url)  # the record is written once, as the generation ends
        return b.find_elements(By.ID, "generation-timeline")

    WebDriverWait(browser, 30, poll_frequency=0.5).until(opened)
    timeline = browser.find_element(By.ID, "generation-timeline").text
    for step in ("queued", "placed", "first token", "done"):
        assert step in timeline, timeline
    chosen = browser.find_element(By.CSS_SELECTOR, "#placement-1 tr.chosen").text
    assert chosen.startswith("node-a ") and chosen.endswith("chosen"), chosen
    headers = browser.find_element(By.CSS_SELECTOR, "#placement-1 thead").text.lower()  # the admin capitalises
    assert "tokens to read again" in headers and "load" in headers
    screenshot(browser, "generation.png")


def test_a_nodes_page_shows_its_models_replicas_generations_and_link_history(browser, live_head, live_node):
    from selenium.webdriver.common.by import By

    login(browser, live_head)
    browser.get(f"{live_head.url}/admin/nodes/node/")
    browser.find_element(By.LINK_TEXT, "node-a").click()
    assert "smollm2" in browser.find_element(By.ID, "node-models").text
    assert "joined" in browser.find_element(By.ID, "node-link-history").text
    assert browser.find_elements(By.CSS_SELECTOR, "#node-replicas tbody tr")
    screenshot(browser, "node.png")
