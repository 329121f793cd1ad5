"""Chat messages to prompt text with the base's own chat template, rendered as transformers renders it.

Owns finding a base's chat template, the sandboxed jinja2 environment it runs
in, and the checks of one row's messages (``--messages-column``, docs/batch.md).
Must not tokenize: ``prepare.Tokenizer`` encodes the text without adding
special tokens, because the template writes them (BOS and the like) itself, as
``apply_chat_template(..., tokenize=True)`` does. Knows nothing of the engine.

* The template: ``chat_template.jinja`` beside ``tokenizer_config.json`` when
  present, else that file's ``chat_template`` (a string, or a list of named
  templates of which ``default`` is used). None: ``E_CHAT_TEMPLATE_MISSING``;
  one that does not compile: ``E_CHAT_TEMPLATE_INVALID`` (both exit 1, at job
  start).
* What the template sees: ``messages``, ``add_generation_prompt=True``,
  ``tools`` and ``documents`` (None), and every named special token of
  ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ... and any other
  ``*_token`` string) as text. Keys of a message whose value is null are
  dropped, as transformers drops them.
* The environment: jinja2's immutable sandbox with ``trim_blocks``,
  ``lstrip_blocks`` and loop controls; ``raise_exception(msg)``,
  ``strftime_now(fmt)``, a ``tojson`` that keeps non-ASCII and HTML
  characters, a ``namespace`` that refuses names starting with ``_``, and a
  ``{% generation %}`` block that renders its body.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlora.batch.errors import CodedError, JobError
from mlora.lora_tools.canonical import digest

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


class ChatMessagesError(CodedError, ValueError):
    """One row's messages cannot be rendered; its row becomes an error row with ``code``.

    Codes: E_PROMPT_MESSAGES (not a non-empty list of messages with a string
    role and content), E_PROMPT_TEMPLATE (the template raised on them)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace()``, refusing attribute names that start with ``_`` (no route to Python internals)."""

    def __init__(self, *args, **kwargs):
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        super().__init__(attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _DictFactory:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictFactory(),
                       namespace=_SafeNamespace)
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: dict, base_dir: str) -> dict[str, str]:
    """The named special tokens transformers hands a template: every ``*_token`` of the config
    (and a dict ``extra_special_tokens``); ``special_tokens_map.json`` overrides them only in
    the legacy layout without ``added_tokens_decoder``."""
    named = dict(config)
    legacy = os.path.join(base_dir, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.isfile(legacy):
        try:
            with open(legacy, encoding="utf-8") as f:
                named.update(json.load(f))
        except (OSError, ValueError) as exc:
            raise JobError("E_CHAT_TEMPLATE_INVALID", f"{legacy} is not readable JSON ({exc}); fix or remove it") from None
    extra = named.get("extra_special_tokens")
    if isinstance(extra, dict):
        named = {**named, **extra}
    tokens = {}
    for key, value in named.items():
        text = _token_text(value) if key.endswith("_token") else None
        if text is not None:
            tokens[key] = text
    return tokens


class ChatTemplate:
    """A base's chat template, compiled once; :meth:`render` turns one row's messages into prompt text."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        self.source, self.special_tokens, self.origin = source, dict(special_tokens), origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise JobError("E_CHAT_TEMPLATE_INVALID", f"the chat template in {origin} does not compile ({exc}); "
                           "fix the template") from None

    @property
    def sha256(self) -> str:
        """Digest of the template and the special tokens it sees (part of the job fingerprint)."""
        return digest({"template": self.source, "special_tokens": self.special_tokens})

    def render(self, messages) -> str:
        """The prompt text of ``messages`` (a list of ``{role, content, ...}``) with the generation prompt.
        Raises :class:`ChatMessagesError`."""
        chat = check_messages(messages)
        try:
            return self._template.render(messages=chat, tools=None, documents=None, add_generation_prompt=True,
                                         **self.special_tokens)
        except Exception as exc:  # a template is code: whatever it raises on this row's data fails this row only
            raise ChatMessagesError("E_PROMPT_TEMPLATE", f"the chat template refused these messages "
                                    f"({type(exc).__name__}: {exc}); fix the row's messages") from None


def check_messages(messages) -> list[dict]:
    """``messages`` as the template receives them: each a dict with a string ``role`` and ``content``,
    keys whose value is null dropped. Raises :class:`ChatMessagesError` (``E_PROMPT_MESSAGES``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        what = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise ChatMessagesError("E_PROMPT_MESSAGES", f"the messages cell is {what}; give a non-empty list of "
                                "{role, content} messages")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatMessagesError("E_PROMPT_MESSAGES", f"message {i} is {type(message).__name__}, not a "
                                    "{role, content} struct")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ChatMessagesError("E_PROMPT_MESSAGES", f"message {i} has no string {key!r}; every message "
                                        "needs a role and a content")
        chat.append({k: v for k, v in message.items() if v is not None})
    return chat


def load_chat_template(base_dir: str) -> ChatTemplate:
    """The chat template of the base in ``base_dir``. Raises JobError (exit 1) when it has none
    (``E_CHAT_TEMPLATE_MISSING``) or it cannot be read or compiled (``E_CHAT_TEMPLATE_INVALID``)."""
    config_path = os.path.join(base_dir, CONFIG_FILE)
    config: dict = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise JobError("E_CHAT_TEMPLATE_INVALID", f"{config_path} is not readable JSON ({exc}); fix it") from None
        if not isinstance(config, dict):
            raise JobError("E_CHAT_TEMPLATE_INVALID", f"{config_path} is not a JSON object; fix it")
    file_path = os.path.join(base_dir, TEMPLATE_FILE)
    if os.path.isfile(file_path):
        with open(file_path, encoding="utf-8") as f:
            return ChatTemplate(f.read(), _special_tokens(config, base_dir), file_path)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name", "template"}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise JobError("E_CHAT_TEMPLATE_MISSING", f"{config_path} names chat templates "
                           f"{sorted(str(n) for n in named)} but none called 'default'; name the one to use 'default'")
        source = named["default"]
    if not isinstance(source, str) or not source:
        raise JobError("E_CHAT_TEMPLATE_MISSING", f"--messages-column needs the base's chat template, but {base_dir} "
                       f"has none (no {TEMPLATE_FILE}, no chat_template in {CONFIG_FILE}); add one, or render the "
                       "prompts yourself and give --prompt-column")
    return ChatTemplate(source, _special_tokens(config, base_dir), config_path)
