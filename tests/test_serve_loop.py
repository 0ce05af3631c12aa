"""decode_step and generate on a tiny random-weight NNX transformer (every
backend) and on the embedded model (GPU-marked cases: the kernels there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsample as js
from jaxsample import demo, serve_loop
from jaxsample._src import reference
from jaxsample.models import Transformer, TransformerConfig

from helpers.parametrize import on_gpu, slow_case
from helpers.programs import CompileCounter
from helpers.toy_lm import Bigram

# Batch-shape independent logits on a GPU (``conftest.full_precision``).
pytestmark = pytest.mark.usefixtures("full_precision")

CONFIG = TransformerConfig(vocab_size=96, d_model=32, num_layers=2,
                           num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=64)
SETTINGS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 0, 0.9, 0.0),
    (1.0, 20, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (1.3, 10, 0.8, 0.02)]


@pytest.fixture(scope="module")
def model():
  # Larger weights than the default init make peaked, varied distributions.
  model = Transformer(CONFIG, rngs=nnx.Rngs(1))
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda w: w * 3.0, state))
  return model


def requests(n, seed=0):
  """``n`` prompts of varied lengths, settings, keys and budgets."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, CONFIG.vocab_size, rng.integers(1, 14)).tolist()
             for _ in range(n)]
  settings = [SETTINGS[i % len(SETTINGS)] for i in range(n)]
  keys = jax.random.key_data(jax.random.split(jax.random.key(seed), n))
  budgets = rng.integers(3, 16, n).tolist()
  return prompts, settings, np.asarray(keys), budgets


def run(model, prompts, settings, keys, budgets, **kw):
  t, k, p, m = zip(*settings)
  params = js.SamplingParams.make(len(prompts), temperature=t, top_k=k,
                                  top_p=p, min_p=m)
  return serve_loop.generate(model, prompts, params=params, keys=keys,
                             max_new_tokens=budgets, **kw)


def workload(request, which: str, seed: int):
  """``(model, prompts, settings, keys, budgets, atol, masks)``: six
  ``requests`` on the tiny model, or the demo's prompts and settings on the
  embedded one (40 tokens; ``atol`` for logprobs: the GPU's sums differ
  more; ``masks``: whether to compare masks too, on the GPU, where they are
  cheap; interpret mode checks the kernels' masks in ``test_mask_kernels``)."""
  if which == "tiny":
    return (request.getfixturevalue("model"), *requests(6, seed), 1e-5, False)
  model, tokenizer = request.getfixturevalue("embedded")
  prompts = [tokenizer.encode(text).ids for text in demo.PROMPTS]
  settings = [demo.SETTINGS[i % len(demo.SETTINGS)][1:]
              for i in range(len(prompts))]
  keys = jax.random.key_data(jax.random.split(jax.random.key(seed),
                                              len(prompts)))
  return (model, prompts, settings, np.asarray(keys), [40] * len(prompts), 1e-4,
          True)


MODELS = ["tiny", on_gpu("embedded")]


def choices(generation):
  return [(c["token_ids"], np.asarray(c["logprobs"]).tobytes(),
           c["finish_reason"]) for c in generation.to_openai()]


@pytest.mark.kernels
@pytest.mark.parametrize("which", MODELS)
def test_bit_identical_across_runs_and_batch_compositions(request, which):
  """The default implementation (XLA on CPU, the kernels on a GPU): a batch
  twice, each request alone (slot 0, the rest padding) and the batch
  reordered give the same choices bit for bit: the programs' shapes are the
  batch's, so each request's arithmetic is too (on a GPU at full fp32
  matmul precision: ``full_precision``).  With an extra 30-token prompt
  (prompt bucket 16 -> 32; on the embedded model's 8 requests also 8 -> 16
  slots) the model's matmuls have other shapes, which XLA blocks (CPU) or
  picks a GEMM algorithm for (GPU) by shape, so their sums may round
  otherwise: the same tokens and finish reasons, and logprobs within
  ``atol`` (docs/generation.md, Reproducibility)."""
  model, prompts, settings, keys, budgets, atol, _ = workload(request, which,
                                                              0)
  n = len(prompts)
  first = run(model, prompts, settings, keys, budgets)
  full = choices(first)
  assert full == choices(run(model, prompts, settings, keys, budgets))
  assert all(len(c[0]) > 0 for c in full)
  for b in range(n):
    alone = run(model, prompts[b:b + 1], settings[b:b + 1], keys[b:b + 1],
                budgets[b:b + 1])
    assert choices(alone) == [full[b]], b
  order = np.random.default_rng(0).permutation(n).tolist()
  reordered = ([prompts[i] for i in order], [settings[i] for i in order],
               keys[order], [budgets[i] for i in order])
  assert choices(run(model, *reordered)) == [full[i] for i in order]
  long_prompt = list(range(30))  # pushes the prompt bucket from 16 to 32
  wider = run(model, reordered[0] + [long_prompt], reordered[1] + [settings[1]],
              np.concatenate([reordered[2], keys[:1] + 7]),
              reordered[3] + [5])
  want = [first.to_openai()[i] for i in order]
  for got, one in zip(wider.to_openai()[:n], want, strict=True):
    assert [got[f] for f in ("token_ids", "finish_reason")] == [
        one[f] for f in ("token_ids", "finish_reason")]
    np.testing.assert_allclose(got["logprobs"], one["logprobs"], rtol=0,
                               atol=atol)


