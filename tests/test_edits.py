"""POST /v1/edits and the page's "Rewrite": infill and span rewriting over HTTP, against the library.

A real uvicorn server (tests/helpers.py's `running_server`, with the edits router mounted as
`printpress serve` mounts it) runs the shipped model with 4 denoising steps, so an edit takes a few tens of
milliseconds. Every answer is compared with `printpress.editing.rewrite` / `infill` called directly with
the same seed and settings, and the text outside the span must come back unchanged, character for
character. The browser tests use conftest.py's Chromium fixture.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import httpx
import pytest
from helpers import (
    ARTIFACTS,
    AUTH,
    KEY,
    MODEL,
    STEPS,
    needs_chromium,
    open_page,
    running_server,
    server_load,
    sse_events,
    wait_until,
)

import printpress
import printpress.engine
from printpress import editing
from printpress.serve.edits import router

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
SPAN = (25, 40)  # "t through yonde"


@pytest.fixture(scope="module")
def pipe():
    return printpress.load()


@pytest.fixture(scope="module")
def server(pipe):
    with running_server(pipe, extra_routers=[router()]) as s:
        yield s


def edit(server, body: dict, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/v1/edits", json=body, headers=headers, timeout=60, **kwargs)


def assert_outside_kept(original: str, start: int, end: int, answer: dict) -> None:
    assert answer["text"][: answer["start"]] == original[:start]
    assert answer["text"][answer["end"]:] == original[end:]
    assert answer["text"][answer["start"]: answer["end"]] == answer["middle"]


# ------------------------------------------------------------------------------------------------
# Results equal the library's
# ------------------------------------------------------------------------------------------------


def test_rewrite_equals_the_library_and_keeps_the_rest(server, pipe):
    answer = edit(server, {"model": MODEL, "text": TEXT, "span": list(SPAN), "seed": 5, "steps": STEPS})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    want = editing.rewrite(pipe, TEXT, *SPAN, seed=5, max_denoising_steps=STEPS)
    assert got["object"] == "printpress.edit" and got["model"] == MODEL and got["id"].startswith("edit-")
    assert (got["text"], got["middle"], got["middle_ids"]) == (want.text, want.middle, want.middle_ids)
    assert (got["start"], got["end"], got["seed"]) == (SPAN[0], SPAN[0] + len(want.middle), 5)
    assert got["middle"] != TEXT[SPAN[0]:SPAN[1]]
    assert_outside_kept(TEXT, *SPAN, got)
    stats = got["stats"]
    assert stats["length"] == len(editing._tokenize(pipe, TEXT[SPAN[0]:SPAN[1]])) == want.stats.length
    for name in ("prefix_tokens", "suffix_tokens", "clamped_tokens", "candidates", "forward_passes", "scoring_passes"):
        assert stats[name] == getattr(want.stats, name), name
    assert 1 <= stats["forward_passes"] <= STEPS
    assert stats["tokens_per_second"] == pytest.approx(stats["length"] / stats["wall_time_s"])
    assert got["candidates"] == []


def test_temperature_scales_the_edit_schedule_as_in_the_library(server, pipe):
    got = edit(server, {"text": TEXT, "span": list(SPAN), "seed": 3, "steps": STEPS, "temperature": 0.5}).json()
    want = editing.rewrite(pipe, TEXT, *SPAN, seed=3, max_denoising_steps=STEPS, temperature=0.5)
    assert got["middle_ids"] == want.middle_ids and got["text"] == want.text and got["seed"] == 3


def test_rewrite_with_a_length_and_infill_with_a_search(server, pipe):
    got = edit(server, {"text": TEXT, "span": list(SPAN), "seed": 9, "steps": STEPS, "length": 7}).json()
    want = editing.rewrite(pipe, TEXT, *SPAN, seed=9, max_denoising_steps=STEPS, length=7)
    assert got["middle_ids"] == want.middle_ids and len(got["middle_ids"]) == 7 and got["text"] == want.text

    prefix, suffix = "ROMEO:\nBut soft, what light", " breaks?\n"
    got = edit(server, {"prefix": prefix, "suffix": suffix, "seed": 2, "steps": STEPS}).json()
    want = editing.infill(pipe, prefix, suffix, seed=2, max_denoising_steps=STEPS)
    assert got["text"] == want.text == prefix + want.middle + suffix and got["middle_ids"] == want.middle_ids
    assert got["seed"] == want.seed == 2 and got["stats"]["candidates"] == len(editing.default_lengths(32)) == 5
    assert [c["seed"] for c in got["candidates"]] == [2, 3, 4, 5, 6]
    assert [c["length"] for c in got["candidates"]] == [4, 8, 12, 16, 24]
    assert [c["score"] for c in got["candidates"]] == pytest.approx([c.score for c in want.candidates])
    best = min(got["candidates"], key=lambda c: c["score"])
    assert best["middle_ids"] == got["middle_ids"]
    # Only a suffix, or only a prefix.
    got = edit(server, {"suffix": " breaks?\n", "length": 5, "seed": 1, "steps": STEPS}).json()
    assert got["text"].endswith(" breaks?\n") and got["start"] == 0
    assert got["middle_ids"] == editing.infill(pipe, "", " breaks?\n", length=5, seed=1,
                                               max_denoising_steps=STEPS).middle_ids


def test_offsets_are_code_points(server, pipe):
    text = "🌹 ROMEO: ünd 𝔰oft, what light through yonder window breaks?"
    start, end = text.index("what"), text.index(" window")
    got = edit(server, {"text": text, "span": [start, end], "seed": 4, "steps": STEPS}).json()
    want = editing.rewrite(pipe, text, start, end, seed=4, max_denoising_steps=STEPS)
    assert got["text"] == want.text
    assert_outside_kept(text, start, end, got)


def test_streamed_edit_with_the_span_step_stream(server, pipe):
    prefix, suffix = "ROMEO:\nBut soft, what light", " breaks?\n"
    body = {"prefix": prefix, "suffix": suffix, "length": [4, 9], "seed": 6, "steps": STEPS, "stream": True,
            "stream_steps": True}
    with httpx.stream("POST", server.url + "/v1/edits", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == ("message", "[DONE]")
    steps = [json.loads(d) for n, d in events if n == "printpress.step"]
    commits = [json.loads(d) for n, d in events if n == "printpress.commit"]
    final = json.loads(events[-2][1])
    steps_seen: list[editing.SpanStepEvent] = []
    want = editing.infill(pipe, prefix, suffix, length=[4, 9], seed=6, max_denoising_steps=STEPS,
                          on_event=lambda e: steps_seen.append(e) if isinstance(e, editing.SpanStepEvent) else None)
    assert final["object"] == "printpress.edit" and final["text"] == want.text
    assert final["middle_ids"] == want.middle_ids
    # One step event per decoder pass of each candidate, the span's positions only, as the library's events.
    assert len(steps) == final["stats"]["forward_passes"] == len(steps_seen)
    for step, seen in zip(steps, steps_seen):
        span = [4, 9][step["canvas"]]
        assert step["span"] == seen.span == span and step["max_steps"] == STEPS
        assert step["clamped"] == len(seen.tokens) - span
        assert step["argmax"] == seen.argmax[:span] and step["tokens"] == seen.tokens[:span]
        assert step["accepted"] == seen.accepted[:span]
        assert step["argmax_text"] == [pipe.tokenizer.decode([t], skip_special_tokens=False) for t in step["argmax"]]
    assert {s["canvas"] for s in steps} == {0, 1}
    assert len(commits) == 1 and commits[0]["token_ids"] == want.middle_ids and commits[0]["text"] == want.middle
    names = [n for n, _ in events]
    assert names.index("printpress.commit") == len(steps)  # after every step, before the result


def test_streamed_edit_without_steps_sends_only_the_result(server, pipe):
    body = {"text": TEXT, "span": list(SPAN), "seed": 5, "steps": STEPS, "stream": True}
    with httpx.stream("POST", server.url + "/v1/edits", json=body, headers=AUTH, timeout=60) as response:
        events = sse_events(response)
    assert [n for n, _ in events] == ["message", "message"] and events[1][1] == "[DONE]"
    assert json.loads(events[0][1])["text"] == editing.rewrite(pipe, TEXT, *SPAN, seed=5,
                                                               max_denoising_steps=STEPS).text


def test_the_serve_command_mounts_the_edits_route(monkeypatch):
    import uvicorn

    from printpress.serve import command

    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: apps.append(server.config.app))
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args(["--port", "0"])) == 0
    paths = apps[0].openapi()["paths"]
    assert "post" in paths["/v1/edits"] and "/v1/completions" in paths
    assert paths["/v1/edits"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/EditRequest")


# ------------------------------------------------------------------------------------------------
# Bad input: a 4xx JSON error naming the problem, never a 500
# ------------------------------------------------------------------------------------------------

BAD_EDITS = [
    # (body, status, words in the message, param)
    (b'{"prefix": "x", ', 400, "not valid JSON", None),
    (b'{"prefix": "\\ud800"}', 400, "lone surrogate", "prefix"),
    ({"text": "abc", "span": [2, 1]}, 400, "the span start 2 is after its end 1", "span"),
    ({"text": "abc", "span": [0, 9]}, 400, "the span end 9 is beyond the text's 3 characters", "span"),
    ({"text": "abc", "span": [-1, 2]}, 400, "the span start -1 is negative", "span"),
    ({"text": "abc", "span": [1]}, 400, "at least 2 items", "span"),
    ({"text": "abc", "span": ["a", 2]}, 400, "valid integer", "span.0"),
    ({"text": "abc", "span": [1, 1]}, 400, "the span is empty", None),
    ({"text": "abc"}, 400, "'span' is missing", "span"),
    ({"span": [0, 1]}, 400, "'text' is missing", "text"),
    ({"text": "abc", "span": [0, 1], "prefix": "x"}, 400, "not both", "prefix"),
    ({}, 400, "nothing to edit", None),
    ({"prefix": 5}, 400, "valid string", "prefix"),
    ({"prefix": "x", "length": 33}, 400, "length 33 exceeds the canvas of 32 tokens", "length"),
    ({"prefix": "x", "length": 0}, 400, "positive", "length"),
    ({"prefix": "x", "length": []}, 400, "empty list", "length"),
    ({"prefix": "x", "length": [4] * 9}, 400, "at most 8", "length"),
    ({"text": "ab cd", "span": [0, 5], "length": 40}, 400, "exceeds the canvas", "length"),
    ({"prefix": "x", "foo": 1}, 400, "unknown field 'foo'", "foo"),
    ({"prefix": "x", "mode": "ar"}, 400, "unknown field 'mode'", "mode"),
    ({"prefix": "x", "top_k": 5}, 400, "unknown field 'top_k'", "top_k"),
    ({"prefix": "x", "temperature": -1}, 400, "greater than or equal to 0", "temperature"),
    ({"prefix": "x", "steps": 9}, 400, "at most 8 denoising steps", "steps"),
    ({"prefix": "x", "t_min": 0.9, "t_max": 0.5}, 400, "t_min (0.9) must not exceed t_max", None),
    ({"prefix": "x", "seed": -1}, 400, "seed", "seed"),
    ({"prefix": "x", "stream_steps": True}, 400, "stream_steps needs stream=true", "stream_steps"),
    ({"prefix": "word " * 200}, 400, "at most 64", "prefix"),
    ({"text": "word " * 100 + "x", "span": [500, 501]}, 400, "at most 64", "text"),
    ({"prefix": "x", "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
]


@pytest.mark.parametrize("body, status, words, param", BAD_EDITS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else list(b)}"[:50] for i, (b, *_) in
                              enumerate(BAD_EDITS)])
def test_bad_edits_are_a_clear_4xx(server, body, status, words, param):
    if isinstance(body, bytes):
        response = httpx.post(server.url + "/v1/edits", content=body,
                              headers={**AUTH, "Content-Type": "application/json"})
    else:
        response = edit(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["param"] == param
    assert "Traceback" not in response.text
    assert server_load(server) == (0, 0)  # nothing was queued


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_edits_need_the_key(server, headers):
    response = edit(server, {"text": TEXT, "span": list(SPAN)}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error" and KEY not in response.text


# ------------------------------------------------------------------------------------------------
# Slots: a full server answers 429; a cancelled or abandoned edit frees its row at once
# ------------------------------------------------------------------------------------------------

# Eight candidate lengths, 1024 passes each (the stability stop never fires): ~8,000 passes, minutes alone.
LONG_EDIT = {"prefix": "ROMEO:", "suffix": " breaks?", "length": [4, 8, 12, 16, 20, 24, 28, 32], "steps": 1024,
             "stability_threshold": 4096, "seed": 0}


@pytest.fixture(scope="module")
def one_slot_server(pipe):
    with running_server(pipe, extra_routers=[router()], max_rows=1, max_queued=1, max_steps=1024) as s:
        yield s


def short_edit(server) -> httpx.Response:
    return edit(server, {"text": TEXT, "span": list(SPAN), "seed": 0, "steps": 2})


def test_a_full_server_answers_429_and_cancelled_edit_streams_free_their_rows(one_slot_server):
    server = one_slot_server
    long_stream = {"method": "POST", "url": server.url + "/v1/edits", "headers": AUTH, "timeout": 60,
                   "json": dict(LONG_EDIT, stream=True, stream_steps=True)}
    with httpx.stream(**long_stream) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the connection
        assert any(line.startswith("event: printpress.step") for line in lines)
        with httpx.stream(**long_stream) as waiting:
            assert waiting.status_code == 200
            assert wait_until(lambda: server_load(server) == (1, 1)), server_load(server)
            busy = short_edit(server)
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["code"] == "queue_full"
        started = time.monotonic()
    assert wait_until(lambda: server_load(server) == (0, 0), timeout_s=5), server_load(server)
    assert short_edit(server).status_code == 200
    assert time.monotonic() - started < 5


def test_an_abandoned_plain_edit_frees_its_row(one_slot_server):
    server = one_slot_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/edits", headers=AUTH, json=LONG_EDIT, timeout=1.0)
    assert wait_until(lambda: server_load(server) == (0, 0), timeout_s=5), server_load(server)
    assert short_edit(server).status_code == 200


def test_an_edit_over_the_time_limit_is_a_408(pipe):
    with running_server(pipe, extra_routers=[router()], timeout_s=0.5, max_steps=1024) as server:
        response = edit(server, LONG_EDIT)
        assert response.status_code == 408, response.text
        assert response.json()["error"]["code"] == "request_timeout"
        assert wait_until(lambda: server_load(server) == (0, 0), timeout_s=5), server_load(server)


@pytest.mark.slow  # many edits and completions at once
def test_edits_and_completions_at_once_each_get_what_they_get_alone(server, pipe):
    """An edit advances between the shared steps of the completions; neither changes the other's output."""
    from concurrent.futures import ThreadPoolExecutor

    prefix, suffix = "ROMEO:\nBut soft, what light", " breaks?\n"
    with ThreadPoolExecutor(4) as pool:
        edits = [pool.submit(edit, server, {"prefix": prefix, "suffix": suffix, "seed": s, "steps": STEPS})
                 for s in (1, 2)]
        completions = [pool.submit(httpx.post, server.url + "/v1/completions", headers=AUTH, timeout=60,
                                   json={"prompt": "JULIET:", "max_tokens": 64, "seed": s, "steps": STEPS})
                       for s in (1, 2)]
        edits = [f.result().json() for f in edits]
        completions = [f.result().json() for f in completions]
    for s, got in zip((1, 2), edits):
        assert got["text"] == editing.infill(pipe, prefix, suffix, seed=s, max_denoising_steps=STEPS).text
    for s, got in zip((1, 2), completions):
        want = pipe.generate("JULIET:", seed=s, max_new_tokens=64, max_denoising_steps=STEPS)
        assert got["choices"][0]["text"] == want.text


