"""The browser chat page (services/gateway/web/) in headless Chromium, driven by Selenium
(tests/browser.py; skipped where Debian's chromium and chromium-driver are missing), against
`voltserve serve` with the demo model as `make serve` runs it, with SERVE_ARGS of an API key and
the tool-call and reasoning parsers: the key prompt, streaming, stop, regenerate, an error, and
what the page makes of reasoning, tool calls and Markdown. For those the demo model's random
weights are held to a fixed text by a structured-output constraint, sent through the page's
"other request fields" setting. With VOLTSERVE_WEB_SCREENSHOTS=DIR that conversation is saved
as DIR/web-chat-desktop.png and DIR/web-chat-phone.png (how docs/ got them).
"""

from __future__ import annotations

import json
import os
import random
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from voltserve.services.gateway.web_ui import WEB_DIR

from load_tests import bench_web_page
from load_tests.serve_stack import ServeStack, http_json, metric_sum, scrape
from tests.browser import console_errors, set_viewport, skip_without_chromium, start_chromium

KEY = "key-for-the-web-page-test"
WAIT_S = 30.0  # the longest any one step may take on a loaded 2-core machine
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
# What the demo model is held to for the reasoning, Markdown and tool-call checks.
ANSWER = (
    "<think>\nThe user asks for a loop in Python. A short example and its output will do.\n"
    "</think>\n\nHere is a loop in **Python** that prints the first four squares:\n\n"
    "```python\nfor i in range(4):\n    print(i * i)\n```\n\n"
    "It prints `0`, `1`, `4` and `9`, one per line:\n\n- `range(4)` counts from 0 to 3\n"
    "- `i * i` is the square\n\nMore in [the tutorial](https://docs.python.org/3/tutorial/)."
)
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    try:
        set_viewport(driver, 1280, 800)
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """`voltserve serve` with the demo model, as `make serve` runs it, behind --api-key."""
    skip_without_chromium()
    from voltserve.services.executor.demo_model import main as make_demo_model

    work = tmp_path_factory.mktemp("web-serve")
    model = work / "demo"
    make_demo_model([str(model)])
    extra = ["--served-model-name", "demo-model", "--device", "cpu"]
    extra += ["--num-kv-blocks", "512", "--max-num-seqs", "4"]
    extra += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    extra += ["--reasoning-parser", "qwen3"]
    with ServeStack(model, work, extra, start_timeout_s=180, api_key=KEY) as s:
        yield s


# ---- driving the page -------------------------------------------------------------------------


def wait(driver, what, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: what())


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


LAST_ANSWER = """
const a = [...document.querySelectorAll('article.assistant')].at(-1);
if (!a) return null;
const shown = (s) => { const e = a.querySelector(s); return e && !e.hidden ? e : null; };
return {
  busy: a.getAttribute('aria-busy') === 'true',
  text: a.querySelector('.body').textContent,
  html: a.querySelector('.body').innerHTML,
  error: shown('.error')?.textContent ?? null,
  stats: a.querySelector('.stats').textContent,
  reasoning: shown('.reasoning')?.querySelector('.md').textContent ?? null,
  reasoningOpen: a.querySelector('.reasoning').open,
  tools: [...a.querySelectorAll('.tool-call')].map((t) => ({
    name: t.querySelector('.tool-head code').textContent,
    args: t.querySelector('pre').textContent,
  })),
  count: document.querySelectorAll('article.assistant').length,
};
"""


def last_answer(driver) -> dict:
    return js(driver, LAST_ANSWER)


def open_page(driver, url: str, clear: bool = True, key: str | None = None) -> None:
    """The page at url; clear: with no conversations and default settings; key: as if typed."""
    # The storage is set from one of the page's files, of the same origin, which calls no API.
    driver.get(url + "/ui/theme.js")
    if clear:
        js(driver, "localStorage.clear()")
    if key:
        js(driver, "sessionStorage.setItem('voltserve.apiKey', JSON.stringify(arguments[0]))", key)
    driver.get(url + "/")
    wait(driver, lambda: js(driver, "return document.readyState") == "complete")


