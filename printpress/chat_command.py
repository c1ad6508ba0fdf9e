"""`printpress chat`: a conversation in the terminal, over the chat template the server uses.

    printpress chat                                    # type a line, the model answers; /bye or Ctrl-D ends
    printf 'Who is there?\\nWhat news?\\n' | printpress chat --seed 0     # from a pipe: one answer per line

Every line read is a user message. The conversation so far is rendered with the model's chat template, or the
plain one the server uses for models without one (`USER: ...`, then `ASSISTANT:`; docs/server.md, "Chat
template"), and the answer is written as it is committed, cut at the end of the turn (EOS, the token budget, or
for the plain template the next `USER:` turn, the stop the server documents). When the conversation outgrows the
model's positions, the oldest turns are dropped. On a terminal a `>>> ` prompt is shown; from a pipe only the
answers are written, one per line. With --seed, turn i uses seed + i.
"""

from __future__ import annotations

import argparse
import sys

from printpress.cli_flags import add_sampler_arguments, load_options, sampler_overrides, warm_up
from printpress.errors import PrintpressError

END_WORDS = ("/bye", "/exit", "/quit")


def register_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model in the terminal (stdin, one message a line)",
                              description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "-m", default=None, help="model folder or hub id (default: the shipped model)")
    p.add_argument("--system", default=None, help="a system message put before the conversation")
    p.add_argument("--seed", type=int, default=None, help="random seed of the first answer (default: a fresh one)")
    add_sampler_arguments(p, skip=("eos_token_ids",))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import printpress
    from printpress.pipeline import model_folder
    from printpress.serve.chat import chat_formatter
    from printpress.serve.protocol import ChatMessage

    settings = sampler_overrides(args)
    pipe = printpress.load(args.model, **load_options(args))
    pipe.settings(**settings)  # the checks between settings, before the first line is read
    warm_up(pipe, args)
    chat = chat_formatter(model_folder(args.model))
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        print(f"printpress chat ({chat.kind} template); /bye or Ctrl-D ends", file=sys.stderr)
    history = [ChatMessage(role="system", content=args.system)] if args.system else []
    turn = 0
    while (line := _read_line(interactive)) is not None:
        if line.strip() in END_WORDS:
            break
        if not line.strip():
            continue
        history.append(ChatMessage(role="user", content=line))
        seed = None if args.seed is None else (args.seed + turn) % 2**64
        try:
            answer = answer_turn(pipe, chat, history, settings, seed, sys.stdout)
        except PrintpressError as exc:
            print(f"printpress: error: {exc}", file=sys.stderr)
            history.pop()
            continue
        if not answer:  # a sampled answer can end at once: say so, rather than leave a blank line to puzzle over
            print("printpress: the model wrote nothing this time", file=sys.stderr)
        history.append(ChatMessage(role="assistant", content=answer))
        turn += 1
        if interactive:
            print()
    return 0


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def answer_turn(pipe, chat, history: list, settings: dict, seed: int | None, out) -> str:
    """Generate the assistant's answer to `history`, writing it to `out` as it is committed; return its text.

    The oldest turns (after any system messages) are dropped while the rendered conversation and the token
    budget do not fit the model's positions.
    """
    from printpress.events import CommitEvent
    from printpress.request import new_token_budget
    from printpress.serve.output import ChoiceText

    resolved = pipe.settings(**settings)
    limit = pipe.config.text.max_position_embeddings - new_token_budget(resolved, pipe.canvas_length)
    prompt_ids = pipe.encode_text(chat(history))
    while len(prompt_ids) > limit and _drop_oldest_turn(history):
        prompt_ids = pipe.encode_text(chat(history))
    text = ChoiceText(pipe.decode, resolved.max_new_tokens, resolved.eos_token_ids, chat.stops)
    written = ""
    for event in pipe.stream(prompt_ids, seed=seed, step_events=False, **settings):
        if isinstance(event, CommitEvent):
            written += _write(out, text.add(event.token_ids), started=bool(written))
            if text.done:
                break  # a stop sequence or the budget: the rest of the generation is not needed
    written += _write(out, text.finish(), started=bool(written))
    out.write("\n")
    out.flush()
    return written.strip()


def _write(out, delta: str, started: bool) -> str:
    """Write a piece of the answer, without the blank the template leaves after `ASSISTANT:`."""
    delta = delta if started else delta.lstrip()
    if delta:
        out.write(delta)
        out.flush()
    return delta


def _drop_oldest_turn(history: list) -> bool:
    """Drop the oldest user or assistant message (the system messages stay); False when only the last is left."""
    turns = [i for i, m in enumerate(history) if m.role not in ("system", "developer")]
    if len(turns) <= 1:
        return False
    del history[turns[0]]
    return True
