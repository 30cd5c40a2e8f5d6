"""report.html in a real browser: Debian's headless Chromium, driven by Selenium through chromedriver.

The page is served by a local HTTP server whose access log must show the one page request and nothing
else; Chrome's performance log must show no other request either. The DOM is checked after rendering:
verdict, flip rows, a row expanded to its diff, the search box and filters (timed at 1,000+ items).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from evalgate.report.html import report_html
from evalgate.cli.main import main as cli
from evalgate.gate.decide import gate_runs
from evalgate.run.baselines import load_baseline
from evalgate.run.store import load_run
from evalgate.gate.policy import load_thresholds
from gate_helpers import policy
from synthetic_runs import expected_flips, write_pair

if TYPE_CHECKING:
    from evalgate.report.explained import FlipExplanations

pytestmark = pytest.mark.slow  # end to end: each test takes more than a few seconds

REPO = Path(__file__).resolve().parents[1]
N_GSM8K, N_HUMANEVAL = 4000, 164  # about 1,400 flipped items
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000"]
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A FAILing gate over 4,164 synthetic items, its report.html, and the flips it must list."""
    root = tmp_path_factory.mktemp("report")
    base, cand = write_pair(root, N_GSM8K, N_HUMANEVAL, lost_every=3, gained_every=4)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(root, margin=5.0)), allow_uncalibrated=True)
    site = root / "site"
    site.mkdir()
    started = time.perf_counter()
    (site / "report.html").write_text(report_html(verdict), encoding="utf-8")
    print(f"\nreport.html: {N_GSM8K + N_HUMANEVAL} items rendered in {time.perf_counter() - started:.2f} s, "
          f"{(site / 'report.html').stat().st_size / 1e6:.2f} MB")
    return {"site": site, "verdict": verdict, "flips": expected_flips(root), "root": root, "base": base, "cand": cand}


class _LoggingHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):
        self.server.requests.append(self.requestline)

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")  # every load must reach the log
        super().end_headers()


@pytest.fixture(scope="module")
def server(report):
    handler = functools.partial(_LoggingHandler, directory=str(report["site"]))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _browser_paths() -> tuple[str, str]:
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        browser = None
    if not (browser and driver):
        reason = "needs Debian's chromium, chromium-driver and the selenium package (.ci/run installs them)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the browser test cannot run: it {reason}")
        pytest.skip(reason)
    return browser, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    browser_path, driver_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for flag in CHROME_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    """The report freshly loaded from the local server; the request log starts empty."""
    server.requests.clear()
    browser.get_log("performance")  # drop what earlier tests left
    browser.get(f"http://127.0.0.1:{server.server_address[1]}/report.html")
    return browser


def _visible_rows(driver) -> int:
    return driver.execute_script("return document.querySelectorAll('details.flip:not([hidden])').length")


