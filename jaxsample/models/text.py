"""Text in, text out for Hugging Face folders: tokenizer, chat template,
``generation_config.json`` defaults, stop strings and streamed text.

* ``GenerationDefaults.read(path)``: the EOS ids and the sampling settings
  (``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``) of
  ``generation_config.json``, with transformers' meaning of ``do_sample``:
  absent or false is greedy.  Fields absent from the file are off (not
  transformers' implicit ``top_k = 50``).
* ``render_chat(template, messages, ...)``: the ``chat_template`` of
  ``tokenizer_config.json`` (or ``chat_template.jinja``) rendered with
  ``jinja2`` in a sandbox, as transformers' ``apply_chat_template`` does.
* ``TextStream``: token ids in, text deltas out; a delta never ends inside
  a UTF-8 character (the decoder's U+FFFD of an incomplete byte sequence is
  held back) and never holds a stop string (text that may begin one is held
  back until it cannot; the text stops before the first stop string).
* ``TextGenerator(path)``: all of it around ``load_pretrained`` and a
  ``ServeLoop``: ``stream(prompt)`` yields text deltas, ``complete(prompts)``
  returns texts.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator, Sequence

from jaxsample.generation.requests import ProcessorLimits, Request
from jaxsample.generation.serving import ServeLoop
from jaxsample.models.hf import load_pretrained, require

__all__ = ["GenerationDefaults", "TextGenerator", "TextStream",
           "read_chat_template", "render_chat"]


def _json(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  """A checkpoint's default stop ids and sampling settings (module doc)."""

  eos_token_ids: tuple[int, ...] = ()
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  repetition_penalty: float = 1.0

  @classmethod
  def read(cls, path) -> "GenerationDefaults":
    """From ``generation_config.json`` in ``path`` (EOS ids fall back to
    ``config.json``'s ``eos_token_id``); all off and greedy without it."""
    path = pathlib.Path(path)
    fields = _json(path / "generation_config.json")
    eos = _ids(fields.get("eos_token_id")) or _ids(
        _json(path / "config.json").get("eos_token_id"))
    if not fields.get("do_sample", False):
      return cls(eos, repetition_penalty=float(
          fields.get("repetition_penalty", 1.0)))
    return cls(eos, float(fields.get("temperature", 1.0)),
               int(fields.get("top_k") or 0), float(fields.get("top_p", 1.0)),
               float(fields.get("repetition_penalty", 1.0)))

  def settings(self, **overrides) -> dict:
    """The four sampling settings, each from ``overrides`` unless None
    there; unknown names raise ``TypeError``."""
    names = ("temperature", "top_k", "top_p", "repetition_penalty")
    unknown = set(overrides) - set(names)
    if unknown:
      raise TypeError(f"unknown sampling settings {sorted(unknown)}; "
                      f"expected {names}")
    return {n: getattr(self, n) if overrides.get(n) is None else overrides[n]
            for n in names}


def _token_text(value) -> str | None:
  return value.get("content") if isinstance(value, dict) else value


def read_chat_template(path) -> str | None:
  """The chat template of the folder ``path``: ``chat_template.jinja``, else
  ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
  ``{name, template}`` of which ``default`` is taken); None if none."""
  path = pathlib.Path(path)
  if (path / "chat_template.jinja").is_file():
    return (path / "chat_template.jinja").read_text()
  template = _json(path / "tokenizer_config.json").get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default")
  return template


def render_chat(template: str, messages: Sequence[dict], *,
                add_generation_prompt: bool = True, **variables) -> str:
  """``template`` rendered for ``messages`` (``[{"role", "content"}, ...]``)
  as transformers renders it: a sandboxed ``jinja2`` environment with
  ``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter, and
  ``raise_exception``; ``variables`` (e.g. ``bos_token``) are passed on."""
  sandboxed = require("jinja2.sandbox").ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise ValueError(f"chat template: {message}")

  env = sandboxed(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = lambda x, indent=None: json.dumps(
      x, ensure_ascii=False, indent=indent)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(template).render(
      messages=list(messages), add_generation_prompt=add_generation_prompt,
      **variables)


class TextStream:
  """Incremental detokenizer with stop strings (module doc).

  ``push(ids)`` returns the text that the new ids complete; ``finish()``
  the rest.  ``stopped`` turns True once a stop string appeared; ``text``
  is everything returned so far.
  """

  def __init__(self, tokenizer, stop: Sequence[str] = (), *,
               skip_special_tokens: bool = True):
    if any(not isinstance(s, str) or not s for s in stop):
      raise ValueError(f"stop strings must be non-empty strings; got {stop!r}")
    self._decode = lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens)
    self._stop = tuple(stop)
    self._ids: list[int] = []
    self._prefix = self._read = 0  # the ids decoded before / up to `_read`
    self._held = ""
    self.text = ""
    self.stopped = False

  def push(self, ids: Sequence[int]) -> str:
    """Text completed by ``ids`` (held back: an unfinished UTF-8 character,
    a possible start of a stop string; nothing once ``stopped``)."""
    if self.stopped:
      return ""
    self._ids.extend(int(i) for i in ids)
    before = self._decode(self._ids[self._prefix:self._read])
    now = self._decode(self._ids[self._prefix:])
    if len(now) <= len(before) or now.endswith("\ufffd"):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return self._release(self._held + now[len(before):], final=False)

  def finish(self) -> str:
    """The rest of the text (an incomplete character as U+FFFD)."""
    if self.stopped:
      return ""
    before = self._decode(self._ids[self._prefix:self._read])
    rest = self._decode(self._ids[self._prefix:])[len(before):]
    self._prefix = self._read = len(self._ids)
    return self._release(self._held + rest, final=True)

  def _release(self, text: str, final: bool) -> str:
    cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0),
              default=-1)
    if cut >= 0:
      self.stopped, out, self._held = True, text[:cut], ""
    else:
      keep = 0 if final else max(
          (k for s in self._stop for k in range(1, len(s))
           if text.endswith(s[:k])), default=0)
      out, self._held = text[:len(text) - keep], text[len(text) - keep:]
    self.text += out
    return out


