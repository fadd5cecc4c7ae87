"""The chat page in a real browser: headless Chromium (Debian's ``chromium`` package) driven by Playwright, against a
real ``quickdraft serve smollm2-135m --speculative ngram`` on 127.0.0.1."""
from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import pytest

from test_server import start_cli_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the browser itself comes "
                                     "from Debian: apt-get install chromium)")
if CHROMIUM is None:
    pytest.skip("no Chromium: apt-get install chromium (Debian's package) to run the chat page's browser tests",
                allow_module_level=True)

ASK = "Write the numbers from 1 to 40, separated by commas."  # SmolLM2's answer repeats itself: n-gram drafts hit
HOSTILE = ['<script>window.__pwned = 1</script>', '<img src=x onerror="window.__pwned = 1">',
           '[click me](javascript:window.__pwned=1)', '```\n<script>window.__pwned = 1</script>\n```']


def serve_cli(*flags: str):
    return start_cli_server("smollm2-135m", "--speculative", "ngram", "--kv-cache-memory", "128MiB", *flags)


@pytest.fixture(scope="module")
def server():
    proc, url = serve_cli()
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(bypass_csp=True)  # Playwright's waits evaluate strings, which the page's CSP forbids
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(server + "/")
    page.wait_for_selector("#model option", state="attached")
    yield page
    context.close()


def ask(page, text: str, max_tokens: int = 64) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function("document.querySelector('#stop').hidden && document.querySelector('.message.assistant "
                           ".stats') && document.querySelector('.message.assistant .stats').textContent", timeout=60000)


def test_the_page_loads_clean(page, server):
    assert page.title() == "quickdraft" and not page.errors
    assert page.locator("#model option").all_text_contents() == ["smollm2-135m"]


def test_an_answer_is_the_apis_text_with_its_draft_tokens_coloured(page, server):
    ask(page, ASK)
    shown = page.locator(".message.assistant .tokens").inner_text()
    api = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": ASK}], "max_tokens": 64, "temperature": 0}).json()
    assert shown == api["choices"][0]["message"]["content"] and shown
    stats = page.locator(".message.assistant .stats").inner_text()
    accepted = int(re.search(r"accepted (\d+)", stats).group(1))
    assert accepted > 0 and page.locator(".message.assistant .tok.draft").count() == accepted
    assert "tok/s" in stats and "tokens a target pass" in stats and not page.errors
    page.reload()  # the conversation is kept in the browser
    page.wait_for_selector(".message.assistant")
    assert page.locator(".message.assistant .tokens").inner_text() == shown
    assert page.locator(".message.assistant .tok.draft").count() == accepted


def test_stop_cancels_the_request_on_the_server(page, server):
    page.fill("#max_tokens", "1000")
    page.fill("#prompt", "Write a very long story about a dragon who learns to read.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant .tok').length > 5", timeout=60000)
    page.click("#stop")
    page.wait_for_function("document.querySelector('#stop').hidden", timeout=10000)
    deadline = time.monotonic() + 20
    while True:
        metrics = httpx.get(server + "/metrics", timeout=10).text
        used = float(re.search(r"^quickdraft_kv_blocks_used (\S+)", metrics, re.M).group(1))
        if used == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert used == 0 and not page.errors


def test_model_output_stays_inert(browser, server):
    """Whatever a model writes is shown as text: stored answers with markup, rendered both ways, run nothing (with
    the page's Content-Security-Policy bypassed: the escaping alone must hold)."""
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    page.goto(server + "/")
    stored = [{"id": "x", "title": "<img src=x onerror=alert(1)>", "messages": [
        {"role": "user", "content": HOSTILE[0]},
        {"role": "assistant", "content": "\n\n".join(HOSTILE), "reasoning": "\n".join(HOSTILE),
         "spans": [{"text": t, "draft": True} for t in HOSTILE]}]}]
    page.evaluate("s => localStorage.setItem('quickdraft.conversations', s)", json.dumps(stored))
    page.reload()
    page.wait_for_selector(".message.assistant")
    page.click(".message.assistant .actions button")  # the Markdown view
    for link in page.locator(".message a").all():
        assert (link.get_attribute("href") or "").startswith("http")
    assert page.locator("#messages img, #messages script, #sidebar img").count() == 0
    assert page.locator(".message.assistant .markdown").inner_text().count("window.__pwned") == 4
    assert page.locator(".message.assistant .thought").text_content().count("window.__pwned") == 4
    assert page.evaluate("window.__pwned") is None
    context.close()


