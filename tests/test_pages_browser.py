"""The operator's pages in a real browser (headless Chromium): log in, the fleet page (live: pushed over its
websocket as nodes join and leave), a node action, a generation's and a node's pages, API docs, the playground.

Every page is seen in a 1,400 x 900 viewport, and the pages operators use most must fit it (no sideways scroll).
With FLEET_SCREENSHOTS=DIR the tests write their screenshots there (`make screenshots` refreshes docs/screenshots/,
which docs/operations.md shows); without it they are taken and checked, never written into the tree."""

import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
VIEWPORT = (1400, 900)


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
                 "--disable-dev-shm-usage", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # the viewport itself, whatever the window
        "width": VIEWPORT[0], "height": VIEWPORT[1], "deviceScaleFactor": 1, "mobile": False})
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


_WIDEST = """
const width = innerWidth, out = [];
const classes = (e) => typeof e.className === "string" ? e.className.trim().split(/\\s+/).filter(Boolean) : [];
const name = (e) => [e.tagName.toLowerCase() + (e.id ? "#" + e.id : ""), ...classes(e)].join(".");
for (const e of document.body.querySelectorAll("*")) {
  const box = e.getBoundingClientRect();
  if (box.right > width + 0.5 && ![...e.children].some((c) => c.getBoundingClientRect().right > width + 0.5))
    out.push(`${name(e)} ends at ${Math.round(box.right)} px`);
  const style = getComputedStyle(e);  // a box that scrolls sideways itself (the admin's lists scroll in div.results)
  if (["auto", "scroll"].includes(style.overflowX) && !["TEXTAREA", "SELECT", "INPUT"].includes(e.tagName)
      && e.scrollWidth > e.clientWidth + 1)
    out.push(`${name(e)} scrolls sideways: ${e.scrollWidth} px in ${e.clientWidth}`);
}
return [document.documentElement.scrollWidth, width, out.slice(0, 8)];
"""


def assert_fits(browser, what: str) -> None:
    """No sideways scroll in the viewport, of the page or of a box in it (the admin's lists scroll in their own box);
    else name what sticks out."""
    scroll_width, width, sticking_out = browser.execute_script(_WIDEST)
    assert width == VIEWPORT[0], width
    assert scroll_width <= width and not sticking_out, f"{what} in a {width} px window: {sticking_out}"


def test_fleet_page_shows_the_live_node(browser, live_head, live_node):
    from selenium.webdriver.common.by import By

    login(browser, live_head)
    browser.find_element(By.LINK_TEXT, "Fleet overview").click()
    text = node_row_text(browser, "node-a")
    assert "node-a" in text and "online" in text and "smollm2" in text
    assert "smollm2" in browser.find_element(By.ID, "fleet-models").text
    assert_fits(browser, "the fleet page")
    assert len(browser.get_screenshot_as_png()) > 10_000


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


