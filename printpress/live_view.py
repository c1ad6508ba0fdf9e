"""`--show-steps`: the canvas drawn live on a terminal (or one line per step elsewhere), for `printpress generate`
and `printpress edit`."""

from __future__ import annotations

import os
import shutil
import time
from typing import TextIO

from printpress.events import CommitEvent, StepEvent

BOLD, DIM, GREEN, RESET = "\x1b[1m", "\x1b[2m", "\x1b[32m", "\x1b[0m"


class LiveView:
    """Draws each request's committed text followed by its current canvas.

    On a terminal the lines are redrawn in place (accepted positions bright, re-noised ones dim);
    elsewhere every step is written as one plain line, so logs stay readable.
    """

    def __init__(self, pipe, stream: TextIO, requests: int, min_interval_s: float = 0.03) -> None:
        self.pipe = pipe
        self.stream = stream
        self.tty = stream.isatty() and os.environ.get("TERM") != "dumb"
        self.lines = [""] * requests
        self.committed = [""] * requests
        self.drawn = 0
        self.min_interval_s = min_interval_s
        self.last_draw = 0.0

    def update(self, event) -> None:
        if isinstance(event, CommitEvent):
            self.committed[event.request] += event.text if self.pipe.tokenizer else _ids_text(event.token_ids)
            self.lines[event.request] = self._plain_prefix(event.request)
            self._draw(force=True)
        elif isinstance(event, StepEvent):
            if self.tty:
                self.lines[event.request] = self._live_line(event)
                self._draw(force=event.stopped)
            else:
                accepted = sum(event.accepted)
                self.stream.write(
                    f"[{event.request}] canvas {event.canvas} step {event.step}/{event.max_steps} "
                    f"accepted {accepted}/{len(event.accepted)}: {self._token_text(event.argmax)}\n"
                )

    def _plain_prefix(self, request: int) -> str:
        return _one_line(self.committed[request])

    def _live_line(self, event) -> str:
        pieces = []
        for token, accepted in zip(event.tokens, event.accepted):
            text = self._token_text([token])
            pieces.append(f"{BOLD}{GREEN}{text}{RESET}" if accepted else f"{DIM}{text}{RESET}")
        header = f"{DIM}[{event.canvas}:{event.step}/{event.max_steps}]{RESET} "
        return header + self._plain_prefix(event.request) + "".join(pieces)

    def _token_text(self, ids: list[int]) -> str:
        if self.pipe.tokenizer is None:
            return _ids_text(ids)
        return _one_line(self.pipe.tokenizer.decode(ids, skip_special_tokens=False))

    def _draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self.last_draw < self.min_interval_s:
            return
        self.last_draw = now
        width = shutil.get_terminal_size((100, 20)).columns
        out = [f"\x1b[{self.drawn}F" if self.drawn else "", "\x1b[J"]
        for line in self.lines:
            out.append(_fit(line, width - 1) + "\n")
        self.stream.write("".join(out))
        self.stream.flush()
        self.drawn = len(self.lines)

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
        self.stream.flush()


def _ids_text(ids: list[int]) -> str:
    return "".join(f"{t} " for t in ids)


def _one_line(text: str) -> str:
    return text.replace("\r", "").replace("\n", "⏎")


def _fit(line: str, width: int) -> str:
    """The tail of a line that fits `width` visible columns (escape sequences take none)."""
    visible, out, i = 0, [], len(line)
    while i > 0 and visible < width:
        j = i - 1
        if line[j] == "m":  # maybe the end of an escape sequence
            start = line.rfind("\x1b[", 0, j)
            if start != -1 and all(c.isdigit() or c == ";" for c in line[start + 2 : j]):
                out.append(line[start:i])
                i = start
                continue
        out.append(line[j])
        visible += 1
        i = j
    return "".join(reversed(out)) + RESET
