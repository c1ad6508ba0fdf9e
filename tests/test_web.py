"""The web page in a real browser: Debian's Chromium, headless, driven by Playwright for Python.

The page is loaded from a real server (the shipped model), a prompt is submitted with the API key typed
into the settings, step updates are seen arriving while the canvas denoises (settled and re-noised
positions drawn differently), and the final text equals what the API returns for the same seed. A
screenshot is saved under test-artifacts/ (git-ignored) for a person to look at.
"""

from __future__ import annotations

import httpx
import pytest

from printpress.settings import MODES, SETTINGS, Setting

from helpers import ARTIFACTS, AUTH, KEY, MODEL, needs_chromium, open_page, running_server

pytestmark = [pytest.mark.browser, needs_chromium]


@pytest.fixture(scope="module")
def server():
    import printpress

    with running_server(printpress.load()) as s:
        yield s


def generate_and_wait(page) -> None:
    """Press Generate and wait for the run to end, which must be without an error."""
    page.click("#generate")
    page.wait_for_function("['done', 'error'].includes(document.getElementById('status').textContent)", timeout=60_000)
    assert page.inner_text("#status") == "done", page.inner_text("#error")


def test_page_draws_the_canvas_forming_and_shows_the_final_text(server, browser):
    page, errors = open_page(browser, server)
    page.fill("input[name=delay]", "40")  # slow the drawing so that intermediate canvases can be seen

    page.click("#generate")
    # While it runs: step events arrive and the canvas shows settled and re-noised positions.
    page.wait_for_function("Number(document.getElementById('steps-received').textContent) >= 3")
    page.wait_for_selector("#canvas .tok.renoised", state="attached")
    live = page.eval_on_selector_all("#canvas .tok", "cells => cells.map(c => c.className)")
    assert len(live) == 32 and all(c in ("tok settled", "tok renoised") for c in live)
    page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=60_000)

    final = page.inner_text("#committed")
    api = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                     json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 64, "steps": 8, "seed": 21}).json()
    assert final == "ROMEO:" + api["choices"][0]["text"]
    stats = api["printpress"][0]
    assert int(page.inner_text("#steps-received")) == stats["denoising_steps"]
    assert page.inner_text("[data-stat='denoising steps']") == str(stats["denoising_steps"])
    assert page.inner_text("[data-stat='tokens per forward']") == f"{stats['tokens_per_forward']:.2f}"
    assert float(page.inner_text("[data-stat='tokens/s']")) > 0
    assert page.inner_text("[data-stat='completion tokens']") == str(api["usage"]["completion_tokens"])
    assert page.eval_on_selector_all("#canvas .tok", "cells => cells.length") == 0  # the canvas was committed
    assert page.inner_text("#model-name") == MODEL
    assert errors == []

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-final.png"), full_page=True)
    page.close()


def test_page_shows_api_errors_and_stop_cancels(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("#prompt", "ROMEO:")
    page.click("#generate")  # no key typed: the server answers 401 and the page says so
    page.wait_for_function("document.getElementById('status').textContent === 'error'")
    assert "401" in page.inner_text("#error") and "API key" in page.inner_text("#error")

    page.fill("input[name=api_key]", KEY)
    page.fill("input[name=max_tokens]", "96")
    page.fill("input[name=steps]", "8")
    page.fill("input[name=delay]", "200")
    page.click("#generate")
    page.wait_for_function("Number(document.getElementById('steps-received').textContent) >= 1")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-denoising.png"), full_page=True)
    page.click("#stop")
    page.wait_for_function("document.getElementById('status').textContent === 'stopped'")
    assert page.is_enabled("#generate")
    page.close()


# ------------------------------------------------------------------------------------------------
# Issue 14: AR sampling fields, fields per mode, speculative mode, the model name without a key, no 404s
# ------------------------------------------------------------------------------------------------

FIELDS = ("steps", "draft_steps", "entropy_bound", "t_min", "t_max", "temperature", "top_k")
# temperature in diffusion mode scales the t_max -> t_min schedule (SETTINGS says diffusion reads it).
ENABLED = {"diffusion": {"steps", "entropy_bound", "t_min", "t_max", "temperature"},
           "ar": {"temperature", "top_k"},
           "speculative": {"draft_steps", "entropy_bound", "t_min", "t_max", "temperature", "top_k"}}


def test_page_enables_only_the_fields_of_the_chosen_mode(server, browser):
    page, errors = open_page(browser, server)
    for mode, enabled in ENABLED.items():
        page.select_option("select[name=mode]", mode)
        state = {name: page.is_enabled(f"input[name={name}]") for name in FIELDS}
        assert {name for name, on in state.items() if on} == enabled, mode
    assert errors == []
    page.close()


def test_page_samples_in_ar_mode_with_its_temperature_and_top_k(server, browser):
    page, errors = open_page(browser, server)  # steps=8 stays typed in, disabled: it must not be sent (a 400)
    page.select_option("select[name=mode]", "ar")
    page.fill("input[name=temperature]", "0.7")
    page.fill("input[name=top_k]", "20")
    page.fill("input[name=max_tokens]", "24")
    generate_and_wait(page)
    api = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                     json={"prompt": "ROMEO:", "mode": "ar", "temperature": 0.7, "top_k": 20, "max_tokens": 24,
                           "seed": 21}).json()
    assert page.inner_text("#committed") == "ROMEO:" + api["choices"][0]["text"]
    assert page.inner_text("[data-stat='mode']") == "ar"
    assert errors == []
    page.close()