def wait_model(driver, name: str) -> None:
    wait(driver, lambda: js(driver, "return document.getElementById('model').value") == name)


def settings(driver, **fields: str) -> None:
    """Fill the settings dialog the way a user does, and save."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "open-settings").click()
    form = driver.find_element(By.ID, "settings-form")
    for name, value in fields.items():
        box = form.find_element(By.NAME, name)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "save-settings").click()
    wait(driver, lambda: not js(driver, "return document.getElementById('settings').open"))


def type_and_send(driver, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def wait_answer(driver, count: int) -> dict:
    """The last answer once it is done, when it is the count-th of the conversation."""
    wait(driver, lambda: (a := last_answer(driver)) and a["count"] == count and not a["busy"])
    return last_answer(driver)


def stored_chats(driver) -> list[dict]:
    return json.loads(js(driver, "return localStorage.getItem('voltserve.chats')"))


def unexpected_errors(driver, *expected: str) -> list[str]:
    """Console errors except the HTTP statuses a test provoked on purpose, and the favicon
    that open_page's visit to a bare script file asks for (the page itself names none)."""
    expected = (*expected, "/favicon.ico ")
    return [e for e in console_errors(driver) if not any(x in e for x in expected)]


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# ---- the demo model behind an API key ---------------------------------------------------------


def test_the_page_is_open_and_the_api_needs_the_key(served) -> None:
    status, headers, body = get(served.url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'<script type="module" src="ui/chat.js">' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    status, headers, _ = get(served.url + "/ui/chat.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert get(served.url + "/ui/no-such-file.js")[0] == 404
    assert get(served.url + "/v1/models")[0] == 401


def test_the_key_prompt(served, browser) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url)
    js(browser, "sessionStorage.clear()")
    browser.refresh()
    key_dialog_open = "return document.getElementById('key-dialog').open"
    wait(browser, lambda: js(browser, key_dialog_open))
    box = browser.find_element(By.ID, "api-key")
    box.send_keys("not-the-key")
    browser.find_element(By.ID, "use-key").click()
    refused = "return document.getElementById('key-error').textContent"
    wait(browser, lambda: "refused" in js(browser, refused))
    assert js(browser, key_dialog_open)
    box.clear()
    box.send_keys(KEY)
    browser.find_element(By.ID, "use-key").click()
    wait(browser, lambda: not js(browser, key_dialog_open))
    wait_model(browser, "demo-model")
    # The key lives in this tab's sessionStorage only, never in localStorage.
    assert json.loads(js(browser, "return sessionStorage.getItem('voltserve.apiKey')")) == KEY
    assert KEY not in json.dumps(js(browser, "return {...localStorage}"))
    assert not unexpected_errors(browser, "401")


def test_tokens_stream_and_stop_ends_the_stream(served, browser) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url, key=KEY)
    wait_model(browser, "demo-model")
    before = metric_sum(scrape(served.url), "vllm:request_success_total", finished_reason="abort")
    # Greedy and past the end-of-text token: long enough to be stopped mid-way anywhere.
    settings(browser, temperature="0", max_tokens="3000", extra='{"ignore_eos": true}')
    type_and_send(browser, "Hello!")
    wait(browser, lambda: (a := last_answer(browser)) and a["busy"] and a["text"])
    seen = len(last_answer(browser)["text"])
    # More text arrives while the answer is still streaming.
    wait(browser, lambda: (a := last_answer(browser))["busy"] and len(a["text"]) > seen)
    assert browser.find_element(By.ID, "stop").is_displayed()
    browser.find_element(By.ID, "stop").click()
    stopped = wait_answer(browser, 1)
    assert "stopped after" in stopped["stats"] and stopped["error"] is None
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_displayed()
    # The server saw the client go and aborted the request, well before its 3000 tokens.
    wait(
        browser,
        lambda: (
            metric_sum(scrape(served.url), "vllm:request_success_total", finished_reason="abort")
            == before + 1
        ),
    )
    # The stopped answer is kept in the browser's storage.
    (chat,) = stored_chats(browser)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][1]["stopped"] and chat["messages"][1]["content"]
    assert not unexpected_errors(browser)


