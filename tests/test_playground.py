"""The playground page: its routes in process, then the page itself in headless Chromium
against a real server (with an API key) on the default model."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from fakes import FakeEngine
from litestar.testing import TestClient
from server import READY_S, Server, free_port, wait_app_ready
from test_reliability import live
from test_service import EXAMPLES, NUM_LAYERS, FeatureEngine, H, probe_profile

from calibration.reliability import reliability_diagram
from judge import atomicio
from service import ServiceConfig, create_app
from service.web.playground import STATIC

KEY = "playground-key"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SPEC = Path("/tmp/spec")  # where the lead looks at the screenshot, when there is one
PROMPT = "Is this SMS spam? URGENT: your account is locked, reply with your PIN"
XSS = '<img src=x onerror="window.__xss=1">'


# --- the routes, in process -------------------------------------------------------------


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[TestClient[Any]]:
    app = create_app(FakeEngine(), config=ServiceConfig(profiles_dir=tmp_path, api_key=KEY))
    with TestClient(app=app) as c:
        yield c


def test_root_redirects_and_the_page_is_public_with_a_strict_csp(
    app_client: TestClient[Any],
) -> None:
    r = app_client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/playground"
    page = app_client.get("/playground")  # no key: a browser's navigation cannot send one
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    for asset, kind in [("playground.js", "javascript"), ("playground.css", "text/css")]:
        r = app_client.get(f"/static/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
        assert r.content == (STATIC / asset).read_bytes()
    # The API stays behind the key.
    assert app_client.get("/profiles").status_code == 401
    assert app_client.get("/profiles", headers={"Authorization": f"Bearer {KEY}"}).json() == []


def test_static_files_stay_in_their_directory(app_client: TestClient[Any]) -> None:
    for path in ["/static/%2e%2e/client.py", "/static/..%2Fclient.py", "/static/missing.js"]:
        assert app_client.get(path).status_code == 404, path


def test_playground_is_not_in_the_api_schema(app_client: TestClient[Any]) -> None:
    schema = app_client.get("/schema/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    paths = set(schema.json()["paths"])
    assert "/judge" in paths
    assert not {p for p in paths if p == "/" or p.startswith(("/playground", "/static"))}


def test_the_page_runs_no_inline_script_and_builds_no_markup_from_data() -> None:
    html = (STATIC / "playground.html").read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="/static/' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html)  # no inline event handlers
    assert not re.search(r"\sstyle\s*=", html)  # no inline style the CSP would block
    assert "http://" not in html.replace('"http://www.w3.org', "") and "https://" not in html
    js = (STATIC / "playground.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js.replace("never innerHTML", ""), sink
    assert "localStorage" not in js and "sessionStorage" not in js and "cookie" not in js


def test_reliability_png_is_served_with_the_key(
    app_client: TestClient[Any], tmp_path: Path
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    missing = app_client.get("/playground/profiles/sms/reliability.png", headers=auth)
    assert missing.status_code == 404 and missing.json()["field"] == "profile"
    png = write_reliability_png(tmp_path / "sms.reliability.png")
    assert app_client.get("/playground/profiles/sms/reliability.png").status_code == 401
    r = app_client.get("/playground/profiles/sms/reliability.png", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content == png
    bad = app_client.get("/playground/profiles/..%2Fsms/reliability.png", headers=auth)
    assert bad.status_code == 404


NODE = shutil.which("node")
# The page's script in a bare context, with a stub document: its functions are plain globals.
DESCRIBE = """
const vm = require("vm"), fs = require("fs");
const context = vm.createContext({ document: { addEventListener() {} } });
vm.runInContext(fs.readFileSync(process.argv[1], "utf8"), context);
const input = JSON.parse(fs.readFileSync(0, "utf8"));
const out = {
  used: input.responses.map((r) => context.profileUsed(r)),
  maps: input.maps.map((m) => context.mapText(m)),
};
process.stdout.write(JSON.stringify(out));
"""


def describe(responses: list[Any], maps: list[Any]) -> dict[str, list[str]]:
    """What the page writes for these /judge responses and calibration maps."""
    assert NODE is not None
    done = subprocess.run(
        [NODE, "-e", DESCRIBE, str(STATIC / "playground.js")],
        input=json.dumps({"responses": responses, "maps": maps}),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out: dict[str, list[str]] = json.loads(done.stdout)
    return out


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_a_probe_profile_is_shown_by_its_layers_not_a_temperature(tmp_path: Path) -> None:
    engine = FeatureEngine()
    profile = probe_profile()
    with TestClient(app=create_app(engine, config=ServiceConfig(profiles_dir=tmp_path))) as c:
        r = c.put("/profiles/probe", content=msgspec.json.encode(profile))
        assert r.status_code == 200, r.text
        wait_app_ready(c)
        probed = c.post(
            "/judge", json={"prompt": "x", "choices": ["yes", "no"], "profile": "probe"}
        )
        plain = c.post("/judge", json={"prompt": "x", "choices": ["yes", "no"]})
        stored = c.get("/profiles/probe").json()
    assert probed.status_code == plain.status_code == 200
    baseline = stored["baseline"]["calibration_map"]
    shown = describe(
        [probed.json(), plain.json(), {**plain.json(), "profile": "sms", "temperature": 1.5}],
        [stored["calibration_map"], baseline, {"method": "temperature", "temperature": 2.0}],
    )
    assert shown["used"] == [
        "probe, probe on hidden layer 2",
        "none (raw probabilities)",
        "sms, temperature 1.500",
    ]
    assert shown["maps"][0] == f"probe on hidden layer 2 of {NUM_LAYERS} ({H} values each)"
    assert shown["maps"][1].startswith(baseline["method"])
    assert shown["maps"][2] == "temperature, T = 2.000"


def write_reliability_png(path: Path) -> bytes:
    """A real diagram from calibration.reliability, on synthetic scores."""
    rng = np.random.default_rng(0)
    p1 = rng.uniform(0, 1, 200)
    probs = np.stack([1 - p1, p1], axis=1)
    y = (rng.uniform(0, 1, 200) < p1).astype(int)
    reliability_diagram((probs**2 / (probs**2).sum(1, keepdims=True), y), (probs, y), path)
    return path.read_bytes()


# --- the page, in Chromium --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    profiles = tmp_path_factory.mktemp("profiles")
    port = free_port()
    command = [sys.executable, "-m", "service.cli.main", "serve", "--port", str(port)]
    options = ["--dtype", "float32", "--profiles-dir", str(profiles)]
    options += ["--request-timeout", f"{READY_S:g}"]  # only a hang: speed is the machine's
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JUDGE_API_KEY", KEY)  # the server process inherits it; argv shows no key
        s = Server([*command, *options], port)
    try:
        s.wait_ready(auth())
        fit = {
            "choices": ["spam", "ham"],
            "examples": [{"prompt": p, "label": y} for p, y in EXAMPLES],
        }
        r = httpx.post(f"{s.url}/profiles/sms/fit", json=fit, headers=auth(), timeout=READY_S)
        assert r.status_code == 200, r.text
        write_reliability_png(profiles / "sms.reliability.png")
        yield s
    finally:
        s.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip(
            f"no browser: {CHROMIUM} or {CHROMEDRIVER} is missing "
            "(apt-get install chromium chromium-driver)"
        )
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install '.[dev]')"
    )
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ]:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=DriverService(str(CHROMEDRIVER)))
    driver.set_window_size(1280, 900)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The playground as a test drives it."""

    def __init__(self, driver: Any, url: str) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver, self.url, self.by = driver, url, By
        self.wait = WebDriverWait(driver, 120)

    def find(self, css: str) -> Any:
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def shown_panels(self) -> list[str]:
        """The ids of the tab panels a person can see, as Chromium lays the page out."""
        return [p.get_attribute("id") for p in self.all("[role=tabpanel]") if p.is_displayed()]

    def selected_tabs(self) -> list[str]:
        return [
            t.get_attribute("id")
            for t in self.all("[role=tab]")
            if t.get_attribute("aria-selected") == "true"
        ]

    def show(self, tab: str, panel: str) -> None:
        """Click a tab; then its panel, and only it, is on screen."""
        self.find(f"#{tab}").click()  # the page switches panels in the click handler
        assert self.selected_tabs() == [tab]
        assert self.shown_panels() == [panel], f"after clicking {tab}"

    def view_profile(self, name: str) -> None:
        """Open the page with profile ``name``, pick it in the profiles tab and wait for its
        view."""
        from selenium.webdriver.support.ui import Select

        self.open_with(name)
        self.show("tab-profiles", "profiles-view")
        self.wait.until(lambda d: self.all(f"#profile-pick option[value='{name}']"))
        Select(self.find("#profile-pick")).select_by_value(name)
        self.wait.until(
            lambda d: self.find("#profile-detail").get_attribute("data-state") == "done"
        )

    def all(self, css: str) -> list[Any]:
        return list(self.driver.find_elements(self.by.CSS_SELECTOR, css))

    def open(self) -> None:
        self.open_with("sms")

    def open_with(self, profile: str) -> None:
        """Open the page, type the key, and wait for ``profile`` among the profiles."""
        self.driver.get(self.url + "/")
        self.wait.until(lambda d: d.current_url.endswith("/playground"))
        key = self.find("#api-key")
        key.send_keys(KEY)
        self.find("#prompt").click()  # leaving the field fires its change: profiles load
        self.wait.until(lambda d: self.all(f"#profile option[value='{profile}']"))
        assert self.shown_panels() == ["judge-view"]

    def fill(self, css: str, text: str) -> None:
        field = self.find(css)
        field.clear()
        field.send_keys(text)

    def submit(
        self,
        prompt: str,
        choices: list[str],
        profile: str = "",
        threshold: str = "",
        rendered: bool = False,
    ) -> str:
        from selenium.webdriver.support.ui import Select

        self.fill("#prompt", prompt)
        self.fill("#choices", "\n".join(choices))
        self.fill("#threshold", threshold)
        Select(self.find("#profile")).select_by_value(profile)
        box = self.find("#return-prompt")
        if box.is_selected() != rendered:
            box.click()
        self.driver.execute_script("document.getElementById('judge-form').dataset.state = 'idle'")
        self.find("#submit").click()
        self.wait.until(
            lambda d: self.find("#judge-form").get_attribute("data-state") in ("done", "error")
        )
        state: str = self.find("#judge-form").get_attribute("data-state")
        return state

    def bars(self) -> list[tuple[str, str, str, str]]:
        """(data-choice, data-calibrated, data-raw, the label's text) per bar, in order."""
        return [
            (
                b.get_attribute("data-choice"),
                b.get_attribute("data-calibrated"),
                b.get_attribute("data-raw"),
                b.find_element(self.by.CSS_SELECTOR, ".label").text,
            )
            for b in self.all("#bars .bar[data-choice]")
        ]

    def screenshot(self, path: Path) -> None:
        atomicio.write_bytes(path, self.driver.get_screenshot_as_png())
        if SPEC.is_dir():
            shutil.copyfile(path, SPEC / path.name)


