#!/usr/bin/env bash
# Repoints citations of files outside the repository to their places inside it:
#   the blueprint DESIGN[.]md (any path)      -> docs/design.md   (same section numbers)
#   notes/anchors[.]md (Mooncake/vLLM facts)  -> docs/design.md §9
#   notes/softroce[.]md (soft-RoCE recipe)    -> tests/softroce/README.md
# in every tracked or untracked-but-not-ignored text file of the repo (code comments, docs,
# scripts). Idempotent. `--check` only lists what it would change (exit 1 if anything).
#
#   bash scripts/repoint-design-citations.sh [--check] [REPO_DIR]
#
# scripts/test-all.sh fails when a citation outside the repo is left (its "citations" step).
set -euo pipefail

check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
cd "${1:-$(dirname "$0")/..}"

# The patterns are spelled with [.] so that this file does not match itself.
sed_script=(
    # a path before the blueprint's name goes with it: /work/shared/, ../shared/, shared/
    -e 's#\(/work/shared/\|\(\.\./\)\{1,\}shared/\|shared/\)\{0,1\}DESIGN[.]md#docs/design.md#g'
    -e 's#\(/work/shared/\|\(\.\./\)\{1,\}shared/\|shared/\)\{0,1\}notes/anchors[.]md#docs/design.md §9#g'
    -e 's#\(/work/shared/\|\(\.\./\)\{1,\}shared/\|shared/\)\{0,1\}notes/softroce[.]md#tests/softroce/README.md#g'
)
pattern='DESIGN[.]md|notes/anchors[.]md|notes/softroce[.]md'

changed=0
while IFS= read -r -d '' f; do
    case "$f" in
        scripts/repoint-design-citations.sh) continue ;;
        *.rs|*.md|*.py|*.sh|*.cu|*.toml|*.txt|*.yml|*.yaml|.ci/*) ;;
        *) continue ;;
    esac
    [ -f "$f" ] || continue
    grep -qE "$pattern" "$f" || continue
    changed=1
    if [ "$check" = 1 ]; then
        grep -nE "$pattern" "$f" | sed "s#^#$f:#"
    else
        sed -i "${sed_script[@]}" "$f"
        echo "repointed: $f"
    fi
done < <(git ls-files -z --cached --others --exclude-standard)

if [ "$check" = 1 ] && [ "$changed" = 1 ]; then exit 1; fi
exit 0
