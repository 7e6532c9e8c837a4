#!/bin/bash
# compare.sh OUT R BASE AFTER FILES...: R interleaved runs of docs/bench/host_overhead.py on
# before = AFTER's tree with FILES as they were at BASE (AFTER without this work's commits) and
# after = AFTER's tree; each a whole `git archive` in /tmp; then the medians.
set -e
OUT=$1; R=$2; BASE=$3; AFTER=$4; shift 4; mkdir -p $OUT
for name in before after; do
  D=/tmp/ho_$name; rm -rf $D; mkdir -p $D
  git -C /work/main archive $AFTER | tar -x -C $D
  cp /work/main/specdec/_cpu_kernels.cpython-311-x86_64-linux-gnu.so $D/specdec/
  for p in drafters verifiers controllers training; do [ -e $D/specdec/$p ] || ln -s ../$p $D/specdec/$p; done
done
for f in "$@"; do git -C /work/main show $BASE:$f > /tmp/ho_before/$f; done
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
    print("  per-run spec/plain b1:", " ".join("%.2f" % (x["spec_b1_us"]/x["plain_b1_us"]) for x in runs))
PY
