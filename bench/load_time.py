"""How long a fresh process takes to import printpress and load a model: what every CLI command waits before it works.

Each run is a new interpreter (`python -c`), timing `import printpress; printpress.load(MODEL)` (torch's import
included: printpress imports it on first use) and saying whether torch's compiler (torch._dynamo) got imported on the
way. With `--before CHECKOUT` (a worktree of another
commit: `git worktree add /tmp/before <commit>`), the runs alternate between that checkout and this one, both on this
checkout's Python, so a change in the machine's load hits both alike; medians and the ratio before / now. Each side's
kernels are built once, untimed, into a cache of its own (a first load on a machine also builds them: 10-20 s, not
what is measured here).

    OMP_NUM_THREADS=1 .venv/bin/python bench/load_time.py --runs 9 --out docs/results/load_time.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/load_time.py --before /tmp/before --runs 9 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json, sys, time
start = time.perf_counter()
import printpress
printpress.load(sys.argv[1])
print(json.dumps({"load_s": time.perf_counter() - start, "dynamo": "torch._dynamo" in sys.modules}))
"""


def one_run(checkout: Path, model: str, extensions: Path) -> dict:
    """The import-and-load time of one fresh interpreter whose printpress is `checkout`'s, its compiled kernels cached
    in `extensions` (one folder per checkout: torch rebuilds a kernel whose build arguments changed, and they name
    the checkout's folders)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "TORCH_EXTENSIONS_DIR": str(extensions)}
    out = subprocess.run([sys.executable, "-c", PROBE, model], cwd=checkout, env=env, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"loading {model} from {checkout} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    return {"load_s": statistics.median(r["load_s"] for r in runs),
            "dynamo_imported": any(r["dynamo"] for r in runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--before", type=Path, default=None, help="a checkout of another commit to compare with")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.before is not None and not (args.before / "printpress" / "__init__.py").is_file():
        parser.error(f"--before {args.before} is not a printpress checkout")
    sides = {"now": ROOT} if args.before is None else {"before": args.before.resolve(), "now": ROOT}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="load-time-") as scratch:
        extensions = {side: Path(scratch) / side for side in sides}
        for side, checkout in sides.items():  # untimed: builds each side's kernels into its own cache
            one_run(checkout, args.model, extensions[side])
        for _ in range(args.runs):
            for side, checkout in sides.items():
                runs[side].append(one_run(checkout, args.model, extensions[side]))
    result = {"command": "python bench/load_time.py " + " ".join(sys.argv[1:]), "model": args.model,
              **{side: summary(r) for side, r in runs.items()}}
    if args.before is not None:
        result["load_ratio_before_over_now"] = result["before"]["load_s"] / result["now"]["load_s"]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for side in sides:
        s = result[side]
        print(f"{side}: import and load {s['load_s']:.2f} s (median of {args.runs}); "
              f"torch._dynamo imported: {s['dynamo_imported']}")
    if args.before is not None:
        print(f"load before / now: {result['load_ratio_before_over_now']:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