@pytest.mark.parametrize(("page", "endpoint"), [("/api/docs/", "/api/nodes/"), ("/v1/docs/", "/v1/chat/completions")])
def test_api_docs_page_lists_the_endpoints(browser, live_head, page, endpoint):
    """Swagger UI renders each API's operations in a real browser, from the head alone (this machine reaches no CDN)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{live_head.url}{page}")
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    paths = {e.get_attribute("data-path") for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert endpoint in paths, sorted(paths)[:20]


# What the page's socket sends, kept for the test: the frames as the head gets them.
_RECORD_FRAMES = """
window.pgSent = [];
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) { window.pgSent.push(JSON.parse(data)); return send.call(this, data); };
"""


def _usage_figures(text: str) -> dict[str, str]:
    """`node node-a · prompt 25 · cached 0 · completion 8 · finish stop · 1.2 s` as {"prompt": "25", ...}."""
    return dict(re.findall(r"(node|prompt|cached|completion|finish) (\S+)", text))


def test_the_playground_keeps_a_conversation_and_shows_usage_after_stop(browser, live_head, live_node):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def ask(message: str, max_tokens: int) -> None:
        box = browser.find_element(By.ID, "pg-max-tokens")
        box.clear()
        box.send_keys(str(max_tokens))
        browser.find_element(By.ID, "pg-message").send_keys(message)
        browser.find_element(By.ID, "pg-send").click()

    def usage() -> dict[str, str]:
        shown = WebDriverWait(browser, 120).until(
            lambda b: b.find_element(By.ID, "pg-usage").text or b.find_element(By.ID, "pg-error").text)
        assert not browser.find_element(By.ID, "pg-error").text, shown
        return _usage_figures(shown)

    login(browser, live_head)
    browser.find_element(By.LINK_TEXT, "Playground").click()
    assert "smollm2" in browser.find_element(By.ID, "pg-model").text
    browser.execute_script(_RECORD_FRAMES)
    browser.find_element(By.ID, "pg-system").send_keys("You are a friendly assistant.")
    ask("Say hello", 32)
    first = usage()
    assert first["node"] == "node-a" and int(first["completion"]) > 0, first
    answer = browser.execute_script("return document.getElementById('pg-answer').textContent")
    assert answer.strip()

    ask("Now say goodbye", 16)  # the second turn is sent after the first, answer and all
    second = usage()
    sent = browser.execute_script("return window.pgSent.filter((f) => f.type === 'generate')")
    assert sent[1]["messages"] == [
        {"role": "system", "content": "You are a friendly assistant."}, {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": answer}, {"role": "user", "content": "Now say goodbye"}], sent[1]
    assert int(second["prompt"]) > int(first["prompt"]) + int(first["completion"])  # the node read them too
    shown = browser.find_element(By.ID, "pg-conversation").text
    assert shown.index("Say hello") < shown.index(answer.strip()[:20]) < shown.index("Now say goodbye"), shown
    assert_fits(browser, "the playground")
    screenshot(browser, "playground.png")

    ask("Write a long story about a dragon and a knight.", 512)
    WebDriverWait(browser, 120).until(lambda b: b.execute_script(
        "return document.getElementById('pg-answer').textContent.length > 0"))
    browser.find_element(By.ID, "pg-stop").click()
    stopped = usage()  # what was read and made before the stop, not 0 / 0
    assert stopped["finish"] == "cancelled" and int(stopped["prompt"]) > int(second["prompt"]), stopped
    assert int(stopped["completion"]) > 0, stopped


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
    """Take the page's screenshot; write it to $FLEET_SCREENSHOTS/NAME when that is set (never into the tree)."""
    png = browser.get_screenshot_as_png()
    assert len(png) > 10_000  # a page, not a blank
    if folder := os.environ.get("FLEET_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_bytes(png)


def node_row_text(browser, identity: str) -> str:
    # the rows' text in one script: each live snapshot renders the rows anew, so an element found in one call can be
    # gone (stale) by the next
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#fleet-nodes tbody tr'), row => row.innerText)")
    return next((" ".join(text.split()) for text in rows if identity in text), "")  # spaced as Selenium's .text


def test_the_fleet_page_shows_a_node_on_its_way_in_join_and_leave_without_a_reload(browser, live_head):
    import asyncio

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from nodes.agent.dialer import AgentConfig, NodeAgent
    from tests.mock_node import start_mock_node

    login(browser, live_head)
    browser.find_element(By.LINK_TEXT, "Fleet overview").click()
    WebDriverWait(browser, 15).until(lambda b: b.find_element(By.ID, "fleet-live").text == "live")
    browser.execute_script("window.fleetPageMarker = 'set before the join';")
    assert "node-live-page" not in browser.find_element(By.ID, "fleet-nodes").text

    # On its way in: what node_join says while it pulls its model (its own key, from the home the node uses next)
    config = AgentConfig(head=live_head.address, token=live_head.env["FLEET_LOCAL_NODE_TOKEN"],
                         home=live_head.home / "node-node-live-page", identity="node-live-page")
    asyncio.run(NodeAgent(config, None).report_preparing("smollm2-big", "pulling", 0.42))
    WebDriverWait(browser, 30).until(lambda b: "joining" in node_row_text(b, "node-live-page"))
    assert "smollm2-big: pulling 42%" in node_row_text(browser, "node-live-page")
    assert browser.execute_script(  # in one script: each snapshot renders the row's cells anew
        "return document.querySelector('#fleet-nodes .fleet-preparing progress').value") == 42

    node = start_mock_node(live_head, "node-live-page", lanes=4)
    try:
        WebDriverWait(browser, 60).until(lambda b: "online" in node_row_text(b, "node-live-page"),
                                         f"the joined node never showed: {node.log()}")
        assert "pulling" not in node_row_text(browser, "node-live-page")  # joined: on its way in no longer
        assert browser.execute_script("return window.fleetPageMarker") == "set before the join"
        WebDriverWait(browser, 30).until(lambda b: "0 / 4" in node_row_text(b, "node-live-page"))  # its heartbeat
        assert_fits(browser, "the fleet page with two nodes")
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
    assert_fits(browser, "a generation's page")
    screenshot(browser, "generation.png")


def test_a_nodes_page_shows_its_models_replicas_generations_and_link_history(browser, live_head, live_node):
    from selenium.webdriver.common.by import By

    login(browser, live_head)
    browser.get(f"{live_head.url}/admin/nodes/node/")
    assert_fits(browser, "the nodes list")
    browser.find_element(By.LINK_TEXT, "node-a").click()
    assert "smollm2" in browser.find_element(By.ID, "node-models").text
    assert "joined" in browser.find_element(By.ID, "node-link-history").text
    assert browser.find_elements(By.CSS_SELECTOR, "#node-replicas tbody tr")
    assert_fits(browser, "a node's page")
    screenshot(browser, "node.png")


def test_the_generations_batches_files_and_keys_lists_fit_a_1400_px_window(browser, live_head, live_node):
    from openai import OpenAI
    from selenium.webdriver.common.by import By

    client = OpenAI(base_url=f"{live_head.url}/v1", api_key=live_head.api_key, max_retries=0)
    client.chat.completions.create(model="smollm2", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    line = {"custom_id": "a-rather-long-custom-id-0001", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}
    upload = client.files.create(file=("a-batch-input-with-a-long-name.jsonl", json.dumps(line).encode() + b"\n"),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    login(browser, live_head)
    for path, what, shows in [("inference_sessions/generation/", "the generations list", "smollm2"),
                              ("api/batch/", "the batches list", batch.id), ("api/batchfile/", "the files list",
                                                                             upload.id),
                              ("api/apikey/", "the API keys list", "admin")]:
        browser.get(f"{live_head.url}/admin/{path}")
        assert shows in browser.find_element(By.ID, "result_list").text, what
        assert_fits(browser, what)