def test_a_reasoning_models_thinking_is_shown_apart(browser, tmp_path):
    """A model whose template opens <think> in the prompt (tests/test_reasoning.py's tiny one): the page shows the
    API's ``reasoning_content`` in its Thinking block, and the answer apart (here none: a random model never closes
    its thinking)."""
    from test_reasoning import THINK_TEMPLATE, make_model

    model = make_model(tmp_path, THINK_TEMPLATE.replace("{% if opened %}", "{% if true %}"))
    proc, url = start_cli_server(model, "--kv-cache-memory", "16MiB")
    try:
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        page.goto(url + "/")
        page.wait_for_selector("#model option", state="attached")
        page.fill("#temperature", "0")
        ask(page, "Weather in Paris?", max_tokens=12)
        api = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 12, "temperature": 0}).json()
        thought = api["choices"][0]["message"]["reasoning_content"]
        assert thought and page.locator(".message.assistant .thought").text_content() == thought
        assert page.locator(".message.assistant .thinking").is_visible()
        assert page.locator(".message.assistant .tokens").inner_text() == ""
        context.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_wrong_key_shows_the_401_message(browser):
    proc, url = serve_cli("--api-key", "sekrit")
    try:
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        for path in ("/", "/web/app.js"):  # the page needs no key, and never holds it
            r = httpx.get(url + path, timeout=10)
            assert r.status_code == 200 and "sekrit" not in r.text
        page.goto(url + "/")
        page.wait_for_selector("#error:not([hidden])")
        assert "401" in page.inner_text("#error") and page.is_visible("#key-form")
        page.fill("#api-key", "wrong")
        page.click("#key-form button")
        page.wait_for_function("document.querySelector('#error').textContent.includes('401')")
        page.fill("#api-key", "sekrit")
        page.click("#key-form button")
        page.wait_for_selector("#model option", state="attached")
        assert page.is_hidden("#error")
        context.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_draft_info_is_opt_in(server):
    body = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 24, "temperature": 0, "stream": True}
    plain = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).text
    assert "draft_info" not in plain
    body["stream_options"] = {"include_draft_info": True}
    events = [json.loads(line[6:]) for line in httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
              .text.splitlines() if line.startswith("data: {")]
    infos = [e["choices"][0] for e in events if e["choices"] and "role" not in e["choices"][0]["delta"]]
    assert len(infos) > 3 and all("".join(s["text"] for s in c["draft_info"]["spans"]) == c["delta"].get("content", "") for c in infos)


def test_draft_info_covers_an_echoed_prompt(server):
    body = {"prompt": "one two three one two three", "max_tokens": 8, "temperature": 0, "echo": True, "stream": True,
            "stream_options": {"include_draft_info": True}}
    events = [json.loads(line[6:]) for line in httpx.post(server + "/v1/completions", json=body, timeout=60)
              .text.splitlines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"].startswith(body["prompt"])
    assert all("".join(s["text"] for s in e["choices"][0]["draft_info"]["spans"]) == e["choices"][0]["text"]
               for e in events if e["choices"])


def test_no_web_leaves_the_page_out():
    proc, url = serve_cli("--no-web")
    try:
        assert httpx.get(url + "/", timeout=10).status_code == 404
        assert httpx.get(url + "/web/app.js", timeout=10).status_code == 404
    finally:
        proc.terminate()
        proc.wait(30)
