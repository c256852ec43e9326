#!/usr/bin/env bash
# Build the book: execute every notebook and write the HTML.
#
#   bash scripts/build_book.sh                  # this repository -> _build/html/
#   bash scripts/build_book.sh BOOK_DIR [ARGS]  # another book folder (the tests use this);
#                                               # ARGS go to `jupyter-book build`,
#                                               # e.g. --path-output /tmp/out
#
# The build FAILS (non-zero exit) when a notebook cell raises. That comes from
# _config.yml (execute_notebooks: force + raise_on_error: true): myst-nb then
# aborts the Sphinx build with the cell's traceback. Without raise_on_error,
# jupyter-book only logs a warning and exits 0.
#
# Sphinx warnings fail it too (-W): a chapter listed in _toc.yml whose file is
# missing, a broken {ref}/{term}/{doc} link, and the like. --keep-going lists
# them all before failing instead of stopping at the first. Harmless noise is not a
# Sphinx warning and passes: the kernels' own log lines ("[IPKernelApp]
# WARNING ..."), and what the cells print to stderr, which is shown in the page.
# A warning category that is noise for this book can be silenced with
# `suppress_warnings` under `sphinx: config:` in _config.yml.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BOOK="${1:-$ROOT}"
if [ "$#" -gt 0 ]; then shift; fi
BOOK="$(cd "$BOOK" && pwd)"

cd "$BOOK"

# Silences debugpy's "frozen modules" notice in every kernel's stderr.
export PYDEVD_DISABLE_FILE_VALIDATION=1
# Tells the chapters that no reader's kernel will sit behind these pages:
# tutorial_lib.viz.widget.live_or_static shows the static version of a live-only widget.
export TUTORIAL_BOOK_BUILD=1

jupyter-book build "$BOOK" --all -W --keep-going "$@"

# Where did the HTML go? (--path-output DIR puts it in DIR/_build/html)
OUT="$BOOK"
prev=""
for arg in "$@"; do
    case "$arg" in
        --path-output=*) OUT="${arg#--path-output=}" ;;
    esac
    if [ "$prev" = "--path-output" ]; then OUT="$arg"; fi
    prev="$arg"
done
# One cheat sheet per chapter for slides: a standalone page each, beside the
# chapters (only for this book or a copy of it: another book folder has other chapters).
if [ -f "$BOOK/scripts/cheat_sheets.py" ]; then
    python "$BOOK/scripts/cheat_sheets.py" --out "$OUT/_build/html/cheatsheets" >/dev/null
    echo "Cheat sheets: $(cd "$OUT" && pwd)/_build/html/cheatsheets/index.html"
fi
echo "HTML: $(cd "$OUT" && pwd)/_build/html/index.html"