# ------------------------------------------------------------------------------------------------
# schemathesis over the edit operation: generated bodies, valid and not, none may get a 5xx
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # fuzzes the API
def test_schemathesis_finds_no_server_error_in_edits(pipe):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    defaults = dataclasses.replace(pipe.generation_config, max_denoising_steps=2)
    cheap = printpress.engine.Pipeline(pipe.model, pipe.config, defaults, pipe.tokenizer)
    seen: set[int] = set()
    with running_server(cheap, extra_routers=[router()], max_rows=4, max_queued=64) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]
        operation = next(op for op in operations if op.label == "POST /v1/edits")

        @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=server.url, headers=AUTH, timeout=60)
            seen.add(response.status_code)
            assert response.status_code < 500, f"{case.body!r} -> {response.text}"
            if response.status_code >= 400:
                assert response.json()["error"]["message"]

        check()
        # A valid rewrite of the generated kind, so that the 200 path is covered whatever was generated (which
        # bodies come out depends on the schema: a new field changes the draw).
        assert edit(server, {"text": "abc", "span": [0, 1], "steps": 2, "window_lead": 1.5}).status_code == 200
    assert 400 in seen, seen  # the fuzzer reached the validation


# ------------------------------------------------------------------------------------------------
# The page: select a span, press Rewrite, watch it denoise in place, see the new text spliced in
# ------------------------------------------------------------------------------------------------

