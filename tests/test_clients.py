"""A popular framework client from PyPI against a real server (issue 14): LangChain's `langchain_openai.ChatOpenAI`
and its completions model `langchain_openai.OpenAI`, with what they send by default and with the neutral values
of the fields printpress cannot honour in general (`top_p: 1`, penalties 0), plus `n`, streaming and AR
log-probabilities. The official `openai` client is tested in test_server.py.

The server is the one test_server.py runs (helpers.running_server: uvicorn on loopback, the shipped model, 4
denoising steps a canvas), and each answer is compared with what `Pipeline.generate` gives for the same prompt,
seed and settings. LangChain must not reach past loopback: the `offline` fixture clears the environment
variables that would send its requests or traces elsewhere (LangSmith's gateway and tracing, OPENAI_*) and makes
any connection or name lookup other than loopback fail the test (tiktoken's download of an encoding would be
one: these tests never count tokens).
"""

from __future__ import annotations

import os
import socket

import pytest

import printpress

from helpers import KEY, MODEL, STEPS, running_server

CHAT_PROMPT = "USER: Speak.\n\nASSISTANT:"  # what the server's plain chat template makes of one user message


@pytest.fixture(scope="module")
def pipe():
    return printpress.load()


@pytest.fixture(scope="module")
def server(pipe):
    with running_server(pipe) as s:
        yield s


LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture()
def offline(monkeypatch):
    """No environment that points LangChain elsewhere, and no connection or DNS lookup off loopback."""
    for name in list(os.environ):
        if name.startswith(("LANGSMITH_", "LANGCHAIN_", "OPENAI_")):
            monkeypatch.delenv(name)
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            pytest.fail(f"a connection to {address} off loopback")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK and host is not None:
            pytest.fail(f"a name lookup of {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture()
def chat_model(server, offline):
    """ChatOpenAI against the server; keyword arguments override the test's defaults."""
    from langchain_openai import ChatOpenAI

    def make(**settings):
        settings = {"seed": 3, "max_tokens": 32, "extra_body": {"steps": STEPS}, **settings}
        return ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=MODEL, max_retries=0, timeout=60,
                          **settings)

    return make


def expected(pipe, prompt: str, seed: int, max_new_tokens: int = 32, **settings):
    return pipe.generate(prompt, seed=seed, max_new_tokens=max_new_tokens, max_denoising_steps=STEPS, **settings)


def finish_reason(result) -> str:
    return "stop" if result.stats.finish_reason == "eos" else "length"


def test_chat_invoke_equals_the_library(chat_model, pipe):
    message = chat_model().invoke("Speak.")
    want = expected(pipe, CHAT_PROMPT, seed=3)
    assert message.content == want.text and message.content.strip()
    meta = message.response_metadata
    assert meta["finish_reason"] == finish_reason(want) and meta["model_name"] == MODEL
    assert message.usage_metadata["input_tokens"] == len(pipe.encode_text(CHAT_PROMPT))
    assert message.usage_metadata["output_tokens"] == want.stats.new_tokens


def test_chat_stream_adds_up_to_invoke(chat_model, pipe):
    # stream_usage sends stream_options.include_usage (off by default for a base_url of one's own)
    model = chat_model(seed=5, max_tokens=64, stream_usage=True)
    chunks = list(model.stream("Speak."))
    want = expected(pipe, CHAT_PROMPT, seed=5, max_new_tokens=64)
    assert "".join(chunk.content for chunk in chunks) == want.text == model.invoke("Speak.").content
    assert sum(bool(chunk.content) for chunk in chunks) >= 2  # canvas by canvas, not all at the end
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.response_metadata["finish_reason"] == finish_reason(want)
    assert total.usage_metadata["output_tokens"] == want.stats.new_tokens
    assert "".join(chunk.content for chunk in chat_model(seed=5, max_tokens=64).stream("Speak.")) == want.text


def test_chat_n_2_gives_one_generation_per_seed(chat_model, pipe):
    from langchain_core.messages import HumanMessage

    result = chat_model(n=2, seed=10).generate([[HumanMessage("Speak.")]])
    assert [g.text for g in result.generations[0]] == [expected(pipe, CHAT_PROMPT, seed=10 + i).text for i in (0, 1)]
    assert [g.message.content for g in result.generations[0]] == [g.text for g in result.generations[0]]


def test_chat_with_sampling_fields_at_their_neutral_values(chat_model, pipe):
    """temperature 0.7 (in diffusion mode: the schedule scaled by 0.7), top_p 1 and penalties 0, as LangChain
    sends them: accepted, and the text is the library's at temperature 0.7."""
    model = chat_model(seed=7, temperature=0.7, top_p=1, presence_penalty=0, frequency_penalty=0)
    assert model.invoke("Speak.").content == expected(pipe, CHAT_PROMPT, seed=7, temperature=0.7).text
    assert [m.content for m in model.batch(["Speak.", "Speak."])] == [model.invoke("Speak.").content] * 2


def test_chat_logprobs_in_ar_mode(chat_model, pipe):
    """`logprobs=True, top_logprobs=k` with `mode: "ar"` in extra_body: response_metadata["logprobs"] carries
    OpenAI's chat format, the engine's numbers; streamed chunks carry the same entries."""
    model = chat_model(seed=2, max_tokens=16, logprobs=True, top_logprobs=3, extra_body={"mode": "ar"})
    message = model.invoke("Speak.")
    want = pipe.generate(CHAT_PROMPT, mode="ar", seed=2, max_new_tokens=16, logprobs=3)
    content = message.response_metadata["logprobs"]["content"]
    assert message.content == want.text == "".join(entry["token"] for entry in content)
    assert [entry["logprob"] for entry in content] == [w.logprob for w in want.logprobs]
    for entry, engine in zip(content, want.logprobs, strict=True):
        assert [t["logprob"] for t in entry["top_logprobs"]] == [logprob for _, logprob in engine.top]
    streamed = [entry for chunk in model.stream("Speak.")
                for entry in ((chunk.response_metadata.get("logprobs") or {}).get("content") or [])]
    assert streamed == content
    plain = chat_model(seed=2, max_tokens=16, extra_body={"mode": "ar"}).invoke("Speak.")
    assert plain.content == want.text and plain.response_metadata["logprobs"] is None


def test_completions_model_invoke_and_stream(server, offline, pipe):
    """langchain_openai.OpenAI sends temperature 0.7, top_p 1, penalties 0, n 1 and logprobs null on every
    request."""
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=server.url + "/v1", api_key=KEY, model=MODEL, max_retries=0, timeout=60, seed=4,
                 max_tokens=32, extra_body={"steps": STEPS})
    want = expected(pipe, "ROMEO.\n", seed=4, temperature=0.7)
    assert llm.invoke("ROMEO.\n") == want.text and want.text.strip()
    assert "".join(llm.stream("ROMEO.\n")) == want.text
    result = llm.generate(["ROMEO.\n"])
    assert result.generations[0][0].generation_info["finish_reason"] == finish_reason(want)
