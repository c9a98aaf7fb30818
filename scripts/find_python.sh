#!/usr/bin/env bash
# Prints the path of a CPython interpreter of version $1 (e.g. 3.12): on PATH as python3.12, else the
# newest pyenv build of it. Exits 1 when there is none.
set -euo pipefail
v=$1
if command -v "python$v" >/dev/null && "python$v" -c "import sys; assert sys.implementation.name == 'cpython'" 2>/dev/null; then
    command -v "python$v"
    exit 0
fi
root=${PYENV_ROOT:-$HOME/.pyenv}
for dir in $(ls -d "$root"/versions/"$v".* 2>/dev/null | sort -V -r); do
    if [ -x "$dir/bin/python$v" ]; then
        echo "$dir/bin/python$v"
        exit 0
    fi
done
exit 1
