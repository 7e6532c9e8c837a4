#!/bin/bash
# before (/tmp/before: the tree at 6563c85, the new proxy's commit) and after (this tree), interleaved
cd /work/main
OUT=$1; R=${2:-5}
mkdir -p $OUT
for i in $(seq 1 $R); do
  PYTHONPATH=/tmp/before .venv/bin/python docs/bench/host_overhead.py --steps 300 --json $OUT/before_$i.json > /dev/null 2>&1
  .venv/bin/python docs/bench/host_overhead.py --steps 300 --json $OUT/after_$i.json > /dev/null 2>&1
done
for i in $(seq 1 3); do
  PYTHONPATH=/tmp/before .venv/bin/python docs/bench/host_overhead.py --steps 300 --stub forward --json $OUT/fwd_before_$i.json > /dev/null 2>&1
  .venv/bin/python docs/bench/host_overhead.py --steps 300 --stub forward --json $OUT/fwd_after_$i.json > /dev/null 2>&1
done
