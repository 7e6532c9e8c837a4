#!/usr/bin/env bash
# Stage here, for tests/gpu/run.sh's "real" phase on the GPU machine, what it needs and cannot
# fetch there (no network): SmolLM2-135M-Instruct's model folder (the GGUF, its config and
# tokenizer, as specdec caches them) and MT-Bench's prompts, under .gpu/ (git-ignored). The
# folder is ~100 MB, over one device call's 64 MiB: it goes in parts, .gpu/p1 .. .gpu/pN (each
# one call's carry on a warm machine), joined there by `bash tests/gpu/stage_real.sh join`.
#     bash tests/gpu/stage_real.sh            # here: fetch (or reuse the cache), split
#     bash tests/gpu/stage_real.sh join       # there: the parts back into .gpu/cache
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MB=${PART_MB:-42}
if [[ "${1:-}" == "join" ]]; then
  mkdir -p .gpu/cache/models
  cat .gpu/p*/part.* | tar -x -C .gpu/cache/models
  ls -la .gpu/cache/models/*
  exit 0
fi
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
folder=$("$PY" -c "from specdec.models.loader import resolve_model_path as r; print(r('smollm2-135m-instruct'))")
rm -rf .gpu && mkdir -p .gpu/meta
python3 - "$(dirname "$0")/../../../shared/data/eval/mt_bench.jsonl" .gpu/meta/mt_bench.jsonl <<'PY'
import shutil, sys
shutil.copy(sys.argv[1], sys.argv[2])
PY
tar -C "$(dirname "$folder")" -c "$(basename "$folder")" | split -b "${PART_MB}m" -d - .gpu/part.
i=1
for f in .gpu/part.*; do mkdir -p ".gpu/p$i" && mv "$f" ".gpu/p$i/"; i=$((i + 1)); done
du -sh .gpu/* && echo "carry .gpu/meta and .gpu/p1 .. .gpu/p$((i - 1)), one or more a call"
