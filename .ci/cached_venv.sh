#!/usr/bin/env bash
# cached_venv NAME PIP_SPEC...: print the path of a venv that holds PIP_SPEC, built once and
# reused by later CI runs on this machine while the spec is unchanged.
#
# The key is the exact spec: the python version, NAME's pip arguments and pyproject.toml's
# dependency tables (what `-e .[extras]` resolves from). A changed spec builds a new venv and
# removes the old one. The venv lives outside the clone (venvs are not relocatable) under
# $AGILE_LLMENVS_CI_VENVS (default ~/.cache/agile-llmenvs-ci); a build that did not finish has
# no `.complete` marker and is rebuilt. The project itself is re-installed editable (--no-deps)
# from the current clone on every call, so a cached venv always runs this checkout's code.
#
# Each PIP_SPEC argument is one `pip install` line (its words split on spaces); a line starting
# with `uninstall ` runs `pip uninstall -y` instead.
set -euo pipefail -f  # -f: the pip lines hold brackets, not globs
name=$1
shift
root=${AGILE_LLMENVS_CI_VENVS:-$HOME/.cache/agile-llmenvs-ci}
mkdir -p "$root"
key=$(
    {
        python3 --version
        printf '%s\n' "$@"
        python3 - <<'PY'
import json, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(json.dumps([project["dependencies"], project.get("optional-dependencies", {})], sort_keys=True))
PY
    } | sha256sum | cut -c1-16
)
venv="$root/$name-$key"
if [ ! -f "$venv/.complete" ]; then
    echo "cached_venv: building $name ($key)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -U "setuptools>=69"
    for line in "$@"; do
        # shellcheck disable=SC2086  # one pip line's words
        case $line in
        uninstall\ *) "$venv/bin/pip" uninstall -q -y ${line#uninstall } || true ;;
        *) "$venv/bin/pip" install -q $line ;;
        esac
    done
    touch "$venv/.complete"
    set +f  # the glob below must expand (set -f kept the old venvs forever)
    for old in "$root/$name"-*; do
        [ "$old" = "$venv" ] || rm -rf "$old"
    done
    set -f
else
    echo "cached_venv: reusing $name ($key)" >&2
fi
# this clone's code, whatever clone built the venv
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >&2
echo "$venv"
