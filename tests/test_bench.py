"""Every benchmark suite runs on tiny shapes (XLA / interpret mode on CPU) and
writes the JSON the GPU runs are read from."""

import json

import numpy as np
import pytest

from jaxsample.bench import cases, cli, flashinfer_peers, peers, report, runner, vllm_peers

TINY = ["--batch", "2", "--vocab", "256", "--dtypes", "float32", "--iters", "1",
        "--repeats", "1", "--bandwidth-gib", "0.001", "--no-progress"]
# Per suite: extra options keeping it to a few compiles, and ops every run must time.
SUITE_ARGS = {
    "sample": (["--settings", "top_k50+top_p0.9", "--dists", "heads", "--implementation",
                "xla_search"],
               ["jaxsample", "jaxsample xla reference",
                "jnp.max (one read)",
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
    "sharded": (["--implementation", "xla", "--no-peers"],
                ["one device sample", "sample_sharded 2 devices",
                 "all-gather + sample 2 devices"]),
    "sort": (["--vocab", "64", "--no-peers"],
             ["xla sort stable (-y, ids)", "xla sort uint32 key, stable"]),
    "processing": (["--settings", "plain", "--history", "8", "--implementation", "xla"],
                   ["sampler", "+penalties (history 8)", "+bias (16 ids)", "+grammar bitmask",
                    "+top-5 raw logprobs", "all together", "jnp.max (one read)"]),
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
  if suite == "processing":  # every row over the sampler alone
    assert all(row["x_sampler"] > 0 for row in doc["rows"])
    assert [r["x_sampler"] for r in doc["rows"] if r["op"] == "sampler"] == [1.0]
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


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_commands_take_their_own_command_line(command, capsys):
  with pytest.raises(SystemExit) as done:
    cli.main([command, "--help"])
  assert done.value.code == 0
  assert f"python -m jaxsample.bench {command}" in capsys.readouterr().out


def test_serve_prints_a_line_per_spec_with_the_idle_window(capsys):
  """A random-weight model on CPU: the summary line, then the profiled
  window (no GPU events: n/a)."""
  assert cli.main(["serve", "--random", "--requests", "4", "--max-tokens", "4",
                   "--slots", "2", "--cache-len", "64", "--vocab", "256",
                   "--d-model", "32", "--layers", "1", "--implementation", "xla",
                   "--idle-window", "1", "--spec", "none", "ngram"]) == 0
  lines = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith("spec=")]
  assert [line.split()[0] for line in lines] == ["spec=none", "spec=ngram"]
  assert all("requests 4/4" in line and "device idle n/a" in line
             for line in lines), lines


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


# ---------------------------------------------------------------------------
# python -m jaxsample.bench report
# ---------------------------------------------------------------------------

REPORT_TINY = ["report", "--batch", "1,4", "--vocab", "512", "--dtypes", "float32",
               "--settings", "plain,top_p0.95", "--quick", "--spec-k", "1",
               "--implementation", "xla", "--mask-caps", "", "--peers", "jax",
               "--bandwidth-gib", "0.001", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _table(md: str, title: str) -> list[list[str]]:
  """The cells of the markdown table under ``### title`` (header first)."""
  block = md.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
  lines = [line for line in block.splitlines() if line.startswith("|") and "---" not in line]
  return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_report_writes_json_tables_and_figures(tmp_path):
  out = tmp_path / "report"
  assert cli.main([*REPORT_TINY, "--out", str(out)]) == 0
  doc = json.loads((out / "report.json").read_text())
  assert set(report.JSON_KEYS) <= set(doc)
  assert doc["peers"]["names"] == ["jax"] and doc["peers"]["vllm"] is None
  assert doc["command"] == "python -m jaxsample.bench " + " ".join(
      [*REPORT_TINY, "--out", str(out)]).replace("--mask-caps  ", "--mask-caps '' ")
  sample = [r for r in doc["rows"] if r["suite"] == "sample"]
  spec = [r for r in doc["rows"] if r["suite"] == "spec"]
  for setting in ("plain", "top_p0.95"):
    for batch in (1, 4):
      ops = {r["op"] for r in sample if r["setting"] == setting and r["batch"] == batch}
      assert {"jaxsample", "jaxsample xla reference", report.MAX,
              "jax.random.categorical"} <= ops, (setting, batch, ops)
      assert {r["op"] for r in spec if r["setting"] == setting and r["batch"] == batch} == {
          "jaxsample", report.SPEC_MAX}
  assert all(set(runner.ROW_KEYS) <= set(r) and r["us"] > 0 for r in doc["rows"])
  assert [r["same_tokens"] for r in sample if "same_tokens" in r] == [True] * 4
  assert {r["k"] for r in spec} == {1}

  md = (out / "report.md").read_text()
  assert doc["device"] in md and "git commit" in md
  plain = _table(md, "V = 512, float32, plain")
  assert plain[0][:3] == ["B", "floor", "jaxsample"] and report.MAX in plain[0]
  assert [row[0] for row in plain[1:]] == ["1", "4"]
  read = plain[0].index(report.MAX)
  for row in plain[1:]:  # the plain sample is 1.00x itself, jnp.max 1.00x itself
    assert "(1.00, " in row[2] and row[read].endswith(", 1.00)"), row
  us = {r["batch"]: r["us"] for r in sample if r["op"] == "jaxsample" and
        r["setting"] == "top_p0.95"}
  top_p = _table(md, "V = 512, float32, top_p0.95")
  assert [float(row[2].split(" ")[0]) for row in top_p[1:]] == [
      round(us[1], 1), round(us[4], 1)]
  verification = _table(md, "Verification, V = 512, float32, k = 1 (one-hot drafts)")
  assert verification[0] == ["B", "floor", report.SPEC_MAX, "plain", "top_p0.95"]
  assert "Tokens against the XLA reference: identical (2 checks)" in md
  for name in ("sample-V512-float32-plain.png", "sample-V512-float32-top_p0.95.png",
               "spec-V512-float32-k1.png"):
    data = (out / name).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    assert f"]({name})" in md

  merged = tmp_path / "merged"  # rendering alone: the same tables from the JSON
  assert cli.main(["report", "--merge", f"{out / 'report.json'},{out / 'report.json'}",
                   "--out", str(merged)]) == 0
  again = json.loads((merged / "report.json").read_text())
  assert len(again["rows"]) == 2 * len(doc["rows"]) and len(again["merged"]) == 2
  assert again["merged"][0] == dict({k: v for k, v in doc.items() if k != "rows"},
                                    path=str(out / "report.json"))
  assert (merged / "sample-V512-float32-plain.png").read_bytes().startswith(PNG_MAGIC)
  assert doc["complete"] and again["complete"] and again["left_out"] == []


def test_report_time_limit_lists_the_cases_it_left_out(tmp_path):
  out = tmp_path / "cut"  # the bandwidth copy alone outlasts the limit: no case starts
  assert cli.main([*REPORT_TINY, "--time-limit", "1e-9", "--out", str(out)]) == 0
  doc = json.loads((out / "report.json").read_text())
  assert doc["rows"] == [] and not doc["complete"]
  assert len(doc["left_out"]) == 2 * 2 * 2  # sample and spec, 2 batches, 2 settings
  assert "**incomplete**: 8 case(s) left out by `--time-limit`" in (out / "report.md").read_text()


def test_report_grid_and_options():
  args = cli.parser().parse_args(["report", "--peers", "jax"])
  todo = report.jobs(args, {"jax"})
  samples = [j.case for j in todo if j.suite.name == "sample"]
  specs = [j.case for j in todo if j.suite.name == "spec"]
  assert {c.vocab for c in samples} == {151936, 128256}
  assert {c.batch for c in samples} == {1, 8, 32, 128, 256, 512}
  assert {c.dtype for c in samples} == {"float32", "bfloat16"}
  assert {c.setting for c in samples} == {"plain", "top_k50+top_p0.9", "top_p0.95", "min_p0.05"}
  assert len(samples) == 2 * 6 * 2 * 4 and len(specs) == 3 * len(samples)
  assert {s.k for s in specs} == {1, 4, 8} and not any(s.draft for s in specs)
  # masks on truncating settings only; params both traced and closed over
  assert all(j.args.mask_caps == ("" if j.case.setting == "plain" else "1024")
             for j in todo if j.suite.name == "sample")
  assert {j.args.params for j in todo if j.suite.name == "sample"} == {"both"}
  cut = cli.parser().parse_args(["report", "--no-spec", "--vocab", "512", "--batch", "2"])
  assert [j.suite.name for j in report.jobs(cut, set())] == ["sample"] * 8  # 2 dtypes, 4 settings
  spec_only = cli.parser().parse_args(["report", "--no-sample", "--vocab", "512", "--batch", "2",
                                       "--dtypes", "bfloat16", "--spec-k", "4"])
  assert [(j.suite.name, j.case.k) for j in report.jobs(spec_only, set())] == [("spec", 4)] * 4
  with pytest.raises(SystemExit, match="expected a comma-separated subset"):
    cli.main(["report", "--peers", "jax,sglang", "--out", "unused"])


@pytest.mark.parametrize("name,module,files", [
    ("vllm", vllm_peers, vllm_peers.FILES.values()),
    ("flashinfer", flashinfer_peers, flashinfer_peers.FILES)])
def test_report_names_the_fix_for_a_missing_source_copy(tmp_path, monkeypatch, name, module,
                                                        files):
  monkeypatch.delenv(module.ENV_VAR, raising=False)
  with pytest.raises(SystemExit, match=f"--{name}-src PATH or set {module.ENV_VAR}"):
    cli.main(["report", "--peers", f"jax,{name}", "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="no such folder"):
    cli.main(["report", "--peers", name, f"--{name}-src", str(tmp_path / "nope"),
              "--out", str(tmp_path)])
  assert not list(tmp_path.iterdir())  # nothing timed, nothing written
  if peers.torch_module() is None:
    source = tmp_path / name
    for file in files:
      (source / file).parent.mkdir(parents=True, exist_ok=True)
      (source / file).write_text("")
    with pytest.raises(SystemExit, match="need torch"):
      cli.main(["report", "--peers", name, f"--{name}-src", str(source), "--out", str(source)])


def test_a_failing_external_peer_is_recorded_then_left_out(capsys):
  failures, calls = [], []

  def factory(filters, temperature):
    def op(rows, iters, repeats):
      calls.append(filters)
      raise RuntimeError("this Triton cannot compile that kernel")
    return op

  guarded = report.guarded("broken peer", factory, failures)
  rows = [np.zeros((2, 8), np.float32)]
  assert guarded({}, 1.0)(rows, 1, 1) is None
  assert guarded({"top_k": 5}, 1.0)(rows, 1, 1) is None  # not tried again
  assert calls == [{}] and len(failures) == 1
  assert failures[0]["peer"] == "broken peer" and failures[0]["shape"] == [2, 8]
  assert "RuntimeError: this Triton cannot compile" in failures[0]["error"]
  assert "left out from here on" in capsys.readouterr().err