SELECT = """([start, end]) => {
    // Select UTF-16 offsets [start, end) of #committed's text, as a mouse would.
    const root = document.getElementById('committed');
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    let seen = 0;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const n = node.textContent.length;
        if (start >= seen && start <= seen + n) range.setStart(node, start - seen);
        if (end >= seen && end <= seen + n) { range.setEnd(node, end - seen); break; }
        seen += n;
    }
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    return selection.toString();
}"""


@pytest.mark.browser
@needs_chromium
def test_page_rewrites_a_selected_span_in_place(server, browser):
    page, errors = open_page(browser, server)
    page.click("#generate")
    page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=60_000)
    original = page.eval_on_selector("#committed", "el => el.textContent")
    assert original.startswith("ROMEO:") and len(original) > 40

    page.fill("input[name=delay]", "40")  # slow the drawing so that the span can be seen denoising
    start, end = 3, 30  # across the prompt's element and the generated text; ASCII, so code points = UTF-16
    assert page.evaluate(SELECT, [start, end]) == original[start:end]
    page.click("#rewrite")
    assert page.inner_text("#status") == "rewriting"
    page.wait_for_function("Number(document.getElementById('steps-received').textContent) >= 2")
    live = page.eval_on_selector_all("#edit-span .tok", "cells => cells.map(c => c.className)")
    assert live and all(c in ("tok settled", "tok renoised") for c in live)
    # While the span denoises, the text around it stays put.
    around = page.evaluate("""() => { const nodes = document.getElementById('committed').childNodes;
                                      return [nodes[0].textContent, nodes[2].textContent]; }""")
    assert around == [original[:start], original[end:]]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-page-rewriting.png"), full_page=True)
    page.wait_for_function("document.getElementById('status').textContent === 'rewritten'", timeout=60_000)

    final = page.eval_on_selector("#committed", "el => el.textContent")
    api = edit(server, {"text": original, "span": [start, end], "seed": 21, "steps": 8}).json()
    assert final == api["text"]
    assert final[:start] == original[:start] and final[api["end"]:] == original[end:]
    assert page.inner_text("#committed .edited") == api["middle"]
    stats = api["stats"]
    assert int(page.inner_text("#steps-received")) == stats["forward_passes"]
    assert page.inner_text("[data-stat='decoder passes']") == str(stats["forward_passes"])
    assert page.inner_text("[data-stat='span tokens']") == str(stats["length"])
    assert page.inner_text("[data-stat='seed']") == "21"
    assert page.eval_on_selector_all("#edit-span", "spans => spans.length") == 0
    assert errors == []
    page.screenshot(path=str(ARTIFACTS / "web-page-rewritten.png"), full_page=True)
    page.close()


