"""The [B, V] operations of the tiny decode step (emit) with sparse processors: JAX_PLATFORMS=cpu PYTHONPATH=. python3 THIS."""
import dataclasses, re, jax, jax.numpy as jnp
import jaxsample as js
from jaxsample import serve_loop
from jaxsample.bench import decode
from jaxsample.bench.cases import processor_fields
cfg = decode.TINY_SHAPES["tiny-tied"]; B, V = 4, cfg.vocab_size
lm, weights = decode.random_weights(cfg)
state = decode.start_state(lm, weights, cfg, B, cfg.max_len)
f = processor_fields(B, V, 16, 16)
for kinds in (("bias",), ("bias", "penalties"), ("bias", "penalties", "bitmask")):
  st = dataclasses.replace(state, processors=js.LogitsProcessors(**{k: v for kk in kinds for k, v in f[kk].items()}))
  for mode in (None, "raw_logprobs", "processed_logprobs"):
    def step(w, s):
      logits, cache = lm.apply(w, s.tokens[:, None], s.positions[:, None], s.cache)
      small, out = serve_loop.emit(dataclasses.replace(s, cache=None), logits[:, 0], num_top=5 if mode else 0, logprob_mode=mode)
      return dataclasses.replace(small, cache=cache), out.top
    hlo = jax.jit(step).lower(weights, st).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    big = [l for l in entry.splitlines() if " = " in l and f"[{B},{V}]" in l.split(" = ")[1][:30]]
    ops = [(re.search(r"\]\S* ([\w-]+)\(", l) or re.search(r"([\w-]+)\(", l)).group(1) + ":" + (l.split("calls=%")[1].split(",")[0][:28] if "calls=" in l else "") for l in big]
    print(kinds, mode, len(big), ops)
