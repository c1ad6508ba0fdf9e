"""Load test of `printpress serve` on loopback: many requests at a fixed concurrency, streamed and not.

Starts the server as its own process (`python -m printpress serve`), then from this process:
1. alone: each distinct (prompt, seed) once, one at a time -> the single-request latency and tokens/s, and
   the reference text of each;
2. load, not streamed: N requests, `--concurrency` in flight at a time;
3. load, streamed (SSE): the same, also timing the first text chunk.
Requests cycle through the distinct (prompt, seed) pairs, so every answer under load is checked against the
text that pair got alone (the scheduler promises the same tokens whatever shares the batch).

Reports errors, p50/p99 latency and aggregate tokens/s (completion tokens of all requests / wall time of the
phase) against one request alone, as JSON (docs/results/serve_load.json by default). For scale, the engine
without HTTP or scheduler is timed too, in this process while the server idles: the same requests one at a
time and `--concurrency` of them in one `Pipeline.generate` batch, which bounds what batching can gain with
this model on this machine.

    python bench/serve_load.py                       # 200 requests at 16 concurrent, 64 tokens each
    python bench/serve_load.py --requests 50 --concurrency 4 --out /tmp/load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:", "JULIET:", "To be, or not to be", "HAMLET:\nWhat", "Enter KING", "O, what a", "My lord,",
           "First Citizen:", "Now is the winter", "Friends, Romans,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.server_threads))
    command = [sys.executable, "-m", "printpress", "serve", "--port", str(port), "--max-rows", str(args.max_rows),
               "--max-queued", str(max(64, args.concurrency * 2)), "--log-level", "warning"]
    if args.model:
        command += ["--model", args.model]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: {process.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def body(args, i: int, stream: bool) -> dict:
    pair = i % args.distinct
    out = {"prompt": PROMPTS[pair % len(PROMPTS)], "seed": 1000 + pair, "max_tokens": args.max_tokens,
           "stream": stream}
    if args.steps:
        out["steps"] = args.steps
    return out


async def one(client: httpx.AsyncClient, payload: dict) -> dict:
    """One request; returns latency, first-chunk time (streamed), text, completion tokens, or the error."""
    started = time.perf_counter()
    try:
        if not payload["stream"]:
            response = await client.post("/v1/completions", json=payload)
            if response.status_code != 200:
                return {"error": f"{response.status_code} {response.text[:200]}"}
            data = response.json()
            return {"latency_s": time.perf_counter() - started, "text": data["choices"][0]["text"],
                    "tokens": data["usage"]["completion_tokens"]}
        first, pieces, tokens = None, [], None
        request = dict(payload, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=request) as response:
            if response.status_code != 200:
                return {"error": f"{response.status_code} {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    if choice["text"] and first is None:
                        first = time.perf_counter() - started
                    pieces.append(choice["text"])
        return {"latency_s": time.perf_counter() - started, "first_text_s": first, "text": "".join(pieces),
                "tokens": tokens}
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


async def phase(url: str, args, count: int, concurrency: int, stream: bool) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        queue = list(range(count))
        results: list[dict | None] = [None] * count

        async def worker():
            while queue:
                i = queue.pop(0)
                results[i] = await one(client, body(args, i, stream))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(results: list[dict], wall_s: float, reference: dict[int, str], args) -> dict:
    ok = [r for r in results if "error" not in r]
    latencies = [r["latency_s"] for r in ok]
    tokens = sum(r["tokens"] or 0 for r in ok)
    mismatches = sum(1 for i, r in enumerate(results) if "error" not in r and r["text"] != reference[i % args.distinct])
    out = {"requests": len(results), "errors": len(results) - len(ok),
           "error_samples": sorted({r["error"] for r in results if "error" in r})[:5],
           "texts_differing_from_alone": mismatches, "wall_s": round(wall_s, 3), "completion_tokens": tokens,
           "aggregate_tokens_per_s": round(tokens / wall_s, 1) if wall_s else None,
           "latency_p50_s": round(percentile(latencies, 50), 3) if ok else None,
           "latency_p99_s": round(percentile(latencies, 99), 3) if ok else None,
           "latency_mean_s": round(statistics.mean(latencies), 3) if ok else None}
    firsts = [r["first_text_s"] for r in ok if r.get("first_text_s") is not None]
    if firsts:
        out["first_text_p50_s"] = round(percentile(firsts, 50), 3)
        out["first_text_p99_s"] = round(percentile(firsts, 99), 3)
    return out


async def main_async(args) -> dict:
    load_before = os.getloadavg()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server(args, port)
    try:
        wait_ready(url, process)
        # Warm up (first forward passes allocate), then each distinct request alone.
        await phase(url, args, 2, 1, False)
        alone, alone_wall = await phase(url, args, args.distinct, 1, False)
        if any("error" in r for r in alone):
            raise SystemExit(f"a request failed alone: {alone}")
        reference = {i: r["text"] for i, r in enumerate(alone)}
        alone_summary = summary(alone, alone_wall, reference, args)
        plain, plain_wall = await phase(url, args, args.requests, args.concurrency, False)
        streamed, streamed_wall = await phase(url, args, args.requests, args.concurrency, True)
        async with httpx.AsyncClient(base_url=url) as client:
            health = (await client.get("/health")).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    single = alone_summary["aggregate_tokens_per_s"]
    result = {
        "command": "python bench/serve_load.py " + " ".join(sys.argv[1:]),
        "regime": {
            "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs (shared with other work: figures are "
                       "indicative, ratios taken in one run)",
            "server": f"separate process, OMP_NUM_THREADS={args.server_threads}, --max-rows {args.max_rows}",
            "client": "this process, httpx async over loopback",
            "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "model": args.model or "models/shakespeare-joint (default)",
            "request": {"max_tokens": args.max_tokens, "steps": args.steps or "model default",
                        "distinct_prompt_seed_pairs": args.distinct},
        },
        "alone": alone_summary,
        "load_not_streamed": summary(plain, plain_wall, reference, args) | {"concurrency": args.concurrency},
        "load_streamed": summary(streamed, streamed_wall, reference, args) | {"concurrency": args.concurrency},
        "health_after": health,
    }
    result["engine_only"] = engine_baseline(args)
    for key in ("load_not_streamed", "load_streamed"):
        rate = result[key]["aggregate_tokens_per_s"]
        result[key]["tokens_per_s_vs_alone"] = round(rate / single, 2) if rate and single else None
    return result


def engine_baseline(args) -> dict:
    """The engine alone (no HTTP, no scheduler): requests one at a time, then `concurrency` in one batch."""
    import torch

    import printpress

    torch.set_num_threads(args.server_threads)
    pipe = printpress.load(args.model)
    pairs = [body(args, i, False) for i in range(args.distinct)]
    extra = {"max_denoising_steps": args.steps} if args.steps else {}
    pipe.generate(pairs[0]["prompt"], seed=pairs[0]["seed"], max_new_tokens=args.max_tokens, **extra)  # warm up
    started = time.perf_counter()
    alone = [pipe.generate(p["prompt"], seed=p["seed"], max_new_tokens=args.max_tokens, **extra) for p in pairs]
    alone_s = time.perf_counter() - started
    batch = [body(args, i, False) for i in range(args.concurrency)]
    started = time.perf_counter()
    together = pipe.generate([p["prompt"] for p in batch], seed=[p["seed"] for p in batch],
                             max_new_tokens=args.max_tokens, **extra)
    batch_s = time.perf_counter() - started
    alone_rate = sum(r.stats.new_tokens for r in alone) / alone_s
    batch_rate = sum(r.stats.new_tokens for r in together) / batch_s
    return {"threads": args.server_threads, "alone_tokens_per_s": round(alone_rate, 1),
            f"batch_of_{args.concurrency}_tokens_per_s": round(batch_rate, 1),
            "batch_vs_alone": round(batch_rate / alone_rate, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per canvas (default: the model's)")
    parser.add_argument("--distinct", type=int, default=10, help="distinct (prompt, seed) pairs cycled through")
    parser.add_argument("--max-rows", type=int, default=16, help="the server's --max-rows")
    parser.add_argument("--server-threads", type=int, default=1,
                        help="torch threads of the server and of the engine-only baseline (default 1: two-thread "
                             "GEMMs on a busy 2-core machine wait on each other)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "serve_load.json"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
