"""On the GPU: SamplerConfig(batch_invariant=True) rows bit-identical at B = 1..256, V = 151936 (plain and top-p)."""
import jax, jax.numpy as jnp, numpy as np, jaxsample as js
V, most = 151936, 256
x = 2 * jax.random.normal(jax.random.key(99), (most, V))
keys = jax.random.split(jax.random.key(7), most); pos = jnp.arange(most, dtype=jnp.int32) * 3
for inv in (True,):
  cfg = js.SamplerConfig(batch_invariant=inv)
  f = jax.jit(lambda x, p, k, q: js.sample(x, p, k, positions=q, config=cfg))
  for name, kw in (("plain", {}), ("top_p0.95", {"top_p": 0.95})):
    want = f(x, js.SamplingParams.make(most, temperature=1.0, **kw), keys, pos)
    same = []
    for b in (1, 8, 32, 128):
      got = f(x[:b], js.SamplingParams.make(b, temperature=1.0, **kw), keys[:b], pos[:b])
      same.append(bool(np.array_equal(got.tokens, want.tokens[:b]) and
                       np.array_equal(np.asarray(got.logprobs).view(np.uint32), np.asarray(want.logprobs[:b]).view(np.uint32))))
    print(f"batch_invariant={inv} {name}: bit-identical to B=256 at B=1,8,32,128: {same}", flush=True)
