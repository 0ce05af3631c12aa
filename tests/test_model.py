"""The NNX transformer, its checkpoints and the embedded Shakespeare model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsample as js
from jaxsample import serve_loop
from jaxsample.models import (KVCache, Transformer, TransformerConfig,
                              load_draft, load_embedded, load_model,
                              save_model)

TINY = TransformerConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_dim=48, max_len=32)


def test_cached_chunks_match_the_full_causal_forward():
  model = Transformer(TINY, rngs=nnx.Rngs(0))
  forward = nnx.jit(lambda m, t, p, c: m(t, p, c))
  tokens = jax.random.randint(jax.random.key(0), (3, 12), 0, TINY.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(12), (3, 12))
  full, _ = forward(model, tokens, positions, None)
  cache = model.init_cache(3, TINY.max_len)
  first, cache = forward(model, tokens[:, :7], positions[:, :7], cache)
  pieces = [first]
  for i in range(7, 12):
    logits, cache = forward(model, tokens[:, i:i + 1], positions[:, i:i + 1],
                            cache)
    pieces.append(logits)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full,
                             rtol=1e-5, atol=1e-5)
  assert isinstance(cache, KVCache) and cache.length == TINY.max_len


def test_save_and_load_round_trip(tmp_path):
  model = Transformer(TINY, rngs=nnx.Rngs(3))
  save_model(model, tmp_path)
  loaded = load_model(tmp_path)
  tokens = jnp.arange(10)[None] % TINY.vocab_size
  positions = jnp.arange(10)[None]
  np.testing.assert_array_equal(model(tokens, positions)[0],
                                loaded(tokens, positions)[0])
  with pytest.raises(ValueError, match="float32 or float16"):
    save_model(model, tmp_path / "bf16", dtype="bfloat16")


def test_embedded_model_speaks_shakespeare(embedded):
  model, tokenizer = embedded
  assert tokenizer.get_vocab_size() >= 2048
  assert model.config.vocab_size == tokenizer.get_vocab_size()
  text = ("HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis "
          "nobler in the mind to suffer\n")
  ids = jnp.asarray(tokenizer.encode(text).ids)[None]
  logits, _ = model(ids[:, :-1], jnp.arange(ids.shape[1] - 1)[None])
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None],
                             axis=-1).mean()
  # Uniform: log(2048) = 7.6; the unigram baseline: 6.1 (docs/model.md).
  assert float(nll) < 5.0, float(nll)
  prompt = tokenizer.encode("ROMEO.\n").ids
  out = serve_loop.generate(model, [prompt], params=js.SamplingParams.make(
      1, temperature=0.0), keys=jax.random.split(jax.random.key(0), 1),
      max_new_tokens=12)
  choice = out.to_openai(tokenizer)[0]
  assert len(choice["token_ids"]) == 12 and choice["text"].strip()


def test_packaged_draft_model_predicts_the_target():
  """The draft model shares the target's ids and, on held-out text (Julius
  Caesar is held out of training), picks the target's greedy next token at
  a rate far above chance: what makes it useful for speculative decoding."""
  target, tokenizer = load_embedded()
  draft = load_draft()
  assert draft.config.vocab_size == target.config.vocab_size
  assert draft.config.num_layers < target.config.num_layers
  text = ("BRUTUS.\nFriends, Romans, countrymen, lend me your ears;\nI come to "
          "bury Caesar, not to praise him.\nThe evil that men do lives after "
          "them,\nThe good is oft interred with their bones.\n")
  ids = jnp.asarray(tokenizer.encode(text).ids)[None]
  positions = jnp.arange(ids.shape[1])[None]
  agree = jnp.mean(jnp.argmax(target(ids, positions)[0], -1) ==
                   jnp.argmax(draft(ids, positions)[0], -1))
  assert float(agree) > 0.3, float(agree)  # chance: about 1 / 2048
