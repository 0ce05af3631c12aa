"""The benchmark suites of the public API: sample, truncation, profile, extract,
fp64, spec, sweep and processing (``python -m jaxsample.bench SUITE --help``).

Params are ``jit`` arguments, as in a decode loop (closed over, XLA would fold
the row conditions away), unless an op's name says "params closed over".
Every op returns the whole result (tokens, logprobs, valid; the mask where
asked), so XLA drops no work the API does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample._src import backends, spec
from jaxsample.bench import cases as cases_lib
from jaxsample.bench.runner import Group, Suite
from jaxsample._src import tuning

__all__ = ["SUITES", "SpecCase", "breakdown", "grid_cases", "sample_ops", "sampler"]

_KEY = jax.random.key(1)


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
  return [v for v in text.split(",") if v]


def grid_cases(args) -> list[cases_lib.Case]:
  """``--cases NAME`` or the grid of the shape options."""
  if args.cases:
    return cases_lib.NAMED[args.cases]
  return cases_lib.grid(_ints(args.batch), args.vocab, _names(args.dtypes),
                        _names(args.settings), _names(args.dists), args.temperature)


def sampler(params, *, static=False, mask_cap=0, zero_keys=False, **config):
  """A function of one logits array: ``jaxsample.sample`` under ``config``."""
  cfg = js.SamplerConfig(**config, **({"max_mask_ids": mask_cap} if mask_cap else {}))

  def run(x, params):
    if zero_keys:  # per-request zero keys at position 0
      keys = dict(key=jnp.zeros((x.shape[0], 2), jnp.uint32),
                  positions=jnp.zeros((x.shape[0],), jnp.int32))
    else:
      keys = dict(key=_KEY)
    return js.sample(x, params, **keys, config=cfg, return_mask=bool(mask_cap))

  if static:
    jitted = jax.jit(functools.partial(run, params=params))
    call = jitted
  else:
    jitted = jax.jit(run)
    call = lambda x: jitted(x, params)
  if not cfg.use_fp64_gumbel:
    return call

  def call_x64(x):  # FP64 noise traces and runs with x64 on
    with jax.enable_x64(True):
      return call(x)

  return call_x64


def _same_tokens(ops: dict, names, baseline: str, x) -> dict:
  """``{name: {"same_tokens": bool}}``: whether each op's tokens on ``x`` are
  the ``baseline`` op's."""
  want = np.asarray(ops[baseline](x).tokens)
  return {name: {"same_tokens": bool(np.array_equal(np.asarray(ops[name](x).tokens), want))}
          for name in names}


def _group(args, case, ops: dict, **kw) -> Group:
  return Group(label=case.label(), inputs=case.inputs(), ops=ops,
               floor_bytes=case.logits_bytes, peer_rows=lambda x: x,
               peer_filters=case.filters, temperature=case.temperature, **kw)


# ---------------------------------------------------------------------------
# sample, truncation, profile: jaxsample.sample per setting.
# ---------------------------------------------------------------------------


def _sample_options(parser, mask_caps=""):
  parser.add_argument("--rngs", default="philox", help="generators: philox,threefry")
  parser.add_argument("--params", default="arg", choices=("arg", "static", "both"),
                      help="params as jit arguments (a decode loop), closed over, or both")
  parser.add_argument("--fp64", action="store_true", help="also time FP64 noise")
  parser.add_argument("--mask-caps", default=mask_caps,
                      help="K_cap values: also time sample(..., return_mask=True)")
  parser.add_argument("--candidates", default="",
                      help="max_candidates values to time (default: the config's)")
  parser.add_argument("--no-reference", dest="reference", action="store_false",
                      help="leave out jaxsample's XLA reference (it sorts truncating rows)")