def judged(server: Server, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(f"{server.url}/judge", json=body, headers=auth(), timeout=120)
    return r.status_code, r.json()


def printed(x: float) -> float:
    return round(x, 4)


def same_numbers(bars: list[tuple[str, str, str, str]], body: dict[str, Any]) -> None:
    assert [b[0] for b in bars] == list(body["probabilities"])
    for choice, calibrated, raw, label in bars:
        assert label == choice
        # The page prints 4 decimals; allow one unit of the last place for the rounding of
        # two judgments that differ in float noise.
        assert float(calibrated) == pytest.approx(printed(body["probabilities"][choice]), abs=1e-4)
        assert float(raw) == pytest.approx(printed(body["raw_probabilities"][choice]), abs=1e-4)


def test_each_tab_shows_its_own_panel_and_no_other(browser: Any, tmp_path: Path) -> None:
    # Pure page mechanics: a server on a fake engine is enough to serve the page.
    with live(FakeEngine(), tmp_path) as url:
        page = Page(browser, url)
        browser.get(url + "/playground")
        page.wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        tabs = {t.get_attribute("id"): t.get_attribute("data-view") for t in page.all("[role=tab]")}
        # Every tab names its own panel and every panel has a tab, so visiting every tab below
        # covers every panel, whatever tabs the page grows.
        panels = [p.get_attribute("id") for p in page.all("[role=tabpanel]")]
        assert sorted(tabs.values()) == sorted(panels) and len(set(panels)) == len(panels)
        assert {"tab-judge": "judge-view", "tab-profiles": "profiles-view"}.items() <= tabs.items()
        # What a person sees on first load: the Judge panel, and only it.
        assert page.selected_tabs() == ["tab-judge"]
        assert page.shown_panels() == ["judge-view"], "first load"
        for tab in [*tabs, *reversed(tabs), "tab-profiles", "tab-profiles"]:
            page.show(tab, tabs[tab])
        assert_no_csp_violations(browser)


def test_the_page_shows_what_post_judge_says(browser: Any, server: Server, tmp_path: Path) -> None:
    page = Page(browser, server.url)
    page.open()
    choices = ["spam", "ham", "unsure"]
    assert page.submit(PROMPT, choices, rendered=True) == "done"
    status, body = judged(server, {"prompt": PROMPT, "choices": choices, "return_prompt": True})
    assert status == 200
    same_numbers(page.bars(), body)
    assert page.find("#decision").text.lower() == body["decision"]
    assert page.find("#choice").text == body["choice"]
    assert [li.text for li in page.all("#reasons li")] == body["reasons"]
    assert float(page.find("#choice-mass").text) == pytest.approx(body["choice_mass"], abs=1e-4)
    assert page.find("#latency").text.endswith(" ms")
    assert page.find("#rendered-prompt").get_property("textContent") == body["prompt"]
    assert page.find("#rendered-prompt-box").is_displayed()
    page.screenshot(tmp_path / "playground.png")

    # With the profile: calibrated and raw bars differ, as the server's numbers do.
    assert page.submit(PROMPT, ["ham", "spam"], profile="sms") == "done"
    status, body = judged(server, {"prompt": PROMPT, "choices": ["ham", "spam"], "profile": "sms"})
    assert status == 200
    same_numbers(page.bars(), body)
    assert page.find("#decision").text.lower() == body["decision"]
    assert page.find("#profile-used").text.startswith("sms")
    assert not page.find("#rendered-prompt-box").is_displayed()
    # A threshold overrides the profile's certified one; where it certified none, the page
    # shows the server's 422, which names the opt-in.
    overridden = page.submit(PROMPT, ["ham", "spam"], profile="sms", threshold="0.6")
    status, body = judged(
        server, {"prompt": PROMPT, "choices": ["ham", "spam"], "profile": "sms", "threshold": 0.6}
    )
    if status == 200:
        assert overridden == "done" and page.find("#threshold-used").text.startswith("0.600")
    else:
        assert status == 422 and overridden == "error"
        assert "uncertified_threshold" in page.find("#error-detail").text
    assert_no_csp_violations(browser)


def test_markup_in_a_choice_is_shown_as_text(browser: Any, server: Server) -> None:
    page = Page(browser, server.url)
    page.open()
    choices = [XSS, "ham", "spam"]
    assert page.submit(PROMPT, choices) == "done"
    bars = page.bars()
    assert [b[0] for b in bars] == choices and bars[0][3] == XSS
    assert page.all("#bars img") == [] and page.all("main img:not(#reliability-png)") == []
    assert browser.execute_script("return window.__xss") is None
    # And in an error: a duplicated choice is named in the server's detail.
    twice = ['<img src=x onerror="window.__xss=2">'] * 2
    assert page.submit(PROMPT, twice) == "error"
    assert twice[0] in page.find("#error-detail").text
    assert page.all("#error img") == []
    assert browser.execute_script("return window.__xss") is None


def test_a_4xx_shows_the_server_s_detail(browser: Any, server: Server) -> None:
    page = Page(browser, server.url)
    page.open()
    assert page.submit(PROMPT, ["spam"]) == "error"
    status, body = judged(server, {"prompt": PROMPT, "choices": ["spam"]})
    assert 400 <= status < 500
    assert page.find("#error").text.startswith(str(status))
    assert page.find("#error-detail").text == body["detail"]
    assert page.find("#error-field").text == body["field"] == "choices"
    assert page.find("#error").is_displayed() and not page.find("#result").is_displayed()


def test_without_the_key_the_page_says_so(browser: Any, server: Server) -> None:
    browser.get(server.url + "/playground")
    page = Page(browser, server.url)
    page.wait.until(lambda d: page.find("#error").is_displayed())
    assert page.find("#error-field").text == "Authorization"
    assert "API key" in page.find("#error-detail").text


def test_the_profile_view(browser: Any, server: Server, tmp_path: Path) -> None:
    from selenium.webdriver.support.ui import Select

    profile = httpx.get(f"{server.url}/profiles/sms", headers=auth()).json()
    page = Page(browser, server.url)
    page.open()
    page.show("tab-profiles", "profiles-view")
    page.wait.until(lambda d: page.all("#profile-pick option[value='sms']"))
    Select(page.find("#profile-pick")).select_by_value("sms")
    page.wait.until(lambda d: page.find("#profile-detail").get_attribute("data-state") == "done")
    assert page.find("#profile-name").text == "sms"
    t = profile["threshold"]["threshold"]
    shown = page.find("#profile-threshold-value").text
    assert shown == (f"{t:.3f}" if t is not None else "none certified")
    rows = {
        r.get_attribute("data-metric"): [td.text for td in r.find_elements(page.by.TAG_NAME, "td")]
        for r in page.all("#profile-metrics tr[data-metric]")
    }
    for key in ("accuracy", "nll", "ece"):
        before, after = profile["metrics_before"][key], profile["metrics_after"][key]
        assert rows[key][1].startswith(f"{before['value']:.4f} [")
        assert rows[key][2].startswith(f"{after['value']:.4f} [")
    assert rows["n"][1:] == [
        str(profile["metrics_before"]["n"]),
        str(profile["metrics_after"]["n"]),
    ]
    # The chart: a point per metric before and after, from the profile's own numbers.
    assert len(page.all("#reliability-svg g[data-metric] circle")) == 2 * 4
    # The PNG beside the profile, fetched with the key.
    page.wait.until(lambda d: page.find("#reliability-png").is_displayed())
    width = browser.execute_script("return document.getElementById('reliability-png').naturalWidth")
    assert width > 100
    browser.execute_script("document.getElementById('profile-metrics').scrollIntoView()")
    page.screenshot(tmp_path / "playground-profile.png")
    assert_no_csp_violations(browser)


def test_the_profile_view_of_a_probe(browser: Any, server: Server) -> None:
    from selenium.webdriver.support.ui import Select

    profile = msgspec.structs.replace(probe_profile(), name="probe-view")
    r = httpx.put(
        f"{server.url}/profiles/probe-view",
        content=msgspec.json.encode(profile),
        headers={**auth(), "content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    try:
        page = Page(browser, server.url)
        page.open()
        page.show("tab-profiles", "profiles-view")
        page.wait.until(lambda d: page.all("#profile-pick option[value='probe-view']"))
        Select(page.find("#profile-pick")).select_by_value("probe-view")
        page.wait.until(
            lambda d: page.find("#profile-detail").get_attribute("data-state") == "done"
        )
        meta = page.find("#profile-meta").text
        assert f"map probe on hidden layer 2 of {NUM_LAYERS} ({H} values each)" in meta
        assert "· baseline " in meta and "T = 1.000" not in meta.split("· baseline")[0]
        assert_no_csp_violations(browser)
    finally:
        httpx.delete(f"{server.url}/profiles/probe-view", headers=auth())


def assert_no_csp_violations(driver: Any) -> None:
    logs = driver.get_log("browser")
    assert not [e for e in logs if "Content Security Policy" in e.get("message", "")], logs


# --- the labelling loop in Chromium (issue 57) -------------------------------------------

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
LABELLED = 30  # labels given in the page; the server refits after as many


@pytest.fixture(scope="module")
def labelling_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, dict[str, str]]]:
    """A server on the default model with a task profile (sms_spam, on 40 labels: it takes
    the item alone and certifies nothing at precision 0.999), a decision log that keeps the
    requests, every decision audited, and a refit after every 30 new labels. Also returns
    each test item's true label by its text."""
    if not DATA.exists():
        pytest.skip("the shared datasets are not beside this checkout")
    profiles = tmp_path_factory.mktemp("labelling-profiles")
    log = tmp_path_factory.mktemp("labelling-log") / "decisions.db"
    calibrate = [sys.executable, "-m", "service.cli.main", "calibrate", "--task"]
    calibrate += [str(DATA / "sms_spam"), "--limit", "40", "--target-precision", "0.999"]
    calibrate += ["--profiles-dir", str(profiles), "--dtype", "float32"]
    done = subprocess.run(calibrate, cwd=profiles, capture_output=True, text=True, timeout=READY_S)
    assert done.returncode == 0, done.stderr[-3000:]
    port = free_port()
    command = [sys.executable, "-m", "service.cli.main", "serve", "--port", str(port)]
    options = ["--dtype", "float32", "--profiles-dir", str(profiles), "--decision-log", str(log)]
    options += ["--log-requests", "--audit-rate", "1", "--refit-every", str(LABELLED)]
    options += ["--request-timeout", f"{READY_S:g}"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JUDGE_API_KEY", KEY)
        s = Server([*command, *options], port)
    try:
        s.wait_ready(auth())
        rows = [json.loads(line) for line in (DATA / "sms_spam" / "test.jsonl").open()][:40]
        yield s, {row["text"]: row["label"] for row in rows}
    finally:
        s.stop()


def test_the_playground_decides_an_item_alone_under_a_task_profile(
    browser: Any, labelling_server: tuple[Server, dict[str, str]]
) -> None:
    server, truth = labelling_server
    item = next(iter(truth))
    page = Page(browser, server.url)
    page.open_with("sms_spam")
    from selenium.webdriver.support.ui import Select

    Select(page.find("#profile")).select_by_value("sms_spam")
    assert page.find("#prompt-label").text == "Item" and page.find("#item-note").is_displayed()
    assert page.find("#choices").get_attribute("value").split("\n") == ["ham", "spam"]
    page.fill("#prompt", item)
    page.driver.execute_script("document.getElementById('judge-form').dataset.state = 'idle'")
    page.find("#submit").click()
    page.wait.until(
        lambda d: page.find("#judge-form").get_attribute("data-state") in ("done", "error")
    )
    assert page.find("#judge-form").get_attribute("data-state") == "done", page.find("#error").text
    # The same answer as POST /judge with the item alone, and the prompt it was placed in.
    status, body = judged(server, {"item": item, "profile": "sms_spam", "return_prompt": True})
    assert status == 200
    assert page.find("#rendered-prompt").text.strip() == body["prompt"].strip()
    assert item in body["prompt"] and body["prompt"] != item
    assert [b[1] for b in page.bars()] == [f"{p:.4f}" for p in body["probabilities"].values()]


def test_a_profile_that_certifies_nothing_says_what_next(
    browser: Any, labelling_server: tuple[Server, dict[str, str]]
) -> None:
    """The profile's view says how close its certificate came and what the labels say."""
    server, _ = labelling_server
    profile = httpx.get(f"{server.url}/profiles/sms_spam", headers=auth()).json()
    t = profile["threshold"]
    assert t["threshold"] is None and profile["labels_needed"] is not None
    page = Page(browser, server.url)
    page.view_profile("sms_spam")
    shown = page.find("#profile-next").text
    assert f"best lower bound on the precision is {t['best_certified_precision']:.3f}" in shown
    # 40 labels, 20 of them uniform and held out: too few to tell.
    assert "Too few uniform labels" in shown or "more uniform labels" in shown


def test_labels_given_in_the_playground_refit_the_profile(
    browser: Any, labelling_server: tuple[Server, dict[str, str]]
) -> None:
    server, truth = labelling_server
    decided = [judged(server, {"item": text, "profile": "sms_spam"})[1] for text in truth]
    before = {d["profile_etag"] for d in decided}
    assert len(before) == 1
    (etag,) = before
    page = Page(browser, server.url)
    page.open_with("sms_spam")
    page.show("tab-label", "label-view")
    from selenium.webdriver.support.ui import Select

    page.wait.until(lambda d: page.all("#label-profile option[value='sms_spam']"))
    Select(page.find("#label-profile")).select_by_value("sms_spam")
    page.wait.until(lambda d: page.find("#label-version").get_attribute("data-etag") == etag)
    seen = set()
    for _ in range(LABELLED):
        page.wait.until(lambda d: page.find("#label-card").get_attribute("data-state") == "ready")
        judgment = page.find("#label-card").get_attribute("data-judgment")
        assert judgment not in seen  # each decision is shown once
        seen.add(judgment)
        assert page.find("#label-stream").text.startswith("audit")
        label = truth[page.find("#label-item").text]
        page.find(f"#label-buttons button[data-choice='{label}']").click()

        def moved_on(_: Any, shown: str = judgment) -> bool:
            card = page.find("#label-card")
            return bool(
                card.get_attribute("data-judgment") != shown
                or card.get_attribute("data-state") == "empty"
            )

        page.wait.until(moved_on)
    assert "audit 30 of" in page.find("#label-state").text
    # The server refits in the background; the page sees the version change.
    page.wait.until(lambda d: page.find("#label-version").get_attribute("data-etag") != etag)
    new = page.find("#label-version").get_attribute("data-etag")
    served = page.all("#label-refits li[data-served='true']")
    assert served and "served" in served[-1].text
    # The labels are the log's, and a decision made now is made under the new version.
    logged = httpx.get(f"{server.url}/judgments/{decided[0]['judgment_id']}", headers=auth())
    assert logged.json()["label"] == truth[next(iter(truth))]
    status, now = judged(server, {"item": next(iter(truth)), "profile": "sms_spam"})
    assert status == 200 and now["profile_etag"] == new != etag


def test_the_traffic_panel_plots_shares_prior_and_alarms(
    browser: Any, labelling_server: tuple[Server, dict[str, str]]
) -> None:
    """The Profiles tab draws the current version's health over its decisions: a band per
    choice (the shares' confidence sequences), the live prior, the alarms' state."""
    server, truth = labelling_server
    texts = list(truth)[:12]
    decided = [judged(server, {"item": text, "profile": "sms_spam"})[1] for text in texts]
    etag = decided[-1]["profile_etag"]
    mine = [(d, t) for d, t in zip(decided, texts, strict=True) if d["profile_etag"] == etag]
    for d, text in mine[:4]:
        r = httpx.post(
            f"{server.url}/judgments/{d['judgment_id']}/label",
            json={"label": truth[text]},
            headers=auth(),
        )
        assert r.status_code == 200, r.text
    history = httpx.get(f"{server.url}/profiles/sms_spam/health/history", headers=auth()).json()
    assert history["profile_etag"] == etag and history["points"]
    page = Page(browser, server.url)
    page.view_profile("sms_spam")
    assert [g.get_attribute("data-choice") for g in page.all("#traffic-svg g.share")] == [
        "ham",
        "spam",
    ]
    last = history["points"][-1]
    assert f"{last['n_decisions']} decisions" in page.find("#traffic-state").text
    assert page.find("#traffic-state").get_attribute("data-alarms") == ",".join(last["alarms"])
    if last["shares"] is not None:  # two labelled and two not, at least: the bands are drawn
        assert len(page.all("#traffic-svg polygon.band")) == 2
    assert len(page.all("#traffic-svg polyline.prior")) == 2
