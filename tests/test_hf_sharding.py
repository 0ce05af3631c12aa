"""``load_pretrained(mesh=...)`` on 4 CPU devices (conftest sets
``jax_num_cpu_devices``): the weights' tensor-parallel layout and the tokens
of one device, greedy and seeded sampling, on a ``model`` mesh and a
``data`` x ``model`` mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsample as js
from jaxsample import serve_loop
from jaxsample.models import load_pretrained

from helpers.hf_folders import LLAMA, QWEN2, hf_weights, write_folder

PROMPTS = [[3, 17, 5, 60, 2], [9, 1, 44, 7, 7, 30, 12, 8, 50, 4, 19], [33, 6],
           [5] * 9]
PARAMS = js.SamplingParams.make(4, temperature=[0.0, 1.0, 0.8, 0.0],
                                top_k=[0, 20, 0, 0], top_p=[1.0, 0.9, 0.95, 1.0])
# Qwen2 with 4 KV heads and 8 query heads: every projection divides over 4.
QWEN2_4KV = dict(QWEN2, hidden_size=64, num_attention_heads=8,
                 num_key_value_heads=4)


def _mesh(shape, names):
  if len(jax.devices()) < np.prod(shape):
    pytest.skip(f"needs {np.prod(shape)} devices")
  return Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape), names)


def _generate(model):
  out = serve_loop.generate(model, PROMPTS, params=PARAMS,
                            keys=jax.random.split(jax.random.key(4), 4),
                            max_new_tokens=10, cache_len=64)
  return np.asarray(out.tokens), np.asarray(out.logprobs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folder(request, tmp_path_factory):
  config = LLAMA if request.param == "llama" else QWEN2_4KV
  path = tmp_path_factory.mktemp(request.param)
  write_folder(path, config, hf_weights(config, seed=11))
  return path, _generate(load_pretrained(path))


@pytest.mark.parametrize("shape,names", [((4,), ("model",)),
                                         ((2, 2), ("data", "model"))])
def test_sharded_generation_gives_one_devices_tokens(folder, shape, names):
  path, (tokens, logprobs) = folder
  model = load_pretrained(path, mesh=_mesh(shape, names))
  got_tokens, got_logprobs = _generate(model)
  np.testing.assert_array_equal(got_tokens, tokens)
  np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-5)


def test_weights_are_laid_out_tensor_parallel(tmp_path):
  write_folder(tmp_path, LLAMA, hf_weights(LLAMA))  # 4 heads, 2 KV heads
  model = load_pretrained(tmp_path, mesh=_mesh((4,), ("model",)))
  spec = lambda p: p[...].sharding.spec
  attention, mlp = model.blocks[0].attention, model.blocks[0].mlp
  assert spec(attention.query.kernel) == P(None, "model")  # column-parallel
  assert spec(attention.out.kernel) == P("model", None)  # row-parallel
  assert spec(mlp.up.kernel) == spec(mlp.gate.kernel) == P(None, "model")
  assert spec(mlp.down.kernel) == P("model", None)
  assert spec(model.embed.embedding) == P("model", None)  # vocab-parallel
  assert spec(model.head.kernel) == P(None, "model")
  # 2 KV heads do not divide over 4 devices: replicated.
  assert spec(attention.key.kernel) == P()
  assert spec(model.final_norm.scale) == P()
  cache = model.init_cache(4, 8)
  assert cache.keys[0].sharding.is_fully_replicated


def test_cache_and_logits_split_the_batch(tmp_path):
  write_folder(tmp_path, QWEN2_4KV, hf_weights(QWEN2_4KV))
  model = load_pretrained(tmp_path, mesh=_mesh((2, 2), ("data", "model")))
  cache = model.init_cache(4, 8)
  assert cache.keys[0].sharding.spec == P("data", None, "model", None)
  tokens = np.zeros((4, 3), np.int32)
  logits, _ = model(tokens, np.broadcast_to(np.arange(3), (4, 3)), cache)
  assert logits.sharding.spec[0] == "data"


def test_docs_sharding_block_runs(tmp_path):
  """docs/checkpoints.md's block, with ``path`` set to a tiny folder."""
  import pathlib
  import re
  write_folder(tmp_path, QWEN2_4KV, hf_weights(QWEN2_4KV))
  docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" /
          "checkpoints.md").read_text()
  section = re.search(r"^## Several devices\n(.*?)^## ", docs, re.S | re.M)
  code = re.search(r"```python\n(.*?)```", section.group(1), re.S).group(1)
  code, count = re.subn(r'^path = ".*?"', f'path = "{tmp_path}"', code,
                        flags=re.M)
  assert count == 1
  scope = {}
  exec(compile(code, "docs/checkpoints.md", "exec"), scope)
  kernel = scope["model"].blocks[0].mlp.up.kernel[...]
  assert kernel.sharding.spec == P(None, "model")
  assert len(kernel.sharding.device_set) == len(jax.devices())