@pytest.mark.browser
@needs_chromium
def test_page_rewrites_typed_text_with_characters_outside_the_bmp(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("input[name=api_key]", KEY)
    page.fill("input[name=steps]", "4")
    page.fill("input[name=seed]", "3")
    page.click("#rewrite")  # nothing selected: the page says what to do
    page.wait_for_function("document.getElementById('status').textContent === 'error'")
    assert "select part of the text" in page.inner_text("#error")

    typed = "🌹🌹 JULIET: O Romeo, Romeo, wherefore art thou Romeo?"
    page.fill("#prompt", typed)
    start, end = typed.index("Romeo, wherefore"), typed.index(" art thou")  # code points
    utf16 = [start + 2, end + 2]  # each rose is two UTF-16 units in the browser
    page.evaluate("([s, e]) => { const box = document.getElementById('prompt'); box.focus(); "
                  "box.setSelectionRange(s, e); return box.value.slice(s, e); }", utf16)
    page.click("#rewrite")
    page.wait_for_function("document.getElementById('status').textContent === 'rewritten'", timeout=60_000)
    api = edit(server, {"text": typed, "span": [start, end], "seed": 3, "steps": 4}).json()
    final = page.eval_on_selector("#committed", "el => el.textContent")
    assert final == api["text"]
    assert final.startswith(typed[:start]) and final.endswith(typed[end:])

    # Stop: the edit is cancelled and the text is put back as it was before the rewrite.
    page.fill("input[name=delay]", "300")
    page.evaluate("([s, e]) => { const box = document.getElementById('prompt'); box.focus(); "
                  "box.setSelectionRange(s, e); }", utf16)
    page.click("#rewrite")
    page.wait_for_selector("#edit-span .tok", state="attached")
    page.click("#stop")
    page.wait_for_function("document.getElementById('status').textContent === 'stopped'")
    assert page.eval_on_selector("#committed", "el => el.textContent") == typed
    assert page.is_enabled("#rewrite") and page.is_enabled("#generate")
    page.close()
