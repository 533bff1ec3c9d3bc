"""Chat messages -> one prompt string.

A checkpoint may carry a chat template, as Hugging Face tokenizers do: ``chat_template`` in its
``tokenizer_config.json``, or a ``chat_template.jinja`` file. It is rendered the way transformers renders it
(Jinja2 in a sandbox, with ``messages``, ``add_generation_prompt=True``, ``bos_token``, ``eos_token`` and
``raise_exception``). Without one the server uses kvlm's plain template, which models trained on plain text
(kvlm's own checkpoints) continue naturally:

    System: {system message}

    User: {user message}

    Assistant: {assistant message}

    User: {user message}

    Assistant:

Each message is ``Role: content`` followed by a blank line, and the prompt ends with ``Assistant:`` for the
model to continue. (Roles "developer" and "tool" print as "Developer:" and "Tool:".)
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_TEMPLATE = "plain"


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or rendered."""


def load_chat_template(folder: str | Path | None) -> str | None:
    """The Jinja chat template stored with a checkpoint, or None."""
    if folder is None:
        return None
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{config} is not valid JSON: {e}") from e
        if isinstance(template, list):  # HF's named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template.strip():
            return template
    return None


def render_plain(messages: list[tuple[str, str]]) -> str:
    parts = [f"{role.capitalize()}: {content}\n\n" for role, content in messages]
    return "".join(parts) + "Assistant:"


class ChatFormatter:
    """Renders chat messages with the checkpoint's template, else kvlm's plain template."""

    def __init__(self, template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.source = template
        self._compiled = None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        if template is not None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._compiled = env.from_string(template)
            except TemplateError as e:
                raise ChatTemplateError(f"the chat template does not compile: {e}") from e

    @property
    def name(self) -> str:
        return "checkpoint" if self._compiled is not None else PLAIN_TEMPLATE

    def render(self, messages: list[tuple[str, str]]) -> str:
        """``messages``: (role, text) pairs in order."""
        if self._compiled is None:
            return render_plain(messages)
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=True,
                **self._tokens,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from e


def _raise(message: str):
    raise ChatTemplateError(message)
