"""GET /dashboard in a real browser (Playwright driving Debian's Chromium), its SSE feed, and its auth."""

import itertools
import json
import shutil
import threading
import time

import pytest
import requests

from service.api.dashboard import COUNTERS, PAGE_MAP_FEED
from tests.service.conftest import run_server, stories_settings, write_tenants_file

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
NUM_BLOCKS = 64
BLOCK_SIZE = 16
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to play outside in the park with her dog."
ADMIN_KEY, TENANT_KEY = "sk-admin-dash", "sk-acme-dash"


@pytest.fixture(scope="module")
def server(stories_dir):
    with run_server(stories_settings(stories_dir, num_blocks=NUM_BLOCKS, max_num_seqs=8)) as running:
        yield running


class Load:
    """Workers that keep long streaming completions (same prompt: shared prefix pages) running until stopped."""

    def __init__(self, server, num_workers: int = 3, max_tokens: int = 300) -> None:
        self.body = {"model": server.state.model_name, "prompt": PROMPT, "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True}
        self.url = server.url + "/v1/completions"
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(num_workers)]

    def _work(self) -> None:
        while not self.stopping.is_set():
            with requests.post(self.url, json=self.body, stream=True, timeout=60) as response:
                assert response.status_code == 200, response.text
                for _ in response.iter_lines():
                    pass

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Let the running requests end (no new ones start)."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)


class Events:
    """An SSE response read message by message: ("data", payload) or ("comment", text).

    One line iterator for the response's life: a dropped iter_lines() generator closes the connection.
    """

    def __init__(self, response) -> None:
        self.response = response
        self.lines = response.iter_lines()

    def __iter__(self):
        for line in self.lines:
            if line.startswith(b"data: "):
                yield "data", json.loads(line[len(b"data: "):])
            elif line.startswith(b":"):
                yield "comment", line[1:].strip().decode()

    def take(self, count: int) -> list:
        return list(itertools.islice(self, count))


def _first_snapshot(server, headers=None, **params) -> dict:
    with requests.get(server.url + "/dashboard/events", headers=headers, params=params, stream=True,
                      timeout=10) as response:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return Events(response).take(1)[0][1]


def _cell_counts(page) -> dict:
    return page.evaluate("""() => {
        const n = (sel) => document.querySelectorAll('#grid ' + sel).length;
        return {total: n('.cell'), used: n('.cell.used'), shared: n('.cell.shared'),
                cached: n('.cell.cached'), free: n('.cell.free')};
    }""")