def test_page_runs_speculative_mode(server, browser):
    page, errors = open_page(browser, server)
    page.select_option("select[name=mode]", "speculative")
    page.fill("input[name=temperature]", "0")
    page.fill("input[name=draft_steps]", "2")
    page.fill("input[name=max_tokens]", "16")
    generate_and_wait(page)
    greedy = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                        json={"prompt": "ROMEO:", "mode": "ar", "temperature": 0, "max_tokens": 16}).json()
    assert page.inner_text("#committed") == "ROMEO:" + greedy["choices"][0]["text"]  # AR's output, exactly
    assert page.inner_text("[data-stat='mode']") == "speculative"
    assert errors == []
    page.close()


def test_page_names_the_model_before_any_request_and_asks_for_no_favicon(server, browser):
    page = browser.new_page()
    requested, failed = [], []
    page.on("request", lambda request: requested.append(request.url))
    page.on("response", lambda response: response.status >= 400 and failed.append(response.url))
    page.goto(server.url + "/")  # no key typed, nothing generated
    page.wait_for_function("document.getElementById('model-name').textContent !== ''")
    assert page.inner_text("#model-name") == MODEL
    assert page.input_value("#prompt") == "ROMEO.\n"  # the corpus's own way of starting a speech
    page.wait_for_load_state("networkidle")
    assert failed == [] and not any(url.endswith("/favicon.ico") for url in requested), (failed, requested)
    page.close()


# ------------------------------------------------------------------------------------------------
# Issue 12: the sampler fields are drawn from SETTINGS (through the server's settings list)
# ------------------------------------------------------------------------------------------------

HTTP_SETTINGS = [s for s in SETTINGS if s.http is not None]


def taking_modes(s) -> list[str]:
    """The modes whose requests take the setting: `steps` is refused in mode speculative (draft_steps is its)."""
    return [m for m in s.modes if not (s.wire == "steps" and m == "speculative")]


def test_every_http_setting_has_a_field_enabled_in_the_modes_that_take_it(server, browser):
    page, errors = open_page(browser, server)
    drawn = [s for s in HTTP_SETTINGS if s.wire != "mode"]  # the mode box is the page's own
    for s in drawn:
        field = page.eval_on_selector(f"#sampler-fields [name={s.wire}]",
                                      "el => [el.closest('label').dataset.modes, el.type, el.step]")
        want = (["select-one", None] if s.choices else
                {bool: ["checkbox", ""], int: ["number", "1"], float: ["number", "any"]}[s.kind])
        assert field == [" ".join(taking_modes(s)), *want], s.wire
    for mode in MODES:
        page.select_option("select[name=mode]", mode)
        enabled = {s.wire for s in drawn if page.is_enabled(f"[name={s.wire}]")}
        assert enabled == {s.wire for s in drawn if mode in taking_modes(s)}, mode
    # An empty box means the model's default, and for temperature in mode diffusion a multiplier of 1.
    served = f"model default ({server.app.state.printpress.pipeline.generation_config.temperature:g})"
    placeholders = {}
    for mode in MODES:
        page.select_option("select[name=mode]", mode)
        placeholders[mode] = page.get_attribute("input[name=temperature]", "placeholder")
    assert placeholders == {"diffusion": "model default (1)", "ar": served, "speculative": served}
    assert page.get_attribute("input[name=draft_steps]", "placeholder") == "model default (1)"
    assert errors == []
    page.close()


def test_the_request_body_is_typed_by_each_settings_kind(server, browser):
    page, errors = open_page(browser, server)  # steps=8, seed=21, max_tokens=64
    page.fill("input[name=t_max]", "0.5")
    page.check("input[name=sample_accepted_only]")
    body = page.evaluate("printpress.readSettings()")
    assert body == {"prompt": "ROMEO:", "mode": "diffusion", "max_tokens": 64, "seed": 21, "steps": 8, "t_max": 0.5,
                    "sample_accepted_only": True}
    page.select_option("select[name=mode]", "ar")  # none of them is read by ar: none is sent
    assert page.evaluate("printpress.readSettings()") == {"prompt": "ROMEO:", "mode": "ar", "max_tokens": 64,
                                                          "seed": 21}
    assert errors == []
    page.close()


def test_a_new_setting_reaches_the_page_with_no_page_edit(server, browser, monkeypatch):
    from printpress.serve import protocol

    knob = Setting("lookahead", int, "mode speculative: a knob added later", default=3, modes=("speculative",),
                   http=dict(ge=1, le=16))
    monkeypatch.setattr(protocol, "SETTINGS", (*SETTINGS, knob))
    with running_server(server.app.state.printpress.pipeline) as other:
        page, errors = open_page(browser, other)
        label = page.eval_on_selector("input[name=lookahead]", "el => [el.closest('label').dataset.modes, "
                                                                  "el.min, el.max, el.placeholder]")
        assert label == ["speculative", "1", "16", "model default (3)"]
        assert not page.is_enabled("input[name=lookahead]")
        page.select_option("select[name=mode]", "speculative")
        page.fill("input[name=lookahead]", "5")
        assert page.evaluate("printpress.readSettings()")["lookahead"] == 5
        assert errors == []
        page.close()
