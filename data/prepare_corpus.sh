#!/usr/bin/env bash
# Prepare several named sources for a blended data mixture, one .bin/.idx prefix per source.
#
#   data/prepare_corpus.sh OUT_DIR TOKENIZER NAME=INPUT[,INPUT...] [NAME=INPUT...]
#
# TOKENIZER is "byte" or a Hugging Face tokenizer.json. INPUTs are text files, .jsonl files or
# directories (see data/README.md). Extra flags for `moe-lc prepare-data` (e.g. --json-key content)
# can be passed in the PREPARE_FLAGS environment variable.
set -euo pipefail

if [[ $# -lt 3 ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
out_dir=$1
tokenizer=$2
shift 2
mkdir -p "$out_dir"

for source in "$@"; do
    name=${source%%=*}
    inputs=${source#*=}
    if [[ "$name" == "$source" || -z "$name" || -z "$inputs" ]]; then
        echo "error: expected NAME=INPUT[,INPUT...], got '$source'" >&2
        exit 2
    fi
    IFS=',' read -r -a paths <<< "$inputs"
    echo "== $name"
    # shellcheck disable=SC2086
    moe-lc prepare-data "${paths[@]}" --output-prefix "$out_dir/$name" --tokenizer "$tokenizer" ${PREPARE_FLAGS:-}
done

echo
echo "prefixes (give each a weight in the data mixture):"
for source in "$@"; do
    echo "  $out_dir/${source%%=*}"
done
