"""Issue 14 item 6: the chat page at / and the API reference at /docs.

The pages' JavaScript (streaming, stop, API key; the OpenAPI renderer) runs in Node against the
real server; a real browser (headless Chromium) loads the page and finishes a streamed reply
where one is installed, and the test says why it is skipped where none is.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import time

import pytest
from server_helpers import MODEL, http, metric

API_KEY = "sekret"
NODE = shutil.which("node") or shutil.which("nodejs")
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(n)), None)
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed: the pages' JS logic is not run")


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server(settings={"api_key": API_KEY}).url


def _page(url: str, path: str) -> str:
    status, headers, body = http(url, "GET", path)
    assert status == 200 and headers["Content-Type"].startswith("text/html"), (status, headers)
    return body.decode()


@pytest.mark.parametrize("path", ["/", "/docs"])
def test_pages_are_public_self_contained_html(keyed, path):
    html = _page(keyed, path)          # no Authorization header: the pages themselves are public
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page loads something remote"
    assert not re.search(r"""@import|import\s*\(|from\s+["']https?:""", html)
    assert "<script>" in html


def _csp_hash(text: str) -> str:
    """A CSP hash-source (CSP Level 3, 'hash-source'): base64 of the block's UTF-8 SHA-256."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.mark.parametrize("path", ["/", "/docs"])
def test_pages_admit_only_their_own_inline_code(keyed, path):
    status, headers, body = http(keyed, "GET", path)
    html = body.decode()
    policy = dict(d.strip().split(" ", 1) for d in headers["Content-Security-Policy"].split(";"))
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        assert blocks and policy[f"{tag}-src"].split() == [_csp_hash(b) for b in blocks], (tag, policy)
    assert policy["default-src"] == policy["frame-ancestors"] == policy["base-uri"] == "'none'", policy
    assert policy["connect-src"] == "'self'", policy
    assert not re.search(r"""<[^>]*\son[a-z]+\s*=|javascript:""", html), "inline handlers would be blocked"
    assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff"


def _script(html: str) -> str:
    return re.search(r"<script>(.*)</script>", html, re.S).group(1)


def _node(tmp_path, page_js: str, driver: str, timeout: float = 120) -> dict:
    (tmp_path / "page.js").write_text(page_js)
    (tmp_path / "driver.js").write_text(driver)
    done = subprocess.run([NODE, str(tmp_path / "driver.js")], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


CHAT_DRIVER = """
const chat = require("./page.js");
const [url, key, mode] = process.argv.slice(2).length ? process.argv.slice(2) : %s;
(async () => {
  const deltas = [];
  const controller = new AbortController();
  const out = {};
  const request = {baseUrl: url, apiKey: key, model: "%s", system: "Answer in one short sentence.",
                   messages: [{role: "user", content: "What is the capital of France?"}],
                   temperature: 0, maxTokens: mode === "stop" ? 400 : 12, signal: controller.signal,
                   onDelta: piece => { deltas.push(piece); if (mode === "stop" && deltas.length === 3) controller.abort(); }};
  try { Object.assign(out, await chat.streamChat(request)); } catch (e) { out.error = e.message; }
  out.deltas = deltas;
  out.body = chat.chatBody(request);
  out.sse = chat.parseSSE('data: {"a":1}\\n\\ndata: [DONE]\\n\\ndata: {"b"');
  console.log(JSON.stringify(out));
})();
"""


def _chat(tmp_path, keyed, key: str, mode: str) -> dict:
    driver = CHAT_DRIVER % (json.dumps([keyed, key, mode]), MODEL)
    return _node(tmp_path, _script(_page(keyed, "/")), driver)


@needs_node
def test_the_page_streams_a_reply_token_by_token_with_the_settings(keyed, tmp_path):
    out = _chat(tmp_path, keyed, API_KEY, "full")
    assert "error" not in out, out
    assert out["body"]["messages"][0] == {"role": "system", "content": "Answer in one short sentence."}
    assert out["body"]["temperature"] == 0 and out["body"]["max_tokens"] == 12
    assert len(out["deltas"]) > 1 and "".join(out["deltas"]) == out["text"]
    assert out["finishReason"] in ("stop", "length") and 0 < out["usage"]["completion_tokens"] <= 12
    assert out["sse"] == {"events": ['{"a":1}', "[DONE]"], "rest": 'data: {"b"'}
    # the same request without the page: the same greedy reply
    status, _, raw = http(keyed, "POST", "/v1/chat/completions",
                          {k: v for k, v in out["body"].items() if k not in ("stream", "stream_options")},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    assert json.loads(raw)["choices"][0]["message"]["content"] == out["text"]


@needs_node
def test_stop_aborts_the_request_on_the_server(keyed, tmp_path):
    aborted_before = metric(keyed, "ember:request_success_total", finished_reason="abort") or 0.0
    out = _chat(tmp_path, keyed, API_KEY, "stop")
    assert out.get("aborted") is True and len(out["deltas"]) == 3, out
    deadline = time.monotonic() + 30
    while metric(keyed, "ember:request_success_total", finished_reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the server never aborted the stopped request"
        time.sleep(0.1)
    while metric(keyed, "ember:num_requests_running") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(keyed, "ember:kv_cache_free_blocks") == metric(keyed, "ember:kv_cache_total_blocks")


@needs_node
def test_a_wrong_api_key_is_reported(keyed, tmp_path):
    out = _chat(tmp_path, keyed, "wrong", "full")
    assert out["error"].startswith("HTTP 401: invalid API key"), out


@needs_node
def test_docs_render_every_operation_of_the_openapi_spec(keyed, tmp_path):
    spec = json.loads(http(keyed, "GET", "/openapi.json")[2])
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    driver = """
const docs = require("./page.js");
const spec = require("./spec.json");
console.log(JSON.stringify({html: docs.render(spec)}));
"""
    html = _node(tmp_path, _script(_page(keyed, "/docs")), driver)["html"]
    for path, item in spec["paths"].items():
        for method in item:
            assert f'id="{method} {path}"' in html, (method, path)
    assert "<code>messages</code> *" in html      # the chat request's required field, from its schema
    assert '<code>response_id</code> *</td><td class="type">path' in html   # a path parameter


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs in the page (Runtime.evaluate, awaited): ignores ?api_key=, types the key in, then sends
# each prompt once the previous reply has finished; the DOM's facts as JSON.
CONVERSATION = """(async () => {
  const $ = id => document.getElementById(id);
  const until = async (ready, seconds = 60) => {
    for (const end = Date.now() + seconds * 1000; !ready(); await new Promise(r => setTimeout(r, 100)))
      if (Date.now() > end) return false;
    return true;
  };
  await until(() => document.readyState === "complete");
  const keyFromUrl = $("api-key").value;
  $("api-key").value = %s;
  $("api-key").dispatchEvent(new Event("change"));
  await until(() => $("model").options.length > 0);
  for (const [i, prompt] of %s.entries()) {
    $("prompt").value = prompt;
    $("composer").requestSubmit();
    const replies = () => document.querySelectorAll(".message.assistant, .message.error");
    if (!await until(() => replies().length === i + 1 && replies()[i].dataset.state !== "streaming")) break;
  }
  return JSON.stringify({keyFromUrl, status: $("status").textContent, layout: getComputedStyle(document.body).display,
    users: [...document.querySelectorAll(".message.user .text")].map(e => e.textContent),
    replies: [...document.querySelectorAll(".message.assistant, .message.error")].map(
      e => ({state: e.dataset.state, text: e.querySelector(".text").textContent}))});
})()"""


async def _drive_browser(port: int, script: str, timeout: float = 240) -> tuple[dict, bytes]:
    """Run `script` in the page Chromium opened (DevTools protocol over aiohttp's websocket);
    (the facts it returns, a PNG screenshot)."""
    import asyncio
    import base64

    import aiohttp
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + timeout
        while True:
            try:
                async with session.get(f"http://127.0.0.1:{port}/json") as response:
                    pages = [t for t in await response.json() if t["type"] == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "chromium's DevTools endpoint never came up"
            await asyncio.sleep(0.2)
        async with session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1 << 30))

            async def call(method, **params):
                call_id = next(ids)
                await ws.send_json({"id": call_id, "method": method, "params": params})
                while True:
                    message = await ws.receive_json()
                    if message.get("id") == call_id:
                        return message["result"]

            while True:   # until the chat page (not about:blank) has its elements
                probe = await call("Runtime.evaluate", expression="!!document.getElementById('composer')",
                                   returnByValue=True)
                if probe["result"].get("value") is True:
                    break
                assert time.monotonic() < deadline, "the chat page never loaded"
                await asyncio.sleep(0.2)
            result = await call("Runtime.evaluate", expression=script, awaitPromise=True, returnByValue=True)
            assert "value" in result["result"], result
            shot = await call("Page.captureScreenshot", format="png")
            return json.loads(result["result"]["value"]), base64.b64decode(shot["data"])


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium): "
                                             "the page is not loaded in a real browser here")
def test_a_real_browser_chats_three_turns(keyed, tmp_path):
    import asyncio
    prompts = ["Say hello.", "Name a colour.", "Count to three."]
    url = f"{keyed}/?max_tokens=8&temperature=0&system=Be%20brief.&api_key={API_KEY}"   # the key: ignored
    port = _free_port()
    browser = subprocess.Popen([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                                f"--user-data-dir={tmp_path / 'profile'}", f"--remote-debugging-port={port}",
                                "--window-size=1000,700", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        facts, png = asyncio.run(_drive_browser(port, CONVERSATION % (json.dumps(API_KEY), json.dumps(prompts))))
    finally:
        browser.terminate()
        browser.wait(30)
    assert facts["keyFromUrl"] == "", "the page took an API key from its URL"
    assert facts["users"] == prompts, facts
    assert [r["state"] for r in facts["replies"]] == ["done"] * 3 and all(r["text"].strip() for r in facts["replies"]), facts
    assert facts["status"].startswith("done (") and facts["layout"] == "flex", facts   # its <style> applied
    (tmp_path / "chat.png").write_bytes(png)
    assert png.startswith(b"\x89PNG") and len(png) > 1000


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium): "
                                             "/docs is not loaded in a real browser here")
def test_a_real_browser_renders_the_docs(keyed, tmp_path):
    spec = json.loads(http(keyed, "GET", "/openapi.json")[2])
    operations = sum(1 for item in spec["paths"].values() for method in item
                     if method in ("get", "post", "put", "delete", "patch"))
    dom = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=20000",
                          "--dump-dom", keyed + "/docs"], capture_output=True, text=True, timeout=120).stdout
    rendered = re.findall(r'<div class="op" id="(?:get|post|put|delete|patch) /', dom)   # not the JS source
    assert len(rendered) == operations > 0, dom[-2000:]
    assert f"{spec['info']['title']} {spec['info']['version']}" in dom
