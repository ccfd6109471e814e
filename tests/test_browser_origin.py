"""A web page in the user's browser against a keyless `paged-chat serve` (issue 31): a real
headless Chromium loads a page from another origin (evil.example, mapped to 127.0.0.1 by
Chromium's resolver rules) whose script `fetch`es the API as a page can, with a text/plain
body (no preflight: the request is sent whatever the answer's CORS), with no-cors, with a
JSON body (preflighted) and a GET of /v1/models. It writes what it got into the DOM, read
back with --dump-dom. The server must have run nothing for it. A page from an origin the
server allows (`--allowed-origin`) does get its completion: the check can see one through.

Needs Debian's chromium (`apt-get install chromium`); skipped where /usr/bin/chromium is
absent.
"""

from __future__ import annotations

import functools
import html
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import answers_health, free_port

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=(
    "needs a real browser: Debian's chromium at /usr/bin/chromium (apt-get install chromium)"))

PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
const api = "API";
const body = JSON.stringify({messages: [{role: "user", content: "Hi"}], max_tokens: 2});
async function attempt(name, path, options) {
  try {
    const response = await fetch(api + path, options);
    return {name, type: response.type, status: response.status, text: await response.text()};
  } catch (error) {
    return {name, type: "error", text: String(error)};
  }
}
(async () => {
  const post = {method: "POST", body};
  const results = [
    await attempt("text/plain", "/v1/chat/completions", {...post, headers: {"Content-Type": "text/plain"}}),
    await attempt("no-cors", "/v1/chat/completions", {...post, mode: "no-cors",
                                                      headers: {"Content-Type": "text/plain"}}),
    await attempt("json", "/v1/chat/completions", {...post, headers: {"Content-Type": "application/json"}}),
    await attempt("models", "/v1/models", {}),
  ];
  document.getElementById("out").textContent = JSON.stringify(results);
})();
</script></body></html>
"""


@pytest.fixture
def page_server(tmp_path) -> Iterator[int]:
    """A plain web server on a loopback port of its own, serving page.html: the site the
    browser visits (under the names evil.example and friend.example)."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def visit(url: str, profile: Path) -> list[dict]:
    """Load `url` in headless Chromium, wait for the page's script, and return its results."""
    rules = "MAP evil.example 127.0.0.1, MAP friend.example 127.0.0.1, MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-proxy-server", f"--user-data-dir={profile}",
         f"--host-resolver-rules={rules}", "--virtual-time-budget=60000", "--dump-dom", url],
        capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="out">(.*?)</pre>', done.stdout, re.DOTALL)
    assert found and found.group(1) != "pending", (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(html.unescape(found.group(1)))


def prompt_tokens_served(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "vllm:prompt_tokens"]
    return family.samples[0].value


def test_a_page_on_another_origin_cannot_use_a_keyless_server(chat_model_dir, page_server, tmp_path):
    port = free_port()
    (tmp_path / "page.html").write_text(PAGE.replace("API", f"http://127.0.0.1:{port}"))
    friend = f"http://friend.example:{page_server}"
    server = subprocess.Popen(
        [sys.executable, "-m", "paged_chat", "serve", "--model", str(chat_model_dir), "--port", str(port),
         "--allowed-origin", friend], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: server.poll() is not None or answers_health(port), timeout=180,
                 what="the server to answer /health")
        assert server.poll() is None, server.communicate()[1].decode()

        results = visit(f"http://evil.example:{page_server}/page.html", tmp_path / "evil-profile")
        assert [r["name"] for r in results] == ["text/plain", "no-cors", "json", "models"]
        assert all(r["type"] in ("error", "opaque") for r in results), results
        assert not any('"choices"' in r["text"] or '"data"' in r["text"] for r in results), results
        assert prompt_tokens_served(port) == 0, "the server ran a completion for the page"

        allowed = {r["name"]: r for r in visit(f"{friend}/page.html", tmp_path / "friend-profile")}
        assert allowed["json"]["status"] == 200 and "chat.completion" in allowed["json"]["text"], allowed
        assert allowed["text/plain"]["type"] == "error"   # JSON bodies only, even for a friend
        assert prompt_tokens_served(port) > 0
    finally:
        server.kill()
        server.wait()