def _chromium() -> str:
    """Chromium on PATH; its absence is a broken setup, not a reason to skip the browser test."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("no `chromium` on PATH: the dashboard's browser test needs it "
                    "(run `make setup`, or scripts/system-deps.sh, to install it)")
    return path


def test_page_map_follows_requests_in_the_browser(server, tmp_path):
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    server.wait_idle()
    with sync_playwright() as pw, Load(server) as load:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(server.url + "/dashboard")
            page.wait_for_function("document.querySelectorAll('#grid .cell.used').length > 0", timeout=15_000)
            page.wait_for_function("document.querySelectorAll('#grid .cell.shared').length > 0", timeout=15_000)
            assert _cell_counts(page)["total"] == NUM_BLOCKS

            page.locator("#reqs .req").first.click()
            page.wait_for_function("document.querySelectorAll('#detail .pt-entry').length > 0", timeout=5_000)
            picture = page.evaluate("""() => ({
                ended: document.querySelector('#detail .ended') !== null,
                table: [...document.querySelectorAll('#detail .pt-entry')].map(e => e.title),
                selected: [...document.querySelectorAll('#grid .cell.sel')].map(c => +c.dataset.page),
            })""")
            if not picture["ended"]:  # the grid outlines exactly the pages the page table lists
                table_pages = sorted(int(t.split("page ")[1].split(",")[0]) for t in picture["table"])
                assert table_pages == sorted(picture["selected"])
            screenshot = tmp_path / "dashboard.png"
            page.screenshot(path=str(screenshot), full_page=True)
            assert screenshot.stat().st_size > 0

            load.stop()
            page.wait_for_function("document.querySelectorAll('#grid .cell.used').length === 0", timeout=20_000)
            counts = _cell_counts(page)
            assert counts["used"] == 0 and counts["free"] + counts["cached"] == NUM_BLOCKS
            assert counts["cached"] > 0  # the finished requests' full pages stay reusable
            assert page.locator("#detail .ended").count() == 1
            # finished requests by API (the load's are completions)
            page.wait_for_function("/completions [0-9]/.test(document.querySelector('#apis').textContent)",
                                   timeout=5_000)
        finally:
            browser.close()


def test_events_send_a_compact_snapshot_of_idle_pages(server):
    server.wait_idle()
    snapshot = _first_snapshot(server)
    assert (snapshot["block_size"], snapshot["num_blocks"], snapshot["max_model_len"]) == (BLOCK_SIZE, NUM_BLOCKS, 512)
    assert snapshot["model"] == server.state.model_name
    assert len(snapshot["pages"]) == NUM_BLOCKS and set(snapshot["pages"]) <= {".", "c"}
    assert (snapshot["seqs"], snapshot["shared"], snapshot["pinned"], snapshot["contiguous_pages"]) == ([], [], {}, 0)
    assert set(snapshot["counters"]) == set(COUNTERS)
    assert snapshot["counters"]["num_used_blocks"] == 0


def test_events_show_a_running_request_and_its_page_table(server):
    server.wait_idle()
    num_prompt_tokens = len(server.state.engine.request_builder.tokenize(PROMPT))
    with Load(server, num_workers=1), requests.get(server.url + "/dashboard/events", stream=True,
                                                   timeout=10) as response:
        for _, snapshot in itertools.islice(Events(response), 40):
            if snapshot["seqs"] and snapshot["seqs"][0][5] > num_prompt_tokens:  # decoding
                break
        else:
            pytest.fail("no running request seen")
    request_id, index, status, prompt, tokens, computed, max_tokens, table, drafted, accepted = snapshot["seqs"][0]
    assert drafted == accepted == 0  # no speculation on this server
    assert request_id.startswith("cmpl-") and (index, status, prompt, max_tokens) == (0, "r", num_prompt_tokens, 300)
    assert computed <= tokens and len(table) == -(-computed // BLOCK_SIZE)
    assert all(snapshot["pages"][p] == "u" for p in table)
    assert snapshot["pages"].count("u") == len(table) == snapshot["counters"]["num_used_blocks"]
    assert snapshot["contiguous_pages"] == 512 // BLOCK_SIZE


def test_idle_events_are_keepalive_comments_not_repeated_snapshots(server):
    server.wait_idle()
    with requests.get(server.url + "/dashboard/events", stream=True, timeout=10) as response:
        started = time.monotonic()
        kinds = [kind for kind, _ in Events(response).take(2)]
        elapsed = time.monotonic() - started
    assert kinds == ["data", "comment"] and 1.5 < elapsed < 4.0


def test_viewers_share_one_poller_that_stops_when_they_leave(server):
    server.wait_idle()
    bridge = server.state.bridge
    calls = []
    real_page_map = bridge.page_map

    async def counted_page_map():
        calls.append(time.monotonic())
        return await real_page_map()

    bridge.page_map = counted_page_map
    try:
        viewers = [Events(requests.get(server.url + "/dashboard/events", stream=True, timeout=10)) for _ in range(4)]
        assert [viewer.take(1)[0][0] for viewer in viewers] == ["data"] * 4
        assert server.app[PAGE_MAP_FEED].num_viewers == 4
        calls.clear()
        time.sleep(1.0)
        assert 2 <= len(calls) <= 6  # one snapshot per 0.25 s tick, not one per viewer
        for viewer in viewers:
            viewer.response.close()
        deadline = time.monotonic() + 5
        while server.app[PAGE_MAP_FEED].num_viewers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.app[PAGE_MAP_FEED].num_viewers == 0
        time.sleep(0.3)
        calls.clear()
        time.sleep(0.6)
        assert calls == []
    finally:
        del bridge.page_map


def test_with_tenants_the_dashboard_needs_an_admin_key(stories_dir, tmp_path):
    tenants = write_tenants_file(tmp_path / "tenants.toml", {"acme": {"keys": [TENANT_KEY], "plan": "standard"}},
                                 plans={"standard": {"input_per_mtok": 0.5, "cached_input_per_mtok": 0.05,
                                                     "output_per_mtok": 1.5}},
                                 admin_keys=[ADMIN_KEY])
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants)}, num_blocks=NUM_BLOCKS)
    with run_server(settings) as running:
        for path in ("/dashboard", "/dashboard/events"):
            missing = requests.get(running.url + path, timeout=10)
            wrong = requests.get(running.url + path, params={"key": "sk-wrong"}, timeout=10)
            tenant = requests.get(running.url + path, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=10)
            assert (missing.status_code, wrong.status_code, tenant.status_code) == (401, 401, 403), path
            assert missing.json()["error"]["code"] == "invalid_api_key"
            assert tenant.json()["error"]["code"] == "admin_key_required"
        page = requests.get(running.url + "/dashboard", params={"key": ADMIN_KEY}, timeout=10)
        assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
        assert "EventSource" in page.text
        assert _first_snapshot(running, key=ADMIN_KEY)["num_blocks"] == NUM_BLOCKS
        assert _first_snapshot(running, headers={"Authorization": f"Bearer {ADMIN_KEY}"})["seqs"] == []
