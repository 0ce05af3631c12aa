set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/pb /tmp/pa
[ -d /tmp/pb/jaxsample ] || tar xzf .stage/plans_before.tgz -C /tmp/pb
[ -d /tmp/pa/jaxsample ] || tar xzf .stage/plans_after.tgz -C /tmp/pa
(cd /tmp/pb && python3 $OLDPWD/.stage/plan_sweep.py /tmp/pb before $OUT/sweep-before.json 2>&1 | grep -v -i warn | tail -3)
(cd /tmp/pa && timeout 420 python3 $OLDPWD/.stage/plan_sweep.py /tmp/pa after $OUT/sweep-after.json 2>&1 | grep -v -i warn | tail -3)
python3 - <<'P'
import json, os, collections
rows = []
for f in ("sweep-before.json", "sweep-after.json"):
  p = os.path.join(os.environ["OUT"], f)
  if os.path.exists(p): rows += json.load(open(p))["rows"]
base = {(r["setting"], r["batch"]): r["us"] for r in rows if r["tree"] == "before"}
tab = collections.defaultdict(dict)
for r in rows:
  tab[(r["tree"], r["config"], r["setting"])][r["batch"]] = r["us"]
for (t, c, s), d in sorted(tab.items()):
  cells = " ".join(f"{d.get(b, float('nan')):7.1f}({d.get(b, float('nan'))/base.get((s, b), float('nan')):4.2f})" for b in (1, 8, 32, 128, 256))
  print(f"{t:6} {c:18} {s:24} {cells}")
P
