"""Is generated code Python? The code yardstick's syntax figures (issue 11, step 4).

A sample is its prompt followed by the generated text, cut after the last newline, so that a line the token
budget cut short does not count against it. Three figures, pooled over a side's samples:

- `python_parses_share`: the source is a whole module (it compiles: `ast.parse` plus the compiler's own checks,
  such as `return` outside a function): every block, bracket and string that the sample opened is closed again.
- `python_prefix_share`: the source is Python *or the start of it*: nothing in it is a syntax error, though a
  block, bracket or string may still be open (the interactive interpreter's test, `codeop.compile_command`,
  which tells "incomplete" from "invalid"). A budget of 64 tokens usually ends inside a function, so this is
  the figure that says whether the text written so far is code; the first says whether it also came to a stop.
- `python_code_share`: valid so far *and* the completion holds at least `MIN_CODE_LINES` lines of code (lines
  that are neither blank nor comments). A small model's diffusion samples often end in lines of bare `#`, and a
  comment is valid Python: this is the share that counts only samples that wrote code.

Prompts should start at a top-level statement (`top_level_starts`), so that a sample's indentation is its own.
"""

from __future__ import annotations

import ast
import codeop
import re
import warnings
from collections.abc import Sequence


def whole_lines(prompt: str, completion: str) -> str:
    """The prompt and completion, cut after the last newline (all of it when it ends with one)."""
    source = prompt + completion
    return source[: source.rfind("\n") + 1]


def parses(source: str) -> bool:
    """Whether `source` is a complete Python module: it compiles, so what the parser alone lets through (`return`
    outside a function, say) counts against it, as it does in `valid_prefix`."""
    try:
        with warnings.catch_warnings():  # invalid escape sequences and the like warn; they are not errors
            warnings.simplefilter("ignore")
            compile(source, "<sample>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError):  # ValueError: a NUL character
        return False
    return True


def valid_prefix(source: str) -> bool:
    """Whether `source` is Python or the start of it: a syntax error nowhere, open blocks allowed."""
    if parses(source):
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            codeop.compile_command(source, "<sample>", "exec")
    except (SyntaxError, ValueError, OverflowError):
        return False
    return True


MIN_CODE_LINES = 2


def code_lines(text: str) -> int:
    """Lines of `text` that are neither blank nor comments (a docstring's lines count: a simple count)."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


BARE_HASHES = re.compile(r"\s*#+\s*")


def bare_hashes(line: str) -> bool:
    """A line of nothing but `#` characters (and whitespace): filler, though valid Python."""
    return BARE_HASHES.fullmatch(line) is not None


def bare_hash_line_share(texts: Sequence[str]) -> float:
    """The share of the non-blank lines of `texts` that are bare `#` runs (0 where there are none)."""
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    return sum(map(bare_hashes, lines)) / max(1, len(lines))


def python_validity(prompts: Sequence[str], completions: Sequence[str]) -> dict[str, float]:
    """The three shares over paired prompts and completions (see the module docstring)."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need as many prompts as completions, at least one; got {len(prompts)} and {len(completions)}")
    sources = [whole_lines(p, c) for p, c in zip(prompts, completions, strict=True)]
    valid = [valid_prefix(source) for source in sources]
    wrote_code = [ok and code_lines(source[len(prompt):]) >= MIN_CODE_LINES
                  for ok, source, prompt in zip(valid, sources, prompts, strict=True)]
    return {"python_parses_share": sum(map(parses, sources)) / len(sources),
            "python_prefix_share": sum(valid) / len(sources),
            "python_code_share": sum(wrote_code) / len(sources)}


def top_level_starts(text: str) -> list[int] | None:
    """Character offsets of the top-level statements of a Python module (a decorated definition starts at its
    first decorator), or None when `text` does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    line_offsets = [0, *(m.end() for m in re.finditer(r"\r\n|\r|\n", text))]  # as the parser counts lines
    starts = []
    for node in tree.body:
        decorators = getattr(node, "decorator_list", [])
        line = min([node.lineno, *(d.lineno for d in decorators)])
        starts.append(line_offsets[line - 1])
    return starts