def sample_ops(args, case) -> dict:
  """jaxsample.sample's ops for one case (the sample/truncation/profile suites)."""
  params, impl = case.params(), args.implementation
  ops = {}
  for candidates in _ints(args.candidates) or [None]:
    tail = f" C={candidates}" if candidates else ""
    extra = {"max_candidates": candidates} if candidates else {}
    for rng in _names(args.rngs):
      name = "jaxsample" + ("" if rng == "philox" else f" {rng}") + tail
      if args.params in ("arg", "both"):
        ops[name] = sampler(params, implementation=impl, rng=rng, **extra)
      if args.params in ("static", "both"):
        ops[name + ", params closed over"] = sampler(params, static=True,
                                                     implementation=impl, rng=rng, **extra)
    for cap in _ints(args.mask_caps):
      ops[f"jaxsample +mask K_cap={cap}{tail}"] = sampler(params, mask_cap=cap,
                                                          implementation=impl, **extra)
  if case.setting == "plain" and case.temperature > 0:
    ops["jaxsample greedy (T=0)"] = sampler(case.params(temperature=0.0), implementation=impl)
  if args.fp64:
    ops["jaxsample fp64"] = sampler(params, implementation=impl, use_fp64_gumbel=True)
  if args.reference:
    ops["jaxsample xla reference"] = sampler(params, implementation="xla")
  return ops


def _build_sample(args, case) -> Group:
  """``sample_ops``; with the reference timed, each ``jaxsample`` op's tokens
  are checked against the reference's on one input (fields ``same_tokens``)."""
  ops = sample_ops(args, case)
  other_draw = ("+mask", "greedy", "threefry", "fp64", "reference")  # or no tokens
  same_draw = [name for name in ops if not any(w in name for w in other_draw)]
  extra = (_same_tokens(ops, same_draw, "jaxsample xla reference", case.logits())
           if args.reference else {})
  return _group(args, case, ops, extra=extra)


SAMPLE = Suite(
    name="sample",
    help="jaxsample.sample per setting against the peers (the README's table)",
    defaults=dict(batch="1,8,32,128,256,512", dtypes="float32,bfloat16"),
    add_options=_sample_options, cases=grid_cases, build=_build_sample)

TRUNCATION = Suite(
    name="truncation",
    help="truncated sampling (top-k, top-p, min-p) and its masks against the peers",
    defaults=dict(batch="1,32,128,256", settings="top_k50,top_p0.9,top_k50+top_p0.9,"
                  "min_p0.05,top_p0.95", dists="randn_x1", temperature=1.0, repeats=3),
    add_options=functools.partial(_sample_options, mask_caps="64,1024,4096"),
    cases=grid_cases, build=_build_sample)

PROFILE = Suite(
    name="profile",
    help="where the kernels' time goes: the costliest device ops of each call",
    defaults=dict(batch="128", settings="top_k50+top_p0.9,top_p0.9,min_p0.05",
                  dists="randn_x1", temperature=1.0, iters=16, repeats=3, kernels=14),
    add_options=functools.partial(_sample_options, mask_caps="1024"),
    cases=grid_cases, build=_build_sample)


# ---------------------------------------------------------------------------
# extract: extract_sampling_mask against the sampler's mask.
# ---------------------------------------------------------------------------


def _extract_options(parser):
  parser.add_argument("--mask-caps", default="64,1024")


def _build_extract(args, case) -> Group:
  params = case.params()
  ops, extra = {}, {}
  for cap in _ints(args.mask_caps):
    sampled = sampler(params, mask_cap=cap, zero_keys=True, implementation=args.implementation)
    ops[f"sample's mask K_cap={cap}"] = sampled
    for impl in dict.fromkeys((args.implementation, "xla")):
      config = js.SamplerConfig(implementation=impl, max_mask_ids=cap)
      jitted = jax.jit(lambda x, p, config=config: js.extract_sampling_mask(x, p, config=config))
      ops[f"extract_sampling_mask {impl} K_cap={cap}"] = (
          lambda x, jitted=jitted: jitted(x, params))
    x = case.logits()
    names = (f"sample's mask K_cap={cap}",
             f"extract_sampling_mask {args.implementation} K_cap={cap}")
    masks = [jax.device_get(ops[name](x)) for name in names]
    sampled, extracted = (m[1] if isinstance(m, tuple) else m for m in masks)
    # On overflow, sample's mask puts the sampled token in the last slot (mask.with_token).
    same = (all(np.array_equal(getattr(sampled, f), getattr(extracted, f))
                for f in ("count", "truncated", "overflow")) and
            np.array_equal(sampled.ids[:, :-1], extracted.ids[:, :-1]) and
            np.array_equal(sampled.ids[~sampled.overflow], extracted.ids[~sampled.overflow]))
    for name in names:
      extra[name] = {"same_ids_as_sample": bool(same)}
  return _group(args, case, ops, extra=extra)


