"""Chat messages -> prompt text: the checkpoint's own chat template, or a documented fallback.

The template comes from `tokenizer_config.json` (`chat_template`, a Jinja string or a list of named
templates, "default" preferred), rendered in a sandboxed Jinja environment with `messages`,
`add_generation_prompt`, `bos_token` and `eos_token`, as transformers does. Checkpoints without one (the
embedded default model) use FALLBACK_TEMPLATE: each message as "<|role|>\\n{content}\\n", then
"<|assistant|>\\n" when a generation prompt is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FALLBACK_TOOLS = "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"  # before the messages


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return str(value.get("content", ""))
    return str(value or "")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", is_fallback: bool = False) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.is_fallback = is_fallback

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if not source:
            return cls(FALLBACK_TOOLS + FALLBACK_TEMPLATE, bos, eos, is_fallback=True)
        return cls(source, bos, eos)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text (`tools` as transformers' apply_chat_template passes them); raises ValueError when the
        template refuses the conversation."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except _TemplateError as exc:
            raise ValueError(str(exc)) from exc


class _TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateError(message)