@pytest.mark.kernels
@pytest.mark.parametrize("which", [slow_case("tiny"), on_gpu("embedded")])
def test_xla_and_kernels_generate_the_same_tokens(request, which):
  """``generate`` on the XLA reference and on the kernels (interpret mode
  off a GPU): the same tokens and logprobs (within ``atol``); on the
  embedded model the same masks and logZ too."""
  model, prompts, settings, keys, budgets, atol, masks = workload(
      request, which, 1)
  xla, kernels = (run(model, prompts, settings, keys, budgets,
                      return_masks=masks,
                      config=js.SamplerConfig(implementation=impl))
                  for impl in ("xla", "pallas"))
  np.testing.assert_array_equal(xla.tokens, kernels.tokens)
  np.testing.assert_array_equal(xla.num_tokens, kernels.num_tokens)
  np.testing.assert_allclose(xla.logprobs, kernels.logprobs, atol=atol)
  for a, b in zip(xla.to_openai(), kernels.to_openai()):
    assert (a.get("logz") is None) == (not masks)
    if masks:
      np.testing.assert_allclose(a["logz"], b["logz"], atol=atol)
      assert a["sampling_mask"] == b["sampling_mask"]


@nnx.jit
def _causal_forward(model, tokens):
  return model(tokens, jnp.arange(tokens.shape[1])[None], None)[0]


def full_logits(model, sequence):
  """Next-token logits after every prefix, from the cache-free causal forward
  (padded to ``max_len``: one compilation)."""
  tokens = np.zeros((1, CONFIG.max_len), np.int32)
  tokens[0, :len(sequence)] = sequence
  return _causal_forward(model, jnp.asarray(tokens))[0, :len(sequence)]


def test_greedy_generate_equals_an_independent_greedy_loop(model):
  prompts, _, keys, _ = requests(5, seed=2)
  greedy = [SETTINGS[0]] * 5
  out = run(model, prompts, greedy, keys, [12] * 5)
  for b, prompt in enumerate(prompts):
    sequence = list(prompt)
    for _ in range(12):
      sequence.append(int(jnp.argmax(full_logits(model, sequence)[-1])))
    assert out.to_openai()[b]["token_ids"] == sequence[len(prompt):]
    np.testing.assert_array_equal(out.logprobs[b], 0.0)


def test_masks_hold_the_token_and_logz_matches_the_model(model):
  prompts, settings, keys, budgets = requests(6, seed=3)
  out = run(model, prompts, settings, keys, budgets, return_masks=True)
  width = out.tokens.shape[1]
  extract = jax.jit(js.extract_sampling_mask)
  for b, choice in enumerate(out.to_openai()):
    n, start = len(choice["token_ids"]), len(prompts[b]) - 1
    logits = full_logits(model, prompts[b] + choice["token_ids"])
    rows = jnp.zeros((width, CONFIG.vocab_size)).at[:n].set(
        logits[start:start + n])
    params = js.SamplingParams.make(width, **dict(zip(
        ("temperature", "top_k", "top_p", "min_p"), settings[b])))
    expected = extract(rows, params)
    np.testing.assert_allclose(choice["logz"], expected.logz[:n], atol=2e-4)
    for t, (ids, token) in enumerate(zip(choice["sampling_mask"],
                                         choice["token_ids"])):
      assert ids is None or token in ids, (b, t)
      assert (ids is None) == (not bool(expected.truncated[t])), (b, t)


def test_no_recompilation_across_params_prompts_keys_and_budgets(model):
  prompts, settings, keys, budgets = requests(6, seed=4)
  run(model, prompts, settings, keys, budgets)
  with CompileCounter() as compiles:
    for seed in (5, 6, 7):  # new prompts (same buckets), settings, keys, budgets
      prompts, settings, keys, budgets = requests(6, seed=seed)
      settings = settings[seed % 3:] + settings[:seed % 3]
      run(model, prompts, settings, keys, budgets, stop_tokens=[seed])
  assert compiles.count == 0


def processed_probs(model, sequence, params):
  """The processed next-token distribution after ``sequence`` (one row)."""
  one = jax.tree.map(lambda a: a[:1], params).canonical(CONFIG.vocab_size)
  logits = full_logits(model, sequence)[-1:]
  return np.exp(np.asarray(reference.log_probs(
      reference.process(logits, one), one), np.float64))[0]


