#!/bin/bash
cd /work/main
OUT=$1; R=${2:-3}; mkdir -p $OUT
TREES="start 3431825 b338726 e080406 1e8a6fd 95638e9 f6ace73 229fb61 5427f11"
for i in $(seq 1 $R); do for t in $TREES; do
  PYTHONPATH=/tmp/tree_$t .venv/bin/python docs/bench/host_overhead.py --steps 300 --json $OUT/${t}_$i.json > /dev/null 2>&1
done; done
.venv/bin/python - $OUT $R $TREES <<'PY'
import json, statistics, sys
out, r, trees = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
keys = ["plain_b1_us", "spec_b1_us", "plain_b8_us", "spec_b8_us"]
for t in trees:
    runs = [json.load(open(f"{out}/{t}_{i}.json")) for i in range(1, r + 1)]
    m = {k: statistics.median(x[k] for x in runs) for k in keys}
    print(t, " ".join(f"{k[:-3]} {v:.1f}" for k, v in m.items()), "| spec/plain b1 %.2f" % (m["spec_b1_us"] / m["plain_b1_us"]),
          "spec/extra %.1f" % ((m["spec_b8_us"] - m["spec_b1_us"]) / 7), "plain/extra %.1f" % ((m["plain_b8_us"] - m["plain_b1_us"]) / 7))
PY
