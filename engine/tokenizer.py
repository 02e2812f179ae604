"""A local HF tokenizer directory: tokenizer.json (+ tokenizer_config.json)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.engine.errors import InvalidRequestError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        self._tk = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (xgrammar reads its vocabulary)."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers (its vocabulary string:
        byte-level and byte-fallback spellings are at least as long as their text),
        so text longer than n x this cannot fit in n tokens."""
        return max(map(len, self._tk.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """tools: OpenAI's tool definitions, as HF's `tools` argument passes them."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return self._chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """apply_chat_template for a request's messages: a template that refuses them
        (HF templates call raise_exception, e.g. on roles that do not alternate) or
        fails on them is a 400 naming `messages`."""
        try:
            return self.apply_chat_template(messages, add_generation_prompt, tools)
        except (TemplateError, TypeError) as err:
            reason = getattr(err, "message", None) or str(err) or type(err).__name__
            raise InvalidRequestError("messages", f"the chat template refused them: "
                                      f"{reason}"[:300]) from None

    @functools.cached_property
    def _chat_template(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception  # as HF's renderer has it
        env.filters["tojson"] = _tojson  # HF's: plain JSON, not HTML-escaped Markup
        return env.from_string(self.chat_template)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """HF transformers' `tojson` for chat templates (tools are rendered with it)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise TemplateError(message)


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # older configs store AddedToken dicts
        return token.get("content")
    return token