EXTRACT = Suite(
    name="extract",
    help="extract_sampling_mask (kernels and XLA) against sample's own mask",
    defaults=dict(batch="1,32,128", settings="top_k50+top_p0.9,top_p0.95", dists="randn_x1",
                  temperature=1.0, iters=16, repeats=3),
    add_options=_extract_options, cases=grid_cases, build=_build_extract)


# ---------------------------------------------------------------------------
# fp64: FP64 noise.
# ---------------------------------------------------------------------------


def _fp64_options(parser):
  parser.add_argument("--mask-caps", default="")


def _build_fp64(args, case) -> Group:
  params, impl = case.params(), args.implementation
  ops = {"jaxsample fp64": sampler(params, implementation=impl, use_fp64_gumbel=True)}
  for cap in _ints(args.mask_caps):
    ops[f"jaxsample fp64 +mask K_cap={cap}"] = sampler(
       params, mask_cap=cap, implementation=impl, use_fp64_gumbel=True)
  ops["jaxsample fp32"] = sampler(params, implementation=impl)
  ops["jaxsample xla reference fp64"] = sampler(params, implementation="xla",
                                                use_fp64_gumbel=True)
  return _group(args, case, ops)


FP64 = Suite(
    name="fp64",
    help="FP64 Gumbel noise (kernels, with masks, against FP32 and the XLA reference)",
    defaults=dict(batch="1,32,128", settings="top_k50+top_p0.9,top_p0.9", iters=20,
                  repeats=3),
    add_options=_fp64_options, cases=grid_cases, build=_build_fp64)


# ---------------------------------------------------------------------------
# sweep: launch configs (jaxsample._src.tuning), passed as SamplerConfig.tuning.
# ---------------------------------------------------------------------------


def _sweep_options(parser):
  parser.add_argument("--splits", default="", help="the Gumbel race's num_splits values")
  parser.add_argument("--warps", default="", help="the Gumbel race's num_warps values")
  parser.add_argument("--block-sizes", default="",
                      help="the Gumbel race's block_size values (threefry)")
  parser.add_argument("--knobs", default="",
                      help="';'-separated sets of ','-separated kernel.field=int knobs of "
                           "jaxsample._src.tuning, e.g. 'stats.block_size=1024,"
                           "stats.chunks_per_step=2;compact.num_warps=8'")


_RACE_FIELDS = {"splits": "num_splits", "warps": "num_warps", "block": "block_size"}


def _sweep_tunings(args) -> dict[str, tuning.Tuning]:
  """The swept configs by name: the Gumbel race's plans, then the knob sets."""
  found = {}
  for splits, warps, block in itertools.product(
      _ints(args.splits) or [None], _ints(args.warps) or [None],
      _ints(args.block_sizes) or [None]):
    knobs = {k: v for k, v in (("splits", splits), ("warps", warps), ("block", block))
             if v is not None}
    if knobs:
      found[" ".join(f"{k}={v}" for k, v in knobs.items())] = tuning.overriding(
          {f"gumbel.{_RACE_FIELDS[k]}": v for k, v in knobs.items()})
  for knob_set in filter(None, args.knobs.split(";")):
    knobs = dict(item.split("=") for item in knob_set.split(","))
    found[knob_set] = tuning.overriding({k: int(v) for k, v in knobs.items()})
  return found


def _build_sweep(args, case) -> Group:
  params = case.params()
  ops = {"jaxsample default plan": sampler(params, static=True,
                                           implementation=args.implementation)}
  for name, tuned in _sweep_tunings(args).items():
    ops[f"jaxsample {name}"] = sampler(params, static=True, implementation=args.implementation,
                                       tuning=tuned)
  extra = _same_tokens(ops, ops, "jaxsample default plan", case.logits())
  return _group(args, case, ops, extra=extra)


SWEEP = Suite(
    name="sweep",
    help="launch configs (the Gumbel race's plans; any kernel's knobs) as SamplerConfig.tuning",
    defaults=dict(batch="1,32,128,512", dists="randn,llm"),
    add_options=_sweep_options, cases=grid_cases, build=_build_sweep)


# ---------------------------------------------------------------------------
# spec: speculative-decoding rejection sampling.
# ---------------------------------------------------------------------------

PASS1 = ("jaxsample_spec_stats", "jaxsample_gumbel_max")  # with draft logits, or the one pass
PASS2 = ("jaxsample_spec_emit",)