def test_usage_regenerate_and_reload(served, browser) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url, key=KEY)
    wait_model(browser, "demo-model")
    settings(browser, temperature="0", max_tokens="7", extra='{"ignore_eos": true}')
    type_and_send(browser, "What is the capital of France?")
    first = wait_answer(browser, 1)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "demo-model", "messages": messages, "max_tokens": 7, "temperature": 0.0}
    status, direct = http_json(
        served.url + "/v1/chat/completions", body | {"ignore_eos": True}, 60, KEY
    )
    assert status == 200, direct
    usage = direct["usage"]
    assert first["stats"].startswith("7 tokens · ") and " tok/s · " in first["stats"]
    assert f"prompt {usage['prompt_tokens']} tokens" in first["stats"]
    # Greedy: the page's answer is the API's.
    (chat,) = stored_chats(browser)
    assert chat["messages"][1]["content"] == (direct["choices"][0]["message"]["content"] or "")
    js(browser, "document.querySelector('article.assistant').dataset.old = 'yes'")
    browser.find_element(By.CSS_SELECTOR, 'article.assistant [data-action="regenerate"]').click()
    new = "return !document.querySelector('article.assistant[data-old]')"
    wait(browser, lambda: js(browser, new))
    again = wait_answer(browser, 1)  # replaced, not added
    assert again["stats"].startswith("7 tokens") and again["text"] == first["text"]
    assert [m["role"] for m in stored_chats(browser)[0]["messages"]] == ["user", "assistant"]
    # The conversation survives a reload; the key too (the same tab).
    browser.refresh()
    wait(browser, lambda: (a := last_answer(browser)) and a["text"] == first["text"])
    wait_model(browser, "demo-model")
    assert not js(browser, "return document.getElementById('key-dialog').open")
    assert not unexpected_errors(browser)


def test_an_over_long_prompt_shows_the_servers_message(served, browser) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url, key=KEY)
    wait_model(browser, "demo-model")
    text = "hello " * 5000  # past the demo model's 4096-token context
    js(browser, "const p = document.getElementById('prompt'); p.value = arguments[0];", text)
    browser.find_element(By.ID, "send").click()
    shown = wait_answer(browser, 1)
    body = {"model": "demo-model", "messages": [{"role": "user", "content": text}]}
    status, direct = http_json(served.url + "/v1/chat/completions", body, 60, KEY)
    assert status == 400
    assert shown["error"] == direct["error"]["message"]
    assert "maximum context length" in shown["error"]
    assert not unexpected_errors(browser, "400")


# ---- the Markdown renderer, on random input ---------------------------------------------------