def _wait_for(driver, script: str, expected, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        got = driver.execute_script(script)
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _wait_until(driver, script: str, timeout: float = 5.0) -> None:
    assert _wait_for(driver, script, True, timeout) is True, f"timed out waiting for: {script}"


def test_verdict_tasks_and_every_flip_are_on_the_page(page, report):
    assert page.find_element("id", "verdict-text").text == "FAIL"
    assert page.title.startswith("evalgate FAIL")
    cards = page.find_elements("css selector", ".task-card h2")
    assert [c.text for c in cards] == ["gsm8k", "humaneval"]
    assert len(page.find_elements("css selector", ".task-card svg.ci")) == 2
    total = sum(lost + gained for lost, gained in report["flips"].values())
    assert _visible_rows(page) == total
    directions = page.execute_script("return [...document.querySelectorAll('details.flip')].map(r => r.dataset.direction)")
    n_lost = sum(lost for lost, _ in report["flips"].values())
    assert directions == ["lost"] * n_lost + ["gained"] * (total - n_lost)  # lost items first
    assert page.find_element("id", "count").text == f"{total} of {total}"
    manifest = page.find_element("id", "manifest").text
    assert "w4a4_packed@synthetic 1.0" in manifest and "w4a8@synthetic 1.0" in manifest and "5.23.0" in manifest


def test_expanding_a_row_shows_the_diff_rendered_as_text(page):
    rows = page.find_elements("css selector", "details.flip")
    assert page.execute_script("return arguments[0].querySelector('.body').children.length", rows[0]) == 0  # lazy
    rows[0].find_element("css selector", "summary").click()
    sides = _wait_for(page, "return document.querySelectorAll('details.flip[open] .side').length", 2)
    assert sides == 2
    body = rows[0].find_element("css selector", ".body")
    assert body.find_elements("css selector", "span.del") and body.find_elements("css selector", "span.ins")
    assert [e.text for e in body.find_elements("css selector", "span.ans")] == page.execute_script(
        "var d = JSON.parse(document.getElementById('flip-data').textContent)[0];"
        "return [d.base.extracted, d.cand.extracted].filter(x => x !== null)")
    # some items carry <script> and <img onerror> in question and completions: shown as text, never as elements
    opened = page.execute_script(
        "var data = JSON.parse(document.getElementById('flip-data').textContent), rows = document.querySelectorAll('details.flip'), n = 0;"
        "data.forEach((d, i) => { if (n < 5 && (d.question || '').indexOf('<') >= 0) { rows[i].open = true; n++; } });"
        "return n;")
    assert opened > 0
    shown_script = "return [...document.querySelectorAll('details.flip[open] .body')].map(b => b.innerText).join()"
    _wait_until(page, f"var s = (function() {{ {shown_script} }})(); return s.indexOf('<script>alert') >= 0;")
    shown = page.execute_script(shown_script)
    assert "<script>alert" in shown
    assert page.execute_script("return document.querySelectorAll('script').length") == 2
    assert page.execute_script("return document.querySelectorAll('main img, main em').length") == 0


def test_humaneval_rows_show_failure_class_and_stderr(page):
    page.execute_script("document.getElementById('f-task').value = 'humaneval';"
                        "document.getElementById('f-task').dispatchEvent(new Event('change'))")
    row = page.execute_script("return [...document.querySelectorAll('details.flip')].find(r => !r.hidden)")
    row.find_element("css selector", "summary").click()
    _wait_for(page, "return document.querySelectorAll('details.flip[open] pre.stderr').length", 1)
    text = row.find_element("css selector", ".body").text
    assert "Traceback" in text and "failed:" in text or "timed_out" in text


def test_search_and_filters_toggle_rows(page, report):
    lost, gained = report["flips"]["gsm8k"]
    he_lost, he_gained = report["flips"]["humaneval"]
    box = page.find_element("id", "q")
    box.send_keys("HumanEval/1")  # HumanEval/1, /10..19, /100..199 among the flips
    expected = page.execute_script(
        "return [...document.querySelectorAll('details.flip')].filter(r => r.dataset.task === 'humaneval' &&"
        " r.querySelector('summary .mono').textContent.startsWith('HumanEval/1')).length")
    assert expected > 0
    assert _wait_for(page, "return document.querySelectorAll('details.flip:not([hidden])').length", expected) == expected
    assert page.find_element("id", "count").text.startswith(f"{expected} of ")
    box.clear()
    page.execute_script("document.getElementById('q').dispatchEvent(new Event('input'))")
    page.find_element("css selector", "#f-direction option[value=gained]").click()
    assert _wait_for(page, "return document.querySelectorAll('details.flip:not([hidden])').length",
                     gained + he_gained) == gained + he_gained
    page.find_element("css selector", "#f-direction option[value='']").click()
    page.find_element("css selector", "#f-failure option[value='failed:syntax']").click()
    syntax = sum(1 for r in report["verdict"].comparison.flips("humaneval").itertuples()
                 if "failed:syntax" in (r.base_failure_class, r.cand_failure_class))
    assert syntax > 0 and _visible_rows(page) == syntax
    page.find_element("css selector", "#f-failure option[value='']").click()
    assert _visible_rows(page) == lost + gained + he_lost + he_gained


def test_filtering_thousands_of_items_stays_fast(page, report):
    n_rows = page.execute_script("return document.querySelectorAll('details.flip').length")
    # the filter itself, then with the layout it causes (forced by reading a size)
    timings = page.execute_script(
        "var q = document.getElementById('q'), out = [];"
        "for (const text of ['apples', 'question 1', 'zzz-no-match', '']) {"
        "  q.value = text; var t0 = performance.now(); window.evalgateApplyFilter();"
        "  var f = window.evalgateLastFilterMs; document.body.getBoundingClientRect();"
        "  out.push([f, performance.now() - t0]); }"
        "return out;")
    load = page.execute_script("var t = performance.getEntriesByType('navigation')[0]; return t.domComplete;")
    print(f"\nfilter over {n_rows} flip rows ({N_GSM8K + N_HUMANEVAL} items), filter / with layout: "
          + ", ".join(f"{f:.1f}/{t:.1f} ms" for f, t in timings) + f"; page ready in {load:.0f} ms")
    assert max(t for _, t in timings) < 2000  # a sanity bound only


def test_no_network_request_but_the_page(page, server):
    page.find_element("css selector", "details.flip summary").click()  # expanding must not fetch either
    # the expanded row's diff is rendered (lazily, from the embedded JSON) before the network log is read
    _wait_until(page, "return !!document.querySelector('details.flip[open] .body span');")
    csp = page.execute_script("return document.querySelector('meta[http-equiv=Content-Security-Policy]').content")
    assert csp == CSP
    assert server.requests == ["GET /report.html HTTP/1.1"]
    urls = [json.loads(e["message"])["message"]["params"]["request"]["url"]
            for e in page.get_log("performance")
            if json.loads(e["message"])["message"]["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.endswith("/report.html") for u in urls), urls
    errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors  # no CSP violation, no script error


def test_screenshot_for_people(page, tmp_path):
    page.execute_script("document.querySelector('details.flip').open = true; window.scrollTo(0, 0)")
    _wait_until(page, "return !!document.querySelector('details.flip[open] .body span');")
    shot = tmp_path / "report.png"
    assert page.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("EVALGATE_KEEP_ARTIFACTS"):
        keep = REPO / "tests" / "artifacts"
        keep.mkdir(exist_ok=True)
        shutil.copyfile(shot, keep / "report.png")
    print(f"\nscreenshot: {shot}")


def test_report_cli_writes_html_and_exits_with_the_verdict(tmp_path):
    base, cand = write_pair(tmp_path / "runs", 300, 0, lost_every=3)
    out = tmp_path / "report.html"
    args = ["report", "--baseline", str(base), "--candidate", str(cand),
            "--thresholds", str(policy(tmp_path, margin=5.0)), "--allow-uncalibrated"]
    result = CliRunner().invoke(cli, args + ["--html", str(out)])
    assert result.exit_code == 1, result.output
    assert f"report in {out}" in result.output and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    same = CliRunner().invoke(cli, ["report", "--baseline", str(base), "--candidate", str(base),
                                    "--thresholds", str(policy(tmp_path, margin=5.0)), "--allow-uncalibrated",
                                    "--html", str(tmp_path / "same.html")])
    assert same.exit_code == 0, same.output
    assert "PASS" in (tmp_path / "same.html").read_text(encoding="utf-8")
    uncalibrated = CliRunner().invoke(cli, args[:-1] + ["--html", str(tmp_path / "x.html")])
    assert uncalibrated.exit_code == 2 and "evalgate calibrate" in uncalibrated.output
    assert not (tmp_path / "x.html").exists()
    missing = CliRunner().invoke(cli, ["report", "--baseline", str(tmp_path / "nope"), "--candidate",
                                       str(cand), "--html", str(tmp_path / "y.html")])
    assert missing.exit_code == 2 and "does not exist" in missing.output and len(missing.output.splitlines()) == 1


# --- flips tagged by `evalgate gate --explain`: sortable by kind, task and margin, offline --------------------


def _explained(verdict, margins: dict) -> FlipExplanations:
    """Explanations of the first flips of each task, each with a chosen margin (None: not replayed)."""
    from evalgate.explain import NEAR_TIE_NATS, NOT_REPLAYED, Explanation, KernelChoice, TopToken, explained_flips

    found = []
    for (task, doc_id), margin in margins.items():
        if margin is None:
            found.append(Explanation(task, doc_id, "lost", NOT_REPLAYED, "w4a8", "w4a4_packed", cannot="why not"))
            continue
        top = (TopToken(1, "a", -0.1), TopToken(2, "b", -0.1 - margin))
        found.append(Explanation(task, doc_id, "lost", "near-tie" if margin < NEAR_TIE_NATS else "divergence",
                                 "w4a8", "w4a4_packed", position=4, base=KernelChoice("w4a8", top, margin), kl_mean=0.01, kl_max=0.1,
                                 cand=KernelChoice("w4a4_packed", top, margin), layer=1, expert=3))
    return explained_flips(verdict.comparison, found)


def test_explained_flips_sort_by_kind_task_and_margin_offline(browser, tmp_path):
    base, cand = write_pair(tmp_path / "runs", 40, 12, lost_every=3, gained_every=4)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    flips = verdict.comparison.flips()
    picked = list(zip(flips["task"], flips["doc_id"]))
    gsm8k = [p for p in picked if p[0] == "gsm8k"][:3]
    humaneval = [p for p in picked if p[0] == "humaneval"][:2]
    margins = dict(zip(gsm8k + humaneval, [2.5, 0.125, None, 0.25, 1.0]))
    explained = _explained(verdict, margins)
    page_file = tmp_path / "report.html"
    page_file.write_text(report_html(verdict, explained), encoding="utf-8")
    browser.get(page_file.as_uri())  # from disk: no server, nothing to fetch

    def shown(attr: str) -> list:
        return browser.execute_script(
            f"return [...document.querySelectorAll('details.flip')].map(r => r.dataset.{attr} || null)")

    def tagged_margins() -> list:
        return [float(m) if m else None for m, k in zip(shown("margin"), shown("kind")) if k is not None]

    assert len(shown("i")) == len(picked)
    initial = shown("task")  # lost first, task by task, then gained
    assert initial != sorted(initial)
    browser.find_element("css selector", 'button.sort[data-sort="margin"]').click()
    assert tagged_margins() == [0.125, 0.25, 1.0, 2.5, None]  # ascending, the unreplayed last
    assert shown("kind")[len(margins):] == [None] * (len(picked) - len(margins))  # untagged flips after
    browser.find_element("css selector", 'button.sort[data-sort="margin"]').click()
    assert tagged_margins() == [2.5, 1.0, 0.25, 0.125, None]  # descending, the unreplayed still last
    assert browser.find_element("css selector", 'button.sort[data-sort="margin"]').get_attribute("aria-sort") \
        == "descending"
    browser.find_element("css selector", 'button.sort[data-sort="kind"]').click()
    assert [k for k in shown("kind") if k] == ["divergence", "divergence", "near-tie", "near-tie", "not replayed"]
    browser.find_element("css selector", 'button.sort[data-sort="task"]').click()
    tasks = shown("task")
    assert tasks == sorted(tasks)
    # a row opened after sorting shows its own item's diff (rows keep their data index)
    first = browser.find_element("css selector", "details.flip")
    first.find_element("css selector", "summary").click()
    _wait_until(browser, "return !!document.querySelector('details.flip[open] .body .side');")
    index = int(first.get_attribute("data-i"))
    assert first.find_element("css selector", ".question").text == browser.execute_script(
        "return JSON.parse(document.getElementById('flip-data').textContent)[arguments[0]].question", index)
    # the filters still count what they show, whatever the order
    browser.execute_script("var s = document.getElementById('f-task'); s.value = 'humaneval';"
                           "s.dispatchEvent(new Event('change'))")
    assert _visible_rows(browser) == sum(t == "humaneval" for t, _ in picked)
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert not errors, errors