@dataclasses.dataclass(frozen=True)
class SpecCase:
  """A ``Case`` of target rows ``[B, k + 1, V]``, with draft logits or one-hot drafts."""

  case: cases_lib.Case
  k: int
  draft: bool

  def label(self) -> dict:
    return dict(self.case.label(), k=self.k, draft=self.draft)


def breakdown(kernel_us: dict) -> dict:
  """Device us per call of pass 1, pass 2 and the rest (``time_op``'s ``kernel_us``)."""
  named = lambda names: lambda n: any(name in n for name in names)
  glue = lambda n: not named(PASS1 + PASS2)(n)
  part = lambda keep: sum(us for n, us in kernel_us.items() if keep(n))
  return dict(pass1_us=part(named(PASS1)), pass2_us=part(named(PASS2)),
              other_us=part(glue))


def _spec_options(parser):
  parser.add_argument("--k", default="1,4,8", help="draft lengths")
  parser.add_argument("--draft", default="both", choices=("both", "yes", "no"),
                      help="draft logits (yes), one-hot drafts (no) or both")
  parser.add_argument("--rates", default="0.8,0",
                      help="synthetic acceptance rates per slot to time")
  parser.add_argument("--mask-caps", default="", help="K_cap values: also time return_mask")
  parser.add_argument("--no-reference", dest="reference", action="store_false",
                      help="leave out jaxsample's XLA reference (it sorts truncating rows)")


def _spec_cases(args) -> list[SpecCase]:
  drafts = {"both": (False, True), "yes": (True,), "no": (False,)}[args.draft]
  return [SpecCase(case, k, draft) for case, k, draft in
          itertools.product(grid_cases(args), _ints(args.k), drafts)]


def _spec_inputs(sc: SpecCase) -> list:
  """Rotating ``(target, draft, drafts)`` triples: ``draft`` None for one-hot
  drafts (random tokens), else ``drafts`` its argmax (the drafter's output,
  computed before timing)."""
  c, k = sc.case, sc.k
  seed = c.batch * 10 + k
  target = [t.reshape(c.batch, k + 1, c.vocab) for t in cases_lib.rotating_inputs(
      c.batch * (k + 1), c.vocab, c.dtype, seed, c.dist)]
  if not sc.draft:
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, c.vocab, (c.batch, k)),
                         jnp.int32)
    return [(t, None, tokens) for t in target]
  draft = [d.reshape(c.batch, k, c.vocab) for d in cases_lib.rotating_inputs(
      c.batch * k, c.vocab, c.dtype, seed + 1, c.dist)]
  count = max(len(target), len(draft))
  return [(target[i % len(target)], draft[i % len(draft)],
           jnp.argmax(draft[i % len(draft)], axis=-1).astype(jnp.int32)) for i in range(count)]


def _build_spec(args, sc: SpecCase) -> Group:
  c, k = sc.case, sc.k
  params = c.params()
  r = np.random.default_rng(c.batch * 100 + k)
  keys = jax.random.split(jax.random.key(3), c.batch)
  positions = jnp.asarray(r.integers(0, 2**20, c.batch), jnp.int32)
  n = jnp.full((c.batch,), k, jnp.int32)

  def op(impl, rate=None, mask_cap=0):
    config = js.SamplerConfig(implementation=impl,
                              **({"max_mask_ids": mask_cap} if mask_cap else {}))
    # Rates are an argument: constants would let XLA fold the acceptance test.
    rates = None if rate is None else jnp.full((k,), rate, jnp.float32)

    @jax.jit
    def run(inputs, rates, positions):  # positions are data, as in a decode loop
      target, draft, drafts = inputs
      return spec.rejection_sample(target, drafts, n, params, keys, draft_logits=draft,
                                   synthetic_rates=rates, positions=positions, config=config,
                                   return_mask=bool(mask_cap))

    return functools.partial(run, rates=rates, positions=positions)

  impl = args.implementation
  ops = {"jaxsample": op(impl)}
  ops.update({f"jaxsample +mask K_cap={cap}": op(impl, mask_cap=cap)
              for cap in _ints(args.mask_caps)})
  ops.update({f"jaxsample syn={rate:g}": op(impl, rate)
              for rate in (float(v) for v in _names(args.rates))})
  if args.reference:
    ops["jaxsample xla reference"] = op("xla")

  @jax.jit
  def read_once(inputs):  # the target and draft logits read once, nothing else
    target, draft, _ = inputs
    row_max = jnp.max(target, axis=-1)
    return row_max if draft is None else (row_max, jnp.max(draft, axis=-1))

  ops["jnp.max (target and draft)"] = read_once
  rows_read = c.batch * (k + 1) + (c.batch * k if sc.draft else 0)

  def annotate(name, result):
    if name.startswith("jaxsample") and "xla" not in name and "kernel_us" in result:
      return breakdown(result["kernel_us"])
    return {}

  return Group(label=sc.label(), inputs=_spec_inputs(sc), ops=ops,
               floor_bytes=rows_read * c.vocab * jnp.dtype(c.dtype).itemsize,
               peer_rows=lambda triple: triple[0].reshape(-1, c.vocab),
               peer_filters=c.filters, temperature=c.temperature, annotate=annotate)


