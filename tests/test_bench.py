"""Every benchmark suite runs on tiny shapes (XLA / interpret mode on CPU) and
writes the JSON the GPU runs are read from."""

import json

import pytest

from jaxsample.bench import cases, cli, runner

TINY = ["--batch", "2", "--vocab", "256", "--dtypes", "float32", "--iters", "1",
        "--repeats", "1", "--bandwidth-gib", "0.001", "--no-progress"]
# Per suite: extra options keeping it to a few compiles, and ops every run must time.
SUITE_ARGS = {
    "sample": (["--settings", "top_k50+top_p0.9", "--dists", "heads", "--implementation",
                "xla_search"],
               ["jaxsample", "jaxsample xla reference", "jnp.max (one read)",
                "jax.random.categorical", "lax.top_k(50)+categorical",
                "sort top-p(0.9)+categorical"]),
    "truncation": (["--settings", "top_p0.9", "--implementation", "xla", "--mask-caps", "8",
                    "--no-peers", "--no-reference"],
                   ["jaxsample", "jaxsample +mask K_cap=8"]),
    "profile": (["--settings", "min_p0.05", "--implementation", "xla", "--mask-caps", "",
                 "--no-peers", "--no-reference", "--resident"], ["jaxsample"]),
    "extract": (["--settings", "top_p0.9", "--implementation", "xla", "--mask-caps", "8",
                 "--no-peers"], ["sample's mask K_cap=8", "extract_sampling_mask xla K_cap=8"]),
    "fp64": (["--settings", "top_k50", "--implementation", "xla", "--no-peers",
              "--ops", "fp64"], ["jaxsample fp64", "jaxsample xla reference fp64"]),
    "spec": (["--k", "2", "--draft", "no", "--rates", "0.5", "--implementation", "xla",
              "--no-peers", "--ops", "jaxsample syn,jnp.max"],
             ["jaxsample syn=0.5", "jnp.max (target and draft)"]),
    "sweep": (["--splits", "2", "--knobs", "compact.num_warps=8", "--implementation", "xla",
               "--no-peers"],
              ["jaxsample default plan", "jaxsample splits=2",
               "jaxsample compact.num_warps=8"]),
    "pivot": (["--no-peers", "--ops", "count active"], ["pivot count active"]),
    "sort": (["--vocab", "64", "--no-peers"],
             ["xla sort stable (-y, ids)", "xla sort uint32 key, stable"]),
}


def test_every_suite_has_a_tiny_run():
  assert set(SUITE_ARGS) == set(cli.SUITES)


@pytest.mark.parametrize("suite", sorted(SUITE_ARGS))
def test_suite_writes_rows_and_json(suite, tmp_path, capsys):
  extra, want_ops = SUITE_ARGS[suite]
  out = tmp_path / "out.json"
  assert cli.main([suite, *TINY, *extra, "--out", str(out)]) == 0
  doc = json.loads(out.read_text())
  assert set(runner.JSON_KEYS) <= set(doc) and doc["suite"] == suite
  ops = [row["op"] for row in doc["rows"]]
  assert set(want_ops) <= set(ops), ops
  assert all(row.get("resident", False) == ("--resident" in extra) for row in doc["rows"])
  if suite == "sample":
    assert [r["same_tokens"] for r in doc["rows"] if r["op"] == "jaxsample"] == [True]
  for row in doc["rows"]:
    assert set(runner.ROW_KEYS) <= set(row)
    assert row["us"] > 0 and row["floor_us"] > 0 and row["batch"] == 2
    # The suites' own checks: jaxsample's tokens are the reference's, a
    # sweep's plans give the default plan's tokens, extract gives sample's ids
    # (an unstable one-key sort may break ties).
    for check in ("same_tokens", "same_ids_as_sample", "exact"):
      if check in row and row["op"] != "xla sort unstable (-y, ids)":
        assert row[check], (row["op"], check)
  printed = capsys.readouterr().out
  assert all(op in printed for op in want_ops)


def test_build_time_checks_hold():
  """The exactness flags the suites record are true on CPU."""
  args = cli.parser().parse_args(["sort", *TINY, "--vocab", "64", "--no-peers"])
  group = cli.SUITES["sort"].build(args, cases.Case(2, 64))
  exact = {name: fields["exact"] for name, fields in group.extra.items()}
  assert exact["xla sort stable (-y, ids)"] and exact["xla sort unstable, 2 keys"]
  assert exact["xla sort uint32 key, stable"]


def test_named_case_sets():
  main = cases.NAMED["main"]
  assert {c.batch for c in main} == {1, 32, 128} and {c.vocab for c in main} == {151936}
  assert {c.setting for c in main} == {"plain", "top_k50+top_p0.9", "top_p0.95", "min_p0.05"}
  smoke = cases.NAMED["smoke"][0]
  assert smoke.logits().shape == (smoke.batch, smoke.vocab)
  assert smoke.params().batch_size == smoke.batch
  with pytest.raises(ValueError, match="setting"):
    cases.Case(1, 8, setting="top_q")
