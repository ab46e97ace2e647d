"""Text around generation: a checkpoint's tokenizer, its chat template, and
incremental decoding of a token stream.

- `Tokenizer`: ``tokenizer.json`` through the `tokenizers` library, or
  UTF-8 bytes as token ids where the checkpoint has none.
- `ChatTemplate`: the checkpoint's Jinja chat template (``chat_template.jinja``
  or ``tokenizer_config.json``'s ``chat_template``), rendered in Jinja's
  sandbox as transformers' ``apply_chat_template`` does.
- `TextStream`: new token ids in, newly printable text out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

__all__ = ["TextError", "Tokenizer", "ChatTemplate", "TextStream"]


class TextError(ValueError):
    """Text that is not valid UTF-8, or a tokenizer or chat template file that cannot be used."""


def _utf8(text: str, what: str) -> str:
    """`text` if it encodes to UTF-8; else TextError naming the first bad byte.

    Command-line arguments that are not UTF-8 reach Python as lone surrogates
    (PEP 383: byte 0xNN becomes U+DCNN), which UTF-8 cannot encode.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise TextError(f"{what} is not valid UTF-8 text: {byte} at character {e.start}") from None


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` if the folder has one, else UTF-8 bytes as ids.

    Args:
      checkpoint: the checkpoint folder.

    Raises:
      TextError: a tokenizer.json that the `tokenizers` library cannot read.
    """

    def __init__(self, checkpoint: str | os.PathLike):
        self.path = os.path.join(os.fspath(checkpoint), "tokenizer.json")
        self.hf = None
        if os.path.exists(self.path):
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self.hf = HFTokenizer.from_file(self.path)
            except Exception as e:  # the library raises a bare Exception for a malformed file
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise TextError(f"{self.path}: not a tokenizer the `tokenizers` library can read ({first})") from None

    @property
    def kind(self) -> str:
        """"tokenizer.json" or "utf-8 bytes"."""
        return "tokenizer.json" if self.hf else "utf-8 bytes"

    def encode(self, text: str, *, what: str = "the prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Args:
          text: the text (a str).
          what: how errors name the text (e.g. "--prompt").
          add_special_tokens: the tokenizer's post-processor adds its special
            tokens (a chat template's text already holds them: False).

        Raises:
          TextError: empty text, text that is not valid UTF-8, or text that gives no token.
        """
        if not text:
            raise TextError(f"{what} is empty")
        text = _utf8(text, what)
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids if self.hf else list(text.encode())
        if not ids:
            raise TextError(f"{what} gives no tokens")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens skipped; invalid UTF-8 bytes become U+FFFD)."""
        if self.hf:
            return self.hf.decode(list(ids))
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _read_json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TextError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise TextError(f"{path}: expected a JSON object; found {type(d).__name__}")
    return d


def _token_text(value) -> str:
    """A special token of tokenizer_config.json: a string or an AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A checkpoint's chat template.

    The template comes from ``chat_template.jinja`` if the folder has one,
    else from ``tokenizer_config.json``'s ``chat_template`` (a string, or a
    list of {"name", "template"} of which "default" is used). It renders in
    Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``,
    the ``loopcontrols`` extension, a ``tojson`` filter that writes plain
    JSON, and the ``raise_exception`` function, as transformers'
    ``apply_chat_template``; ``bos_token`` and ``eos_token`` come from
    tokenizer_config.json.

    Args:
      checkpoint: the checkpoint folder.

    Raises:
      TextError: no template in the folder, a malformed tokenizer_config.json,
        or a template with a syntax error.
    """

    def __init__(self, checkpoint: str | os.PathLike):
        checkpoint = os.fspath(checkpoint)
        config_path = os.path.join(checkpoint, "tokenizer_config.json")
        jinja_path = os.path.join(checkpoint, "chat_template.jinja")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                source, self.path = f.read(), jinja_path
        else:
            source, self.path = config.get("chat_template"), config_path
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
            if not isinstance(source, str) or not source:
                found = "has no" if os.path.isfile(config_path) else "has no tokenizer_config.json with a"
                raise TextError(f"{checkpoint} {found} chat template (tokenizer_config.json's 'chat_template' or "
                                f"chat_template.jinja)")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.template = self._compile(source)

    def _compile(self, source: str):
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(source)
        except jinja2.TemplateError as e:
            raise TextError(f"{self.path}: the chat template does not compile ({e})") from None

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """The template's text for `messages` ([{"role": ..., "content": ...}, ...]).

        Args:
          messages: the conversation.
          add_generation_prompt: end with the assistant's turn opening.

        Raises:
          TextError: the template raises (``raise_exception``, a sandbox violation,
            an error in its logic).
        """
        import jinja2

        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise TextError(f"{self.path}: the chat template fails on this conversation ({e})") from None


class TextStream:
    """Incremental decoding: token ids in, the text they add out.

    Text is released once it is stable: a trailing U+FFFD (an incomplete
    UTF-8 sequence, which the next token may complete) is held back until
    more tokens or `finish`.

    Args:
      tokenizer: a `Tokenizer`.
      prefix: ids already shown (the prompt): the new ids are decoded after
        them, so that text which depends on its left context (a tokenizer
        that joins words with spaces) comes out as in the decode of the
        whole sequence; only the text after the prefix's is returned.
    """

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in prefix]
        self.printed = tokenizer.decode(self.ids) if self.ids else ""

    def _release(self, text: str) -> str:
        # A tokenizer may rewrite earlier text as tokens arrive (rare); what was
        # printed stays, and the text continues from its length.
        new = text[len(self.printed):]
        self.printed = text
        return new

    def push(self, ids: Sequence[int]) -> str:
        """Add `ids`; return the text that became printable."""
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        stable = text.rstrip("\ufffd")
        return self._release(stable) if len(stable) > len(self.printed) else ""

    def finish(self) -> str:
        """The text still held back."""
        text = self.tokenizer.decode(self.ids)
        return self._release(text) if len(text) > len(self.printed) else ""
