"""Text in, text out for Hugging Face folders (``jaxsample.models.text``,
``python -m jaxsample.generate``): a tiny byte-level BPE tokenizer trained
in the test, ``generation_config.json`` defaults, the chat template,
streamed deltas that never split a UTF-8 character, stop strings."""

import importlib.util
import json

import numpy as np
import pytest

from jaxsample import generate as generate_cli
from jaxsample.models.text import (GenerationDefaults, TextGenerator,
                                   TextStream, read_chat_template, render_chat)

from helpers.hf_folders import LLAMA, hf_weights, reference_greedy, write_folder

tokenizers = pytest.importorskip("tokenizers")
needs_jinja2 = pytest.mark.skipif(
    importlib.util.find_spec("jinja2") is None,
    reason='the chat template needs jinja2 (pip install "jaxsample[models]")')

VOCAB = 320
CORPUS = ["hello world, the quick brown fox", "café naïve 😀 jumps over",
          "the lazy dog says hello", "stop here and there"] * 4
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer():
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", 0)])
  return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf-text")
  config = dict(LLAMA, vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
  weights = write_folder(path, config, hf_weights(config, seed=3))
  _tokenizer().save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": TEMPLATE, "bos_token": "<s>",
       "eos_token": {"content": "</s>"}}))
  (path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [1, 3], "do_sample": False}))
  return path, config, weights


@pytest.fixture(scope="module")
def generator(folder):
  return TextGenerator(folder[0], max_len=64, slots=2)


def test_stream_never_splits_a_character():
  tok = _tokenizer()
  text = "café 😀 naïve"
  ids = tok.encode(text, add_special_tokens=False).ids
  assert len(ids) > len(text.split())  # multi-byte characters span tokens
  stream = TextStream(tok)
  deltas = [stream.push([i]) for i in ids] + [stream.finish()]
  assert "".join(deltas) == text
  assert all("\ufffd" not in d for d in deltas)
  assert sum(1 for d in deltas if d) < len(ids)  # some pushes held bytes back


def test_stop_strings_are_cut_and_held_back():
  tok = _tokenizer()
  ids = tok.encode("the lazy dog says hello world", add_special_tokens=False).ids
  stream = TextStream(tok, stop=["says hel", "zzz"])
  deltas = [stream.push([i]) for i in ids] + [stream.finish()]
  assert "".join(deltas) == stream.text == "the lazy dog "
  assert stream.stopped and not any("says" in d for d in deltas)
  # A held-back prefix of a stop string that never completes comes out.
  stream = TextStream(tok, stop=["dog barks"])
  out = "".join([stream.push([i]) for i in ids] + [stream.finish()])
  assert out == "the lazy dog says hello world" and not stream.stopped
  with pytest.raises(ValueError, match="stop strings"):
    TextStream(tok, stop=[""])


def test_generation_defaults(tmp_path):
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
       "repetition_penalty": 1.05, "eos_token_id": [151645, 151643]}))
  d = GenerationDefaults.read(tmp_path)
  assert d == GenerationDefaults((151645, 151643), 0.7, 20, 0.8, 1.05)
  assert d.settings(top_k=0, temperature=None) == dict(
      temperature=0.7, top_k=0, top_p=0.8, repetition_penalty=1.05)
  with pytest.raises(TypeError, match="min_q"):
    d.settings(min_q=1)
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"temperature": 0.6, "eos_token_id": 2}))  # no do_sample: greedy
  assert GenerationDefaults.read(tmp_path) == GenerationDefaults((2,), 0.0)
  (tmp_path / "generation_config.json").unlink()
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
  assert GenerationDefaults.read(tmp_path).eos_token_ids == (7,)


@needs_jinja2
def test_chat_template(folder, generator):
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "hello"}]
  assert render_chat(read_chat_template(folder[0]), messages) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello"
      "<|im_end|>\n<|im_start|>assistant\n")
  ids = generator.encode("hello", chat=True)
  assert ids[0] == generator.tokenizer.token_to_id("<|im_start|>")
  assert generator.encode("hello")[0] == 0  # the plain prompt gets <s>
  with pytest.raises(ValueError, match="chat template: no"):
    render_chat("{{ raise_exception('no') }}", messages)


