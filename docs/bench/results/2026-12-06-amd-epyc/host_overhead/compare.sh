#!/bin/bash
# compare.sh OUT R: R interleaved runs of docs/bench/host_overhead.py (default 300 steps) on two
# engines, each a whole `git archive` of its commit in /tmp (the specdec.drafters / verifiers /
# controllers / training packages linked inside it, so nothing comes from the editable install's
# checkout), then the medians. before = e221eb9, after = e5a2691.
set -e
OUT=$1; R=${2:-7}; mkdir -p $OUT
for t in before:e221eb9 after:e5a2691; do
  name=${t%%:*}; commit=${t##*:}; D=/tmp/ho_$name; rm -rf $D; mkdir -p $D
  git -C /work/main archive $commit | tar -x -C $D
  cp /work/main/specdec/_cpu_kernels.cpython-311-x86_64-linux-gnu.so $D/specdec/
  for p in drafters verifiers controllers training; do ln -s ../$p $D/specdec/$p; done
done
for i in $(seq 1 $R); do for t in before after; do
  (cd /tmp && PYTHONPATH=/tmp/ho_$t /work/main/.venv/bin/python /tmp/ho_$t/docs/bench/host_overhead.py \
     --json $OUT/${t}_$i.json > /dev/null 2>&1)
done; done
/work/main/.venv/bin/python - $OUT $R <<'PY'
import json, statistics, sys
out, r = sys.argv[1], int(sys.argv[2])
keys = ["plain_b1_us", "spec_b1_us", "plain_b8_us", "spec_b8_us"]
for t in ("before", "after"):
    runs = [json.load(open(f"{out}/{t}_{i}.json")) for i in range(1, r + 1)]
    m = {k: statistics.median(x[k] for x in runs) for k in keys}
    print(t, " ".join(f"{k[:-3]} {v:.1f}" for k, v in m.items()),
          "| spec/plain b1 %.2f" % (m["spec_b1_us"] / m["plain_b1_us"]),
          "spec per extra request %.1f" % ((m["spec_b8_us"] - m["spec_b1_us"]) / 7),
          "plain per extra request %.1f" % ((m["plain_b8_us"] - m["plain_b1_us"]) / 7))
PY
