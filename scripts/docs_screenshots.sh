#!/usr/bin/env bash
# Look at the built site in a real browser: headless Chromium (Debian's package: apt-get install chromium) opens the
# index, the HeteroRL page and the configuration reference from disk and saves a PNG of each.
# Usage: bash scripts/docs_screenshots.sh [OUT_DIR]   (builds the site first with scripts/docs.sh; OUT_DIR defaults
# to docs/_build/screenshots). Not part of CI: it needs a browser, which a fresh machine does not have.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/docs/_build/screenshots}"
browser="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if [ -z "$browser" ]; then
  echo "no Chromium found: apt-get install chromium (or set CHROMIUM=/path/to/chrome)" >&2
  exit 2
fi
bash "$root/scripts/docs.sh"
mkdir -p "$out"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
shoot() {  # page (under docs/_build/html), PNG name, window height
  # offline and quiet: no background networking, no component updates, a fresh profile, no sandbox (root)
  "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
    --user-data-dir="$profile" --window-size="1400,$3" --screenshot="$out/$2" \
    "file://$root/docs/_build/html/$1" 2>/dev/null
  echo "$out/$2"
}
shoot index.html index.png 1100
shoot hetero.html hetero.png 1600
shoot reference/config.html config-reference.png 1600
