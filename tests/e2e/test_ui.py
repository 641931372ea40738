"""The dashboard at /admin/ui: its session cookie and CSRF rule over HTTP, then a real headless Chromium."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.tenants.auth import COOKIE, CSRF_HEADER, session_ok, session_value
from tests.conftest import ADMIN_TOKEN, Fleet, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "ui-model"
CHROMIUM = os.environ.get("FLEETGATE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run",
]


def test_session_cookie_value_is_bound_to_token_and_expiry() -> None:
    """A session value is valid only for the token that signed it, untampered and unexpired."""
    now = 1_000_000.0
    value = session_value("secret", now)
    assert session_ok("secret", value, now + 60)
    assert not session_ok("other", value, now + 60)
    assert not session_ok("secret", value, now + 13 * 3600)
    expires, _, mac = value.partition(".")
    assert not session_ok("secret", f"{int(expires) + 999}.{mac}", now)
    assert not session_ok("secret", "", now) and not session_ok("", value, now)
    assert "secret" not in value


@pytest.fixture(scope="module")
def live(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("ui"))
    try:
        _, url = fleet.gateway()
        fleet.worker("ui-h100", "--model", MODEL, "--option", "time_scale=0.05",
                     "--sim-profile", "h100-7b", "--adapters", "support-bot=/adapters/support-bot")
        fleet.worker("ui-t4", "--model", MODEL, "--option", "time_scale=0.05", "--sim-profile", "t4-7b",
                     "--max-model-len", "4096")
        fleet.wait_ready(url, "ui-h100", "ui-t4")
        yield fleet, url
    finally:
        fleet.close()


def test_token_exchanged_for_strict_httponly_cookie(live: tuple[Fleet, str]) -> None:
    """?token= swaps the admin token for an HttpOnly SameSite=Strict cookie and drops it from the URL."""
    _, url = live
    with httpx.Client(base_url=url, timeout=10) as client:
        page = client.get("/admin/ui")
        assert page.status_code == 200 and 'name=token' in page.text and "ui-h100" not in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert client.get("/admin/ui", params={"token": "wrong"}).status_code == 401
        resp = client.get("/admin/ui", params={"token": ADMIN_TOKEN})
        assert resp.status_code == 303 and resp.headers["location"] == "/admin/ui"
        cookie = resp.headers["set-cookie"].lower()
        assert all(part in cookie for part in ("httponly", "samesite=strict", "path=/admin"))
        assert ADMIN_TOKEN not in cookie
        dashboard = client.get("/admin/ui")
        assert dashboard.status_code == 200 and "ui-h100" in dashboard.text and "ui-t4" in dashboard.text
        assert client.get("/admin/ui/assets/dashboard.js").status_code == 200


def test_cookie_writes_need_the_csrf_header(live: tuple[Fleet, str]) -> None:
    """The cookie alone authorises admin reads; writes also need the page's custom header."""
    _, url = live
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.post("/admin/ui/login", data={"token": "nope"}).status_code == 401
        assert client.post("/admin/ui/login", data={"token": ADMIN_TOKEN}).status_code == 303
        assert client.cookies.get(COOKIE)
        assert {w["id"] for w in client.get("/admin/workers").json()["data"]} == {"ui-h100", "ui-t4"}
        assert isinstance(client.get("/admin/decisions").json()["data"], list)
        assert client.get("/admin/stats").json()["registry"] == "ok"
        assert client.post("/admin/workers/ui-t4/undrain").status_code == 401
        ok = client.post("/admin/workers/ui-t4/undrain", headers={CSRF_HEADER: "1"})
        assert ok.status_code == 200
        client.post("/admin/ui/logout")
        assert client.get("/admin/workers").status_code == 401
    with httpx.Client(base_url=url, timeout=10) as anonymous:
        assert anonymous.get("/admin/decisions").status_code == 401
        assert anonymous.get("/admin/stats").status_code == 401


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")
def test_dashboard_in_chromium_shows_fleet_and_drains(live: tuple[Fleet, str], tmp_path: Path) -> None:
    """In headless Chromium: sign in, see both workers, drain one through the confirmation dialog."""
    from playwright.sync_api import expect, sync_playwright

    fleet, url = live
    for _ in range(3):  # something for the decisions table and the request rates
        httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 640})
            page.set_default_timeout(15_000)
            page.goto(f"{url}/admin/ui")
            page.fill("#token", ADMIN_TOKEN)
            page.click("button[type=submit]")
            rows = page.locator("#workers tbody tr[data-worker]")
            expect(rows).to_have_count(2)
            expect(page.locator("#live")).to_have_text("live")
            t4 = page.locator('tr[data-worker="ui-t4"]')
            expect(page.locator('tr[data-worker="ui-h100"]')).to_contain_text("support-bot")
            expect(t4).to_contain_text("ready")

            t4.locator('button[data-action="drain"]').click()
            expect(page.locator("#confirm")).to_be_visible()
            expect(page.locator("#confirm-text")).to_contain_text("Drain worker ui-t4?")
            page.click("#confirm-ok")
            wait_until(lambda: fleet.workers(url)["ui-t4"]["state"] == "draining", timeout=10)
            expect(t4).to_contain_text("draining")
            expect(t4.locator('button[data-action="undrain"]')).to_be_visible()

            # Cancelling the dialog changes nothing.
            t4.locator('button[data-action="remove"]').click()
            page.click("#confirm-cancel")
            time.sleep(0.5)
            assert "ui-t4" in fleet.workers(url)

            page.wait_for_timeout(1600)  # one more poll: request rates and decisions filled in
            shot = os.environ.get("FLEETGATE_SCREENSHOT") or str(tmp_path / "dashboard.png")
            page.screenshot(path=shot, full_page=True)
            assert Path(shot).stat().st_size > 10_000
        finally:
            browser.close()
    with fleet.admin(url) as admin:  # leave the fleet as we found it
        admin.post("/admin/workers/ui-t4/undrain")