def _expected(folder, generator, prompt, n):
  """The reference's greedy text for ``prompt``, cut after an EOS id."""
  _, config, weights = folder
  ids = reference_greedy(config, weights, generator.encode(prompt), n)
  for i, t in enumerate(ids):
    if t in (1, 3):
      ids = ids[:i + 1]
      break
  return generator.tokenizer.decode(ids)


def test_stream_and_complete_give_the_reference_text(folder, generator):
  prompts = ["hello world", "the lazy"]
  texts = generator.complete(prompts, max_tokens=12)
  assert texts == [_expected(folder, generator, p, 12) for p in prompts]
  deltas = list(generator.stream(prompts[0], max_tokens=12))
  assert "".join(deltas) == texts[0]
  # Sampled: the stream and the batch agree for the same seed.
  sampled = generator.complete(prompts[:1], max_tokens=12, temperature=1.0,
                               top_k=50, top_p=0.9, seed=5)
  assert "".join(generator.stream(prompts[0], max_tokens=12, temperature=1.0,
                                  top_k=50, top_p=0.9, seed=5)) == sampled[0]


def test_stop_string_ends_generation(generator):
  full = generator.complete(["hello world"], max_tokens=12)[0]
  if len(full) < 4:
    pytest.fail(f"the reference text {full!r} is too short to cut")
  stop = full[2:4]
  assert "".join(generator.stream("hello world", max_tokens=12,
                                  stop=[stop])) == full[:full.find(stop)]
  assert generator.complete(["hello world"], max_tokens=12,
                            stop=[stop]) == [full[:full.find(stop)]]


def test_cli_streams_the_completion(folder, generator, capsys):
  expected = generator.complete(["hello world"], max_tokens=12)[0]
  assert generate_cli.main(["--model", str(folder[0]), "--prompt",
                            "hello world", "--max-tokens", "12",
                            "--max-len", "64"]) == 0
  assert capsys.readouterr().out == expected + "\n"


def test_missing_tokenizer_is_named(tmp_path):
  write_folder(tmp_path, LLAMA, hf_weights(LLAMA))
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    TextGenerator(tmp_path)


def test_repetition_penalty_default_applies(folder, generator):
  """A generation_config's repetition_penalty changes the greedy text unless
  the caller passes 1."""
  saved = generator.defaults
  generator.defaults = GenerationDefaults((1, 3), 0.0, repetition_penalty=5.0)
  try:
    plain = generator.complete(["hello world"], max_tokens=12,
                               repetition_penalty=1.0)
    penalized = generator.complete(["hello world"], max_tokens=12)
  finally:
    generator.defaults = saved
  assert plain[0] == _expected(folder, generator, "hello world", 12)
  assert penalized != plain, "a 5x repetition penalty changed nothing"


@needs_jinja2
def test_readme_section_runs_with_a_folder(folder, capsys):
  """README's "Generate with your checkpoint" blocks, pasted with ``path``
  set to a tiny folder."""
  import pathlib
  import re
  readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  section = re.search(r"^## Generate with your checkpoint\n(.*?)^## ", readme,
                      re.S | re.M).group(1)
  code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
  code, count = re.subn(r'^path = ".*?"', f'path = "{folder[0]}"', code,
                        flags=re.M)
  assert count == 1, "the section no longer sets path = \"...\" on one line"
  scope = {}
  exec(compile(code, "README.md:checkpoint", "exec"), scope)
  printed = capsys.readouterr().out
  assert printed.endswith("]\n") and printed.count("[") >= 2  # two lists
  assert np.asarray(scope["out"].tokens).shape[0] == 2
  assert scope["gen"].defaults.eos_token_ids == (1, 3)