@pytest.mark.slow
def test_token_frequencies_through_the_loop_match_the_model():
  """First and second generated tokens over 4,096 keys against the model's
  processed distributions (the second: mixed over the first), per token
  within 5 sigma of the sample count's binomial spread."""
  model = Transformer(CONFIG, rngs=nnx.Rngs(2))
  prompt, n, calls = [5, 17, 2], 512, 8
  params = js.SamplingParams.make(n, temperature=0.9, top_k=40, top_p=0.95)
  samples = []
  for c in range(calls):
    keys = jax.random.split(jax.random.key(100 + c), n)
    out = serve_loop.generate(model, [prompt] * n, params=params, keys=keys,
                              max_new_tokens=2)
    samples.append(np.asarray(out.tokens[:, :2]))
  samples = np.concatenate(samples)
  first = processed_probs(model, prompt, params)
  second = sum(first[f] * processed_probs(model, prompt + [f], params)
               for f in np.flatnonzero(first))
  for probs, drawn in ((first, samples[:, 0]), (second, samples[:, 1])):
    freq = np.bincount(drawn, minlength=CONFIG.vocab_size) / len(drawn)
    sigma = np.sqrt(probs * (1 - probs) / len(drawn))
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1.0 / len(drawn))
  assert np.count_nonzero(first) > 10  # a real distribution, not a point


def test_custom_module_and_function_lm_follow_the_contract(model):
  bigram = Bigram(CONFIG.vocab_size, nnx.Rngs(0))
  prompts, _, keys, _ = requests(3, seed=8)
  params = js.SamplingParams.make(3, temperature=0.0)
  out = serve_loop.generate(bigram, prompts, params=params, keys=keys,
                            max_new_tokens=6, cache_len=32)
  table = np.asarray(bigram.table.embedding[...])
  for b, choice in enumerate(out.to_openai()):
    expected, token = [], prompts[b][-1]
    for _ in range(6):
      token = int(np.argmax(table[token]))
      expected.append(token)
    assert choice["token_ids"] == expected
  graphdef, state = nnx.split(model)
  lm = serve_loop.FunctionLM(
      lambda w, t, p, c: nnx.merge(graphdef, w)(t, p, c),
      lambda w, b, n: nnx.merge(graphdef, w).init_cache(b, n),
      max_len=CONFIG.max_len)
  prompts, settings, keys, budgets = requests(4, seed=9)
  assert choices(run((lm, state), prompts, settings, keys, budgets)) == \
      choices(run(model, prompts, settings, keys, budgets))


def test_decode_step_replays_and_admits_slots_without_reshaping(model):
  lm, weights = serve_loop.NnxLM.split(model)
  prompts, settings, keys, _ = requests(8, seed=10)
  t, k, p, m = zip(*settings)
  params = js.SamplingParams.make(8, temperature=t, top_k=k, top_p=p, min_p=m)
  cache = model.init_cache(8, CONFIG.max_len)
  state = serve_loop.DecodeState(
      tokens=jnp.asarray([q[0] for q in prompts]), positions=jnp.zeros(8, int),
      keys=jnp.asarray(keys), params=params, finished=jnp.zeros(8, bool),
      stop_tokens=jnp.full((8, 4), -1), remaining=jnp.full(8, 5), cache=cache)
  step = jax.jit(serve_loop.decode_step, static_argnums=0)

  def roll(state, n):
    outs = []
    for _ in range(n):
      state, out = step(lm, weights, state)
      outs.append(out)
    return state, outs

  end, first = roll(state, 6)
  _, again = roll(state, 6)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a.tokens, b.tokens)
  assert [bool(o.valid.all()) for o in first] == [True] * 5 + [False]
  np.testing.assert_array_equal(end.positions, 5)
  # Admit slots 2 and 5 afresh into the finished state: they replay exactly.
  where = jnp.zeros(8, bool).at[jnp.asarray([2, 5])].set(True)
  readmitted, outs = roll(end.replace_slots(where, state), 5)
  for a, b in zip(first, outs):
    np.testing.assert_array_equal(b.valid, where)
    np.testing.assert_array_equal(a.tokens[where], b.tokens[where])


def test_bad_requests_get_clear_errors(model):
  params = js.SamplingParams.make(2, temperature=1.0)
  keys = jax.random.split(jax.random.key(0), 2)
  with pytest.raises(ValueError, match=r"prompts\[1\] has 0 tokens"):
    serve_loop.generate(model, [[1], []], params=params, keys=keys,
                        max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompts\[0\] has 64 tokens"):
    serve_loop.generate(model, [[1] * 64, [2]], params=params, keys=keys,
                        max_new_tokens=4)
  with pytest.raises(ValueError, match="batch size 2 but there are 3"):
    serve_loop.generate(model, [[1], [2], [3]], params=params, keys=keys,
                        max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    serve_loop.generate(model, [[1], [2]], params=params, keys=keys,
                        max_new_tokens=-1)
  with pytest.raises(ValueError, match="vocabulary"):
    serve_loop.generate(model, [[1], [CONFIG.vocab_size]], params=params,
                        keys=keys, max_new_tokens=4)
  with pytest.raises(TypeError, match="NNX module"):
    serve_loop.generate(lambda x: x, [[1], [2]], params=params, keys=keys,
                        max_new_tokens=4)
