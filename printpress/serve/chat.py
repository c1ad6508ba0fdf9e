"""Chat messages -> one prompt text.

A model whose tokenizer_config.json (or chat_template.jinja) carries a chat template is prompted with it,
rendered the way Hugging Face tokenizers render it: Jinja in a sandbox, with `messages`,
`add_generation_prompt=True` and the tokenizer's special-token strings. The shipped models were trained on
plain text and have none, so they get the plain template below, which reads like a play script:

    <system text>\n\n            (each system/developer message, as is)
    USER: <text>\n\n             (the role in capitals, or the message's `name` when it has one)
    ASSISTANT: <text>\n\n
    ASSISTANT:                   (the generation prompt: the model speaks next)

With a `name` on a message the speaker label is that name (in capitals), so a Shakespeare model can be
prompted with ROMEO / JULIET turns. The stop sequence "\n\nUSER:" (`PLAIN_STOP`) is a sensible `stop` for this
template; `printpress chat` uses it.
"""

from __future__ import annotations

import json
from pathlib import Path

from printpress.errors import PrintpressError
from printpress.serve.protocol import ChatMessage

TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
PLAIN_ASSISTANT = "ASSISTANT"
PLAIN_STOP = "\n\nUSER:"  # where the plain template's next user turn would start


def message_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def plain_prompt(messages: list[ChatMessage]) -> str:
    """The documented plain template (see the module docstring)."""
    parts = []
    for message in messages:
        text = message_text(message)
        if message.role in ("system", "developer"):
            parts.append(f"{text}\n\n")
        else:
            speaker = (message.name or message.role).upper()
            parts.append(f"{speaker}: {text}\n\n")
    parts.append(f"{PLAIN_ASSISTANT}:")
    return "".join(parts)


def read_chat_template(folder: str | Path) -> tuple[str | None, dict[str, str]]:
    """The chat template of a model folder (None when it has none) and its special-token strings."""
    folder = Path(folder)
    if not folder.is_dir():
        return None, {}
    jinja = folder / TEMPLATE_FILES[0]
    config_path = folder / TEMPLATE_FILES[1]
    config = {}
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PrintpressError(f"cannot read {config_path}: {exc}") from None
    specials = {key: value for key, value in config.items()
                if key in ("bos_token", "eos_token", "pad_token") and isinstance(value, str)}
    if jinja.exists():
        return jinja.read_text(encoding="utf-8"), specials
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: take "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return (template if isinstance(template, str) else None), specials


def chat_formatter(folder: str | Path | None) -> ChatFormatter:
    """The formatter for a model folder: its own template, or the plain one (also for None: a hub id)."""
    template, specials = read_chat_template(folder) if folder is not None else (None, {})
    return ChatFormatter(template, specials)


class ChatFormatter:
    """Turns a list of messages into prompt text, with the model's template or the plain one."""

    def __init__(self, template: str | None = None, special_tokens: dict[str, str] | None = None) -> None:
        self.source = template
        self.special_tokens = special_tokens or {}
        self._compiled = _compile(template) if template else None

    @property
    def kind(self) -> str:
        return "model" if self._compiled is not None else "plain"

    @property
    def stops(self) -> list[str]:
        """Stop sequences that end the assistant's turn: the plain template's next user turn; a model's own
        template ends turns with its EOS."""
        return [PLAIN_STOP] if self._compiled is None else []

    def __call__(self, messages: list[ChatMessage]) -> str:
        if self._compiled is None:
            return plain_prompt(messages)
        plain = [{"role": m.role, "content": message_text(m), **({"name": m.name} if m.name else {})}
                 for m in messages]
        try:
            return self._compiled.render(messages=plain, add_generation_prompt=True, **self.special_tokens)
        except Exception as exc:  # noqa: BLE001 - a template may raise on purpose (e.g. "roles must alternate")
            raise PrintpressError(f"the model's chat template rejected the messages: {exc}") from None


def _compile(template: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise PrintpressError("this model has a chat template; rendering it needs jinja2 (pip install jinja2)") from None
    from jinja2 import TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise PrintpressError(f"the model's chat template does not parse: {exc}") from None
