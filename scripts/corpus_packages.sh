#!/usr/bin/env bash
# Installs the Debian documentation packages whose text tools/corpus.py gathers
# beside what a development machine already has (Python sources, C/C++ headers,
# man pages). Every package is from Debian main (DFSG-free); GFDL-with-invariants
# manuals (gcc-doc, make-doc, glibc-doc-reference, in non-free) are left out on
# purpose. Idempotent: nothing is touched when all are installed.
set -euo pipefail
packages=(
  python3.11-doc       # Python's own HTML documentation (PSF licence)
  python-django-doc    # Django's HTML documentation (BSD)
  postgresql-doc-15    # PostgreSQL's HTML manual (PostgreSQL licence)
  sqlite3-doc          # SQLite's HTML documentation (public domain)
  git-doc              # Git's user manual and guides (GPL-2)
  perl-doc             # perlfunc, perlre, ... as man pages (Artistic or GPL)
  bash-doc             # the Bash reference manual (GPL-3)
  debian-reference-en  # the Debian Reference (GPL-2 or later)
  manpages-dev         # Linux man pages of sections 2 and 3 (various free licences)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "corpus_packages: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