class TextGenerator:
  """A Hugging Face folder ready for text generation.

  Attributes: ``model`` (``load_pretrained``), ``tokenizer``
  (``tokenizer.json``), ``defaults`` (``GenerationDefaults``),
  ``chat_template`` (None if the folder has none), ``special`` (the
  ``bos_token`` / ``eos_token`` strings of ``tokenizer_config.json``, passed
  to the template), ``loop`` (the ``ServeLoop`` that generates, built on
  first use with ``slots`` slots).
  """

  def __init__(self, path, *, dtype: str | None = None, mesh=None,
               max_len: int | None = None, slots: int = 8):
    tokenizers = require("tokenizers")
    path = pathlib.Path(path)
    if not (path / "tokenizer.json").is_file():
      raise FileNotFoundError(f"{path / 'tokenizer.json'} is missing: text "
                              "generation needs the folder's tokenizer")
    self.model = load_pretrained(path, dtype=dtype, mesh=mesh, max_len=max_len)
    self.tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    self.defaults = GenerationDefaults.read(path)
    self.chat_template = read_chat_template(path)
    config = _json(path / "tokenizer_config.json")
    self.special = {n: _token_text(config.get(n)) or ""
                    for n in ("bos_token", "eos_token")}
    self.slots = slots
    self._loop = None

  @property
  def loop(self):
    if self._loop is None:
      self._loop = ServeLoop(
          self.model, slots=self.slots,
          max_stop_tokens=max(4, len(self.defaults.eos_token_ids)),
          processors=ProcessorLimits(logit_bias=0, allowed_token_ids=0,
                                     banned_token_ids=0, min_tokens=False))
    return self._loop

  def encode(self, prompt, *, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``: a string (with the tokenizer's special
    tokens, e.g. Llama's BOS), or with ``chat`` a string (one user message)
    or a list of messages rendered with the chat template (its own special
    tokens only)."""
    if not chat:
      return self.tokenizer.encode(prompt).ids
    if self.chat_template is None:
      raise ValueError("chat=True needs a chat template: the folder has no "
                       "chat_template in tokenizer_config.json nor "
                       "chat_template.jinja")
    messages = ([{"role": "user", "content": prompt}]
                if isinstance(prompt, str) else prompt)
    text = render_chat(self.chat_template, messages, **self.special)
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def _request(self, prompt, *, chat, max_tokens, seed, settings):
    return Request(prompt=self.encode(prompt, chat=chat), max_tokens=max_tokens,
                   seed=seed, stop=self.defaults.eos_token_ids,
                   logprobs=False, **self.defaults.settings(**settings))

  def stream(self, prompt, *, chat: bool = False, max_tokens: int = 256,
             stop: Sequence[str] = (), seed: int | None = None, **settings
             ) -> Iterator[str]:
    """Yields text deltas of one completion (``TextStream``).  Generation
    ends at an EOS id, ``max_tokens`` or a ``stop`` string (excluded from
    the text; the request is aborted there).  ``seed``: None draws a fresh
    one (``ServeLoop``).  ``settings``: ``temperature``, ``top_k``, ``top_p``,
    ``repetition_penalty``, each overriding ``defaults`` unless None."""
    loop = self.loop
    request_id = loop.submit(self._request(
        prompt, chat=chat, max_tokens=max_tokens, seed=seed, settings=settings))
    text = TextStream(self.tokenizer, stop)
    for event in loop.events():
      if event.request_id != request_id:
        continue
      delta = text.push(event.token_ids)
      if delta:
        yield delta
      if text.stopped:  # a stop string: the request ends here
        loop.abort(request_id)
        break
    rest = text.finish()
    if rest:
      yield rest

  def complete(self, prompts: Sequence, *, chat: bool = False,
               max_tokens: int = 256, stop: Sequence[str] = (),
               seed: int | None = None, **settings) -> list[str]:
    """The completion text of each prompt (one batch in the loop; request
    ``i`` gets seed ``seed + i``, or a fresh one when ``seed`` is None); as
    ``stream`` otherwise."""
    requests = [self._request(p, chat=chat, max_tokens=max_tokens,
                              seed=None if seed is None else seed + i,
                              settings=settings)
                for i, p in enumerate(prompts)]
    texts = []
    for completion in self.loop.run(requests):
      stream = TextStream(self.tokenizer, stop)
      texts.append(stream.push(completion.token_ids) + stream.finish())
    return texts