SPEC = Suite(
    name="spec",
    help="speculative-decoding rejection sampling (one-hot drafts, draft logits, synthetic)",
    defaults=dict(dtypes="float32,bfloat16", repeats=3),
    add_options=_spec_options, cases=_spec_cases, build=_build_spec)

# ---------------------------------------------------------------------------
# processing: logits processors and logprob outputs against the sampler alone.
# ---------------------------------------------------------------------------


def _processing_options(parser):
  parser.add_argument("--history", type=int, default=1024,
                      help="output tokens per request the penalties count")
  parser.add_argument("--bias-ids", type=int, default=16, help="logit-bias ids per request")
  parser.add_argument("--num-top", type=int, default=5, help="top-n raw logprobs")


def _build_processing(args, case) -> Group:
  """The sampler alone, with each processor, with top-n raw logprobs and with
  everything; rows carry ``x_sampler``, their time over the sampler's.  On
  the kernels, also the bitmask read inside their passes
  (``SamplerConfig.kernel_bitmask``)."""
  params = case.params()
  config = js.SamplerConfig(implementation=args.implementation)
  fields = cases_lib.processor_fields(case.batch, case.vocab, args.history, args.bias_ids)

  def op(processors, num_top=0, config=config):
    @jax.jit
    def run(x, params, processors):  # params and processors are data, as in a decode loop
      out = js.sample(x, params, _KEY, config=config, processors=processors)
      if not num_top:
        return out
      return out, js.logprobs.token_logprobs(x, params, out.tokens, num_top=num_top,
                                             mode="raw_logprobs", processors=processors)
    return lambda x: run(x, params, processors)

  every = {k: v for f in fields.values() for k, v in f.items()}
  in_kernels = dataclasses.replace(config, kernel_bitmask=True)
  make = lambda kw: js.LogitsProcessors(**kw)
  ops = {"sampler": op(None),
         f"+penalties (history {args.history})": op(make(fields["penalties"])),
         f"+bias ({args.bias_ids} ids)": op(make(fields["bias"])),
         "+grammar bitmask": op(make(fields["bitmask"])),
         **({"+grammar bitmask (in kernels)": op(make(fields["bitmask"]), config=in_kernels)}
            if backends.backend_name(config) == "pallas" else {}),
         f"+top-{args.num_top} raw logprobs": op(None, args.num_top),
         "all together": op(make(every), args.num_top),
         "jnp.max (one read)": jax.jit(lambda x: jnp.max(x, axis=-1))}
  base = {}

  def annotate(name, result):
    if name == "sampler":
      base["us"] = result["us"]
    return {"x_sampler": result["us"] / base["us"]} if base else {}

  return Group(label=case.label(), inputs=case.inputs(), ops=ops,
               floor_bytes=case.logits_bytes, peer_rows=None,
               temperature=case.temperature, annotate=annotate)


PROCESSING = Suite(
    name="processing",
    help="logits processors (penalties, bias, grammar bitmask) and top-n logprobs, "
    "as ratios to the sampler alone (issue 40's bars)",
    defaults=dict(batch="128", dtypes="float32,bfloat16", settings="plain,top_p0.9",
                  temperature=1.0, repeats=5),
    add_options=_processing_options, cases=grid_cases, build=_build_processing)

SUITES = {s.name: s for s in (SAMPLE, TRUNCATION, PROFILE, EXTRACT, FP64, SPEC, SWEEP,
                                          PROCESSING)}
