"""The chat page's weight and first paint in headless Chromium, and its screenshots for the docs.

Usage: python bench/web_page.py [--model smollm2-135m] [--out web_page] [--screenshots docs]

Starts ``quickdraft serve MODEL --speculative ngram`` on 127.0.0.1, opens ``/`` in Debian's Chromium (driven by
Playwright; ``apt-get install chromium``, ``pip install playwright``) with an empty cache, and reports what the
browser downloaded (bytes on the wire, per file) and the first paint / first contentful paint from the browser's
Performance API, median of --loads fresh loads. Then asks one greedy question and saves two screenshots: a streamed
answer with its accepted draft tokens coloured, and the settings.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

ASK = "Write the numbers from 1 to 40, separated by commas."


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft.cli", "serve", model, "--port", str(port),
                             "--speculative", "ngram", "--log-level", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not come up")


def measure_load(browser, url: str) -> dict:
    context = browser.new_context()
    page = context.new_page()
    page.goto(url + "/", wait_until="load")
    page.wait_for_selector("#model option", state="attached")
    timing = page.evaluate("""async () => {
        for (let i = 0; i < 100 && performance.getEntriesByType('paint').length < 2; i++)
            await new Promise(r => setTimeout(r, 20));  // paint entries are queued after the frame
        const paints = Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]));
        const files = [performance.getEntriesByType('navigation')[0], ...performance.getEntriesByType('resource')]
            .map(e => ({name: new URL(e.name).pathname, bytes: e.transferSize, body: e.encodedBodySize}));
        return {first_paint_ms: paints['first-paint'], first_contentful_paint_ms: paints['first-contentful-paint'],
                files};
    }""")
    context.close()
    return timing


def screenshots(browser, url: str, folder: Path) -> list[str]:
    context = browser.new_context(viewport={"width": 1200, "height": 760}, bypass_csp=True)
    page = context.new_page()
    page.goto(url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.fill("#max_tokens", "120")
    page.fill("#prompt", ASK)
    page.click("#send")
    page.wait_for_function("document.querySelector('#stop').hidden && "
                           "document.querySelector('.message.assistant .stats')?.textContent", timeout=120000)
    folder.mkdir(parents=True, exist_ok=True)
    answer, settings = folder / "chat_page_answer.png", folder / "chat_page_settings.png"
    page.screenshot(path=str(answer))
    page.locator("#sidebar").screenshot(path=str(settings))
    context.close()
    return [str(answer), str(settings)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--out", default="web_page")
    ap.add_argument("--screenshots", default=str(Path(__file__).resolve().parents[1] / "docs"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no Chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    info = machine()
    proc, url = start_server(args.model)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            loads = [measure_load(browser, url) for _ in range(args.loads)]
            shots = screenshots(browser, url, Path(args.screenshots))
            version = browser.version
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)
    files = [f for f in loads[-1]["files"] if f["name"] != "/v1/models"]
    rows = [{"file": f["name"], "kb_on_wire": f["bytes"] / 1024, "kb_body": f["body"] / 1024} for f in files]
    total = sum(f["bytes"] for f in files) / 1024
    paint = statistics.median(x["first_paint_ms"] for x in loads)
    contentful = statistics.median(x["first_contentful_paint_ms"] for x in loads)
    print(f"machine: {info['cpu']}, {info['cores']} cores; Chromium {version}, headless")
    print(table(rows, ["file", "kb_on_wire", "kb_body"]))
    print(f"page weight {total:.1f} KB on the wire (no other request but /v1/models); first paint {paint:.0f} ms, "
          f"first contentful paint {contentful:.0f} ms (median of {args.loads} fresh loads)")
    print(f"screenshots: {', '.join(shots)}")
    payload = {"machine": info, "chromium": version, "files": rows, "total_kb": total, "first_paint_ms": paint,
               "first_contentful_paint_ms": contentful, "loads": loads, "screenshots": shots}
    print(f"wrote {save(args.out, payload)}")


if __name__ == "__main__":
    main()