PIECES = [
    *"** * _ __ ~~ ` ``` ```js # - 1. > | [ ] ( ) \" ' &amp; &lt; word".split(),
    *["\n", "\n\n", " ", "    ", "\u0000", "| --- |", "https://example.com/a?b=1&c=2"],
    *["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "javascript:alert(1)"],
    *["mailto:a@b.c", "data:text/html,<b>", "[a](", "](javascript:x)", '](https://x.y/")'],
]
ALLOWED_TAGS = set(
    "P BR STRONG EM DEL CODE PRE A UL OL LI BLOCKQUOTE HR H3 H4 H5 H6 DIV SPAN BUTTON TABLE "
    "THEAD TBODY TR TH TD".split()
)
ALLOWED_ATTRS = {"href", "target", "rel", "class", "start", "type"}

RENDER = """
const done = arguments[arguments.length - 1];
import('./ui/markdown.js').then((md) => done(arguments[0].map((src) => {
  const box = document.createElement('div');
  box.innerHTML = md.renderMarkdown(src);
  return {
    html: box.innerHTML,
    tags: [...box.querySelectorAll('*')].map((e) => e.tagName),
    attrs: [...box.querySelectorAll('*')].flatMap((e) => e.getAttributeNames()),
    hrefs: [...box.querySelectorAll('a')].map((a) => a.getAttribute('href')),
    rels: [...box.querySelectorAll('a')].map((a) => a.getAttribute('rel')),
  };
})), (e) => done({error: String(e)}));
"""


def render(driver, sources: list[str]) -> list[dict]:
    out = driver.execute_async_script(RENDER, sources)
    assert not isinstance(out, dict), out
    return out


def test_markdown_renders_only_its_own_tags(served, browser, rng: random.Random) -> None:
    open_page(browser, served.url, clear=False)
    sources = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    for src, r in zip(sources, render(browser, sources)):
        assert set(r["tags"]) <= ALLOWED_TAGS, (src, r["html"])
        assert set(r["attrs"]) <= ALLOWED_ATTRS, (src, r["html"])
        assert all(h.startswith(("https://", "mailto:")) for h in r["hrefs"]), (src, r["html"])
        assert all(rel == "noopener noreferrer" for rel in r["rels"]), (src, r["html"])


def test_markdown_examples(served, browser) -> None:
    open_page(browser, served.url, clear=False)
    cases = {
        "a **b** *c* `<d>` ~~e~~": "<p>a <strong>b</strong> <em>c</em> <code>&lt;d&gt;</code> <del>e</del></p>",
        "```py\nif a < b:\n    x = '**'\n```": (
            '<div class="code"><div class="code-head"><span>py</span><button type="button" '
            "class=\"copy-code\">Copy</button></div><pre><code>if a &lt; b:\n    x = '**'</code>"
            "</pre></div>"
        ),
        "```\nstill streaming": (
            '<div class="code"><div class="code-head"><span>code</span><button type="button" '
            'class="copy-code">Copy</button></div><pre><code>still streaming</code></pre></div>'
        ),
        "- one\n- two\n  - deep\n\n3. x\n4. y": (
            '<ul><li>one</li><li>two<ul><li>deep</li></ul></li></ul><ol start="3"><li>x</li>'
            "<li>y</li></ol>"
        ),
        "[ok](https://a.b/c?d=1&e=2) [no](javascript:alert(1))": (
            '<p><a href="https://a.b/c?d=1&amp;e=2" target="_blank" rel="noopener noreferrer">ok'
            "</a> [no](javascript:alert(1))</p>"
        ),
        "# Title\n> quoted\n\n| a | b |\n|---|--:|\n| 1 | 2 |": (
            '<h3>Title</h3><blockquote><p>quoted</p></blockquote><div class="table"><table>'
            '<thead><tr><th>a</th><th class="al-r">b</th></tr></thead><tbody><tr><td>1</td>'
            '<td class="al-r">2</td></tr></tbody></table></div>'
        ),
        "<b>not bold</b> snake_case_name": "<p>&lt;b&gt;not bold&lt;/b&gt; snake_case_name</p>",
    }
    for (src, want), got in zip(cases.items(), render(browser, list(cases))):
        assert got["html"] == want, src


# ---- reasoning, tool calls and Markdown -------------------------------------------------------


def held_to(text: str) -> str:
    """Other request fields that make the demo model say exactly `text`."""
    return json.dumps({"structured_outputs": {"choice": [text]}})


def test_reasoning_markdown_and_tool_calls(served, browser) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ask = [{"role": "user", "content": "Show me a loop in Python."}]
    body = {"messages": ask, "temperature": 0, "structured_outputs": {"choice": [ANSWER]}}
    status, direct = http_json(served.url + "/v1/chat/completions", body, 60, KEY)
    assert status == 200, direct
    want = direct["choices"][0]["message"]
    open_page(browser, served.url, key=KEY)
    wait_model(browser, "demo-model")
    settings(browser, temperature="0", extra=held_to(ANSWER))
    type_and_send(browser, ask[0]["content"])
    a = wait_answer(browser, 1)
    assert a["error"] is None and not a["tools"]
    # Reasoning folded away, its text as the server split it.
    assert a["reasoning"] == want["reasoning_content"].strip() and not a["reasoningOpen"]
    assert a["stats"].startswith(f"{direct['usage']['completion_tokens']} tokens · ")
    code = browser.find_elements(By.CSS_SELECTOR, "article.assistant .body pre code")
    assert [c.text for c in code] == ["for i in range(4):\n    print(i * i)"]
    shots = os.environ.get("VOLTSERVE_WEB_SCREENSHOTS")
    if shots:
        browser.save_screenshot(str(Path(shots) / "web-chat-desktop.png"))
    # The code block's Copy button puts the code on the clipboard.
    perms = ["clipboardReadWrite", "clipboardSanitizedWrite"]
    browser.execute_cdp_cmd(
        "Browser.grantPermissions", {"origin": served.url, "permissions": perms}
    )
    copy = browser.find_element(By.CSS_SELECTOR, "article.assistant .copy-code")
    copy.click()
    wait(browser, lambda: copy.text == "Copied")
    read = "navigator.clipboard.readText().then(arguments[0], (e) => arguments[0](String(e)))"
    assert browser.execute_async_script(read) == code[0].text
    assert "<strong>Python</strong>" in a["html"]
    link = browser.find_element(By.CSS_SELECTOR, "article.assistant .body a")
    assert link.get_attribute("href") == "https://docs.python.org/3/tutorial/"
    assert len(browser.find_elements(By.CSS_SELECTOR, "article.assistant .body li")) == 2
    (chat,) = stored_chats(browser)
    assert chat["messages"][1]["content"] == want["content"]

    # A tool call: the tool, and the call's text, as other request fields.
    settings(browser, extra=json.dumps({"tools": [WEATHER]} | json.loads(held_to(CALL))))
    type_and_send(browser, "And the weather in Paris?")
    call = wait_answer(browser, 2)
    assert call["error"] is None and call["reasoning"] is None
    assert [t["name"] for t in call["tools"]] == ["get_weather"]
    assert json.loads(call["tools"][0]["args"]) == {"city": "Paris", "days": 3}
    assert not unexpected_errors(browser)

    # A phone's width, dark: nothing wider than the screen; the conversations in a drawer.
    try:
        set_viewport(browser, 390, 844, mobile=True, scale=2)
        browser.find_element(By.ID, "theme").click()  # system -> light
        browser.find_element(By.ID, "theme").click()  # light -> dark
        assert js(browser, "return document.documentElement.dataset.theme") == "dark"
        assert js(browser, "return document.documentElement.scrollWidth") <= 390
        menu = browser.find_element(By.ID, "menu")
        assert menu.is_displayed() and menu.get_attribute("aria-expanded") == "false"
        if shots:
            js(
                browser,
                "document.activeElement.blur(); const l = document.getElementById('log');"
                "l.scrollTop = l.scrollHeight;",
            )
            ActionChains(browser).move_to_element(browser.find_element(By.ID, "log")).perform()
            browser.save_screenshot(str(Path(shots) / "web-chat-phone.png"))
        menu.click()
        wait(browser, lambda: menu.get_attribute("aria-expanded") == "true")
        drawer = "return document.getElementById('sidebar').getBoundingClientRect().left"
        wait(browser, lambda: js(browser, drawer) == 0)
    finally:
        set_viewport(browser, 1280, 800)
        js(browser, "localStorage.removeItem('voltserve.theme')")


def test_every_control_is_named(served, browser) -> None:
    open_page(browser, served.url, clear=False)
    unnamed = js(
        browser,
        """return [...document.querySelectorAll('button, input, select, textarea')]
          .filter((e) => !(e.getAttribute('aria-label') || e.labels?.length || e.textContent.trim()))
          .map((e) => e.outerHTML);""",
    )
    assert unnamed == []


def test_the_page_weight_benchmark(served, tmp_path: Path) -> None:
    """load_tests/bench_web_page.py end to end, once; the weight is exact, the times are not."""
    out = tmp_path / "web_page.json"
    r = bench_web_page.main(["--url", served.url, "--runs", "1", "--out", str(out)])
    assert json.loads(out.read_text())["page"] == r["page"]
    files = r["page"]["files"]
    assert set(files) == {p.name for p in WEB_DIR.iterdir()}
    for name, f in files.items():
        assert f["decoded"] == (WEB_DIR / name).stat().st_size, name
        assert 0 < f["encoded"] < f["decoded"], name  # sent compressed
    # Tens of KB at most, as the page was meant to be.
    assert r["page"]["transfer_bytes"] < 40_000
    assert r["first_contentful_paint_ms"]["runs"][0] > 0
