"""The dashboard in a real browser (Debian's chromium, driven by Playwright) against a real 2-node cluster.

One cluster and one page serve the module, as one user would keep the dashboard open: the tests run in
file order and the last one kills a node. Node a2 requires an API key (the page must ask for it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serving_cluster, wait_for
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from shardline.testing.cluster import LocalCluster, free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
KEY = "sk-dashboard-key"
ARTIFACTS = Path(os.environ.get("SHARDLINE_ARTIFACTS", Path(__file__).parents[1] / "artifacts")) / "dashboard"
DASH = "\u2013"  # layer ranges are written with an en dash
SIZES = {"desktop": (1366, 900), "phone": (390, 844)}


def _state(api: str) -> dict[str, Any]:
    try:
        r = httpx.get(api + "/state", timeout=10)
        return r.json() if r.status_code == 200 else {}
    except httpx.TransportError:
        return {}


def _instance(api: str) -> dict[str, Any] | None:
    insts = _state(api).get("instances", [])
    return insts[0] if insts else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[LocalCluster]:
    # a2 keeps its HTTP port across a restart, so a page open on it can reconnect.
    extra = {"a2": ["--api-key", KEY, "--api-port", str(free_port())]}
    with serving_cluster(tmp_path_factory.mktemp("dash"), ["a1", "a2"], model_dir, extra) as c:
        api = c.nodes["a1"].api
        wait_for(lambda: sum(n["alive"] for n in _state(api).get("nodes", [])) == 2, 60, "2 nodes")
        placed = httpx.post(api + "/instances", json={"model": MODEL}, timeout=120)
        assert placed.status_code == 201, placed.text
        wait_for(lambda: (i := _instance(api)) and i["phase"] == "ready", 180, "the instance ready")
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed: `make setup` installs it (apt-get install chromium)")
    pw: Playwright = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()
    finally:
        pw.stop()


@pytest.fixture(scope="module")
def page(cluster, browser) -> Iterator[Page]:
    p = browser.new_page(viewport={"width": 1366, "height": 900})
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.set_default_timeout(30_000)
    p.goto(cluster.nodes["a1"].api + "/")
    expect(p.locator("#conn")).to_have_attribute("data-conn", "live", timeout=30_000)
    yield p
    p.close()
    assert errors == [], errors  # no script error in the whole session


def _figure(page: Page, instance: str, name: str) -> str:
    where = f'[data-instance="{instance}"] [data-figure="{name}"] [data-role="value"]'
    return page.locator(where).inner_text()


@pytest.mark.timeout(120)
def test_page_lists_nodes_and_stages_with_layer_ranges(cluster, page):
    state = _state(cluster.nodes["a1"].api)
    for node in ("a1", "a2"):
        card = page.locator(f'[data-node="{node}"]')
        expect(card).to_have_attribute("data-status", "up")
        expect(card).to_contain_text("GFLOP/s")
        expect(card).to_contain_text("free of")
    expect(page.locator('[data-node="a1"] .badge.master')).to_be_visible()
    inst = state["instances"][0]
    assert {s["node_id"] for s in inst["stages"]} == {"a1", "a2"}  # the picture spans both nodes
    card = page.locator(f'[data-instance="{inst["instance"]}"]')
    expect(card).to_have_attribute("data-phase", "ready")
    assert inst["weight_format"]  # how its weights are stored: "q4_1→affine4/g32, ..." for the default model
    expect(card.locator('[data-role="weights"]')).to_have_text(inst["weight_format"])
    for k, st in enumerate(inst["stages"]):
        band = card.locator(f'[data-node-box="{st["node_id"]}"] [data-stage="{k}"]')
        expect(band.locator('[data-role="range"]')).to_have_text(f"layers {st['start']}{DASH}{st['end'] - 1}")
        expect(band).to_contain_text("ready")
    for name in ("tokens", "running", "queued", "ttft", "prefix", "blocks"):
        expect(card.locator(f'[data-figure="{name}"] svg.spark')).to_have_count(1)
    # No request yet: no prompt looked up in the prefix cache (no rate, not 0%), nothing cached.
    assert _figure(page, inst["instance"], "prefix") == DASH
    assert _figure(page, inst["instance"], "blocks") == "0"


@pytest.mark.timeout(180)
def test_chat_streams_an_answer(cluster, page):
    page.select_option("#chat-model", MODEL)
    page.fill("#chat-temp", "0")
    # Count the distinct lengths the answer goes through: a streamed answer grows, a whole one appears once.
    page.evaluate(
        """() => {
        window.__lengths = new Set();
        new MutationObserver(() => {
          const last = [...document.querySelectorAll('.msg.assistant .text')].pop();
          if (last) window.__lengths.add(last.textContent.length);
        }).observe(document.getElementById('chat-log'),
                   {subtree: true, childList: true, characterData: true});
    }"""
    )
    page.locator("#chat-input").fill("Name the capital of France.")
    page.locator("#chat-input").press("Enter")  # the keyboard sends
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done", timeout=120_000)
    assert "Paris" in answer.locator(".text").inner_text()
    assert page.evaluate("window.__lengths.size") >= 3
    expect(answer.locator(".meta")).to_contain_text("tokens")
    # The prefix cache's figures, as this node's /state has them once the leader's beats settle.
    api = cluster.nodes["a1"].api
    inst = _instance(api)
    assert inst is not None

    def shown_as_state() -> bool:
        live = _instance(api)["live"]  # type: ignore[index]
        rate, shown = live["prefix_hit_rate"], _figure(page, inst["instance"], "prefix")
        # One decimal of a percentage; JS and Python may round an exact half apart.
        if rate is None:
            same = shown == DASH
        else:
            same = shown.endswith("%") and abs(float(shown.rstrip("%")) - 100 * rate) <= 0.051
        return same and _figure(page, inst["instance"], "blocks") == str(live["prefix_blocks"])

    wait_for(shown_as_state, 30, "the page showing the prefix cache as /state does")


@pytest.mark.timeout(180)
def test_chat_shows_a_tool_call_and_its_json(cluster, page):
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    page.select_option("#chat-model", MODEL)
    page.fill("#chat-temp", "0")
    page.locator(".chat-tools summary").click()
    options = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    page.fill("#chat-extra", json.dumps(options))
    page.locator("#chat-input").fill("What is the weather in Paris?")
    page.locator("#chat-send").click()
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done", timeout=120_000)
    call = answer.locator(".call")
    expect(call).to_have_count(1)
    shown = call.inner_text()
    assert shown.startswith("get_weather(") and shown.endswith(")")
    args = json.loads(shown.removeprefix("get_weather(").removesuffix(")"))
    assert set(args) == {"city"} and isinstance(args["city"], str)
    page.fill("#chat-extra", "")


@pytest.mark.timeout(240)
def test_stop_button_ends_a_long_answer(cluster, page):
    api = cluster.nodes["a1"].api
    inst = _instance(api)
    assert inst is not None
    page.fill("#chat-max", "4000")
    page.fill("#chat-temp", "0.8")
    page.locator("#chat-input").fill("Write a very long story about a lighthouse keeper, in twenty chapters.")
    page.locator("#chat-send").click()
    answer = page.locator(".msg.assistant").last
    text = answer.locator(".text")
    wait_for(lambda: len(text.inner_text()) > 40, 120, "the answer to stream")
    wait_for(lambda: _figure(page, inst["instance"], "running") == "1", 30, "the page showing it running")
    page.locator("#chat-stop").click()
    expect(answer).to_have_attribute("data-state", "stopped")
    stopped_at = len(text.inner_text())
    wait_for(lambda: _figure(page, inst["instance"], "running") == "0", 30, "the page showing none running")
    assert _state(api)["instances"][0]["live"]["leader_requests"] == 0  # the leader let it go too
    assert len(text.inner_text()) == stopped_at  # nothing arrived after Stop
    expect(page.locator("#chat-send")).to_be_enabled()


def _open_with_key(browser: Browser, url: str) -> Page:
    p = browser.new_page(viewport={"width": 1366, "height": 900})
    p.goto(url)  # the page itself needs no key
    expect(p.locator("#conn")).to_have_attribute("data-conn", "key")
    expect(p.locator("#key-dialog")).to_be_visible()
    p.fill("#key-input", KEY)
    p.locator("#key-input").press("Enter")
    expect(p.locator("#conn")).to_have_attribute("data-conn", "live")
    return p


@pytest.mark.timeout(120)
def test_a_node_with_a_key_asks_for_it(cluster, browser):
    p = _open_with_key(browser, cluster.nodes["a2"].api + "/")
    try:
        expect(p.locator('[data-node="a1"]')).to_be_visible()
        p.reload()  # the key is remembered
        expect(p.locator("#conn")).to_have_attribute("data-conn", "live")
    finally:
        p.close()


@pytest.mark.timeout(300)
def test_place_with_preview_then_remove(cluster, page):
    api = cluster.nodes["a1"].api
    before = {i["instance"] for i in _state(api)["instances"]}
    page.select_option("#place-model", MODEL)
    # Too much KV for the cluster: the numbers say why, and Place stays off.
    page.fill("#place-tokens", "8000000")
    page.locator("#place-preview").click()
    verdict = page.locator('#place-result [data-fits="false"]')
    expect(verdict).to_contain_text("needs")
    expect(verdict).to_contain_text("GB")
    expect(page.locator("#place-go")).to_be_disabled()
    # A size that fits: the stages, their layers and memory, then Place.
    page.fill("#place-tokens", "512")
    page.fill("#place-seq", "1")
    page.locator("#place-preview").click()
    rows = page.locator('#place-result [data-fits="true"] tbody tr')
    expect(rows.first).to_contain_text("layers 0")
    # Pipeline or tensor-parallel groups, and why, in numbers.
    expect(page.locator('#place-result [data-role="layout"]')).to_contain_text("ms a token")
    expect(page.locator("#place-go")).to_be_enabled()
    page.locator("#place-go").click()
    expect(page.locator("#place-result")).to_contain_text("placed")
    new = wait_for(
        lambda: [i for i in _state(api)["instances"] if i["instance"] not in before], 30, "the new instance"
    )[0]["instance"]
    card = page.locator(f'[data-instance="{new}"]')
    expect(card).to_be_visible()
    expect(card).to_have_attribute("data-phase", "ready", timeout=180_000)
    expect(card.locator('[data-role="layout"]')).to_contain_text("pipeline")
    card.get_by_role("button", name=f"remove {new}").click()
    card.get_by_role("button", name="Confirm remove").click()
    expect(card).to_have_count(0, timeout=60_000)
    assert {i["instance"] for i in _state(api)["instances"]} == before


@pytest.mark.timeout(120)
def test_screenshots_at_desktop_and_phone_widths(cluster, page):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, (w, hgt) in SIZES.items():
        page.set_viewport_size({"width": w, "height": hgt})
        page.evaluate("window.scrollTo(0, 0)")
        # Nothing spills sideways: the page is as wide as the screen.
        assert page.evaluate("document.documentElement.scrollWidth") <= w
        path = ARTIFACTS / f"{name}.png"
        page.screenshot(path=str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    w, hgt = SIZES["desktop"]
    page.set_viewport_size({"width": w, "height": hgt})


@pytest.mark.timeout(300)
def test_sigkill_of_a_stage_node_shows_unreachable_recovering_then_ready(cluster, browser, page):
    api = cluster.nodes["a1"].api
    inst = _instance(api)
    assert inst is not None and inst["phase"] == "ready"
    card = page.locator(f'[data-instance="{inst["instance"]}"]')
    on_victim = _open_with_key(browser, cluster.nodes["a2"].api + "/")  # a page served by the node killed
    cluster.nodes["a2"].kill(signal.SIGKILL)
    expect(on_victim.locator("#conn")).to_have_attribute("data-conn", "retry")
    expect(page.locator('[data-node="a2"]')).to_have_attribute("data-status", "unreachable", timeout=60_000)
    # A quantized stage reloads in about a second: the card may pass through "recovering" between two
    # updates of the page, so what is asserted is the recovery it counts, then ready again.
    expect(card).to_contain_text(re.compile(r"\b[1-9][0-9]* recover"), timeout=180_000)
    expect(card).to_have_attribute("data-phase", "ready", timeout=180_000)
    failure = page.locator('#timeline [data-kind="failure"]').first
    # The reason (which detector saw it first: the link or the membership) names the node, and the pause.
    expect(failure.locator(".message")).to_contain_text("a2")
    expect(failure.locator(".pause")).to_contain_text("paused")
    expect(page.locator('#timeline [data-kind="recovered"]').first).to_contain_text("after a pause of")
    expect(page.locator('#timeline [data-kind="leave"]').first).to_contain_text("a2")
    page.screenshot(path=str(ARTIFACTS / "desktop-after-recovery.png"))
    # The node comes back on its port: the page that was open on it reconnects by itself.
    cluster.nodes["a2"].start()
    expect(on_victim.locator("#conn")).to_have_attribute("data-conn", "live", timeout=60_000)
    expect(on_victim.locator('[data-node="a2"]')).to_have_attribute("data-status", "up", timeout=30_000)
    expect(page.locator('[data-node="a2"]')).to_have_attribute("data-status", "up", timeout=30_000)
    on_victim.close()
