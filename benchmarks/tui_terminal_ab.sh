#!/usr/bin/env bash
# The TUI in a real terminal, before and after: `python -m benchmarks.tui_terminal` on
# BASE's app (default: where this branch left main) and on this tree's, in alternation, ROUNDS times each (default 2).
# BASE's tree is exported to a temporary folder with this tree's bench harness laid over it
# (benchmarks/tui_headless.py and tui_terminal.py), so both run the same measurement.
#   benchmarks/tui_terminal_ab.sh [BASE] [ROUNDS] [--terminal headless,pty,tmux ...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
base=${1:-$(git -C "$here" merge-base main HEAD)}; rounds=${2:-2}; shift $(( $# < 2 ? $# : 2 ))
python=${PYTHON:-$here/.venv/bin/python}
[ -x "$python" ] || python=$(command -v python3)
before=$(mktemp -d /tmp/paged-chat-ab-XXXXXX)
trap 'rm -rf "$before"' EXIT
git -C "$here" archive "$base" | tar -x -C "$before"
mkdir -p "$before/benchmarks"
cp "$here/benchmarks/__init__.py" "$here/benchmarks/tui_headless.py" "$here/benchmarks/tui_terminal.py" "$before/benchmarks/"
for round in $(seq "$rounds"); do
  for side in before after; do
    tree=$([ "$side" = before ] && echo "$before" || echo "$here")
    echo "== $side ($([ "$side" = before ] && echo "$base" || git -C "$here" rev-parse --short HEAD)), round $round/$rounds; $(uptime)"
    (cd "$tree" && PYTHONPATH="$tree" HF_HUB_OFFLINE=1 "$python" -m benchmarks.tui_terminal \
       --rounds 1 "$@" 2>/dev/null)
  done
done
