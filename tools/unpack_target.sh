#!/usr/bin/env bash
# Reassembles a target LM brought back from the device machine (the files
# tools/pretrain_target.sh left in $OUT) into models/<name>/, after checking
# every part and the whole archive against SHA256SUMS.
#   tools/unpack_target.sh FILES_DIR          e.g. the run's files_at folder
set -euo pipefail
source_dir=$(cd "${1:?usage: tools/unpack_target.sh FILES_DIR}" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
sums="$source_dir/SHA256SUMS"
[ -f "$sums" ] || { echo "unpack_target: no SHA256SUMS in $source_dir" >&2; exit 1; }
archive_line=$(grep -E '\.tar$' "$sums")
name=$(basename "$(echo "$archive_line" | awk '{print $2}')" .tar)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$source_dir" && grep -v -E '\.tar$' SHA256SUMS | sha256sum --check --quiet)
cat "$source_dir/$name".tar.part-* > "$work/$name.tar"
(cd "$work" && echo "$archive_line" | sha256sum --check --quiet)
mkdir -p "$work/extract" "$repo/models"
tar -xf "$work/$name.tar" -C "$work/extract"
[ -f "$work/extract/$name/config.json" ] || { echo "unpack_target: $name.tar holds no $name/config.json" >&2; exit 1; }
[ -f "$source_dir/report.json" ] && cp "$source_dir/report.json" "$work/extract/$name/pretrain_report.json"
rm -rf "$repo/models/$name.old"
[ -d "$repo/models/$name" ] && mv "$repo/models/$name" "$repo/models/$name.old"
mv "$work/extract/$name" "$repo/models/$name"
rm -rf "$repo/models/$name.old"
echo "unpack_target: models/$name:"
ls -la "$repo/models/$name"
