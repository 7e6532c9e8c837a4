#!/usr/bin/env bash
# The device tool sends the working tree (tracked + untracked-not-ignored files + carried paths)
# and refuses more than 64 MiB. The shipped drafters are 70 MB and the GPU check needs none of
# them, so around a device call they leave the index (files stay on disk) and are ignored:
#     bash tests/gpu/slim_tree.sh on     # before the device call (size printed)
#     bash tests/gpu/slim_tree.sh off    # right after it: back in the index, nothing changed
# Never commit while it is on (the commit would delete the shipped drafters).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=.git/info/exclude
mkdir -p .git/info && touch "$exclude"
case "${1:-}" in
  on)
    git rm -r -q --cached drafters/shipped
    grep -qx '/drafters/shipped/' "$exclude" || echo '/drafters/shipped/' >> "$exclude"
    bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb \
      | tail -n 1 | cut -f1)
    wheels=$( (du -cb .whl 2>/dev/null || true) | tail -n 1 | cut -f1)
    echo "travels: $((bytes / 1048576)) MiB tree + $((wheels / 1048576)) MiB .whl (limit 64 MiB)"
    ;;
  off)
    sed -i '\#^/drafters/shipped/$#d' "$exclude"
    git add drafters/shipped
    git status --short drafters/shipped | head -n 3
    ;;
  *) echo "usage: $0 on|off" >&2; exit 2 ;;
esac
