#!/usr/bin/env bash
# Installs the Debian packages dspark builds against. Idempotent: packages that
# are already installed are left alone and apt is not touched at all then.
set -euo pipefail
packages=(
  build-essential cmake pkg-config git
  libopenblas-dev          # CPU GEMM
  libpcre2-dev             # tokenizer pre-split regex (UTF-8, Unicode classes)
  libutf8proc-dev          # tokenizer NFC normalizer
  nlohmann-json3-dev       # config.json, tokenizer.json, safetensors headers
  libcli11-dev             # the dspark command line
  libcpp-httplib-dev       # the HTTP server
  libgtest-dev libgmock-dev libbenchmark-dev
  libzstd-dev
  libplplot-dev plplot-driver-cairo  # PNG plots (reliability diagrams, throughput sweeps)
  python3                  # plotting and small tools
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
