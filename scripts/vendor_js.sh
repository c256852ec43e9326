#!/usr/bin/env bash
# Re-create _static/vendor/: the JavaScript the built book needs, so that its
# pages never fetch anything from a CDN (the book must work without internet).
#
#   requirejs/require.mjs            require.js (AMD loader used by the widget manager)
#   requirejs/widgets-paths.mjs      written here: tells require.js where embed-amd lives
#   html-manager/embed-amd.mjs       renders saved ipywidgets state in static pages
#   html-manager/*.woff2 ...         Font Awesome fonts that embed-amd references
#   mathjax/startup.mjs ...          MathJax 3: the loader and the components this book
#                                    uses (TeX base + ams, CHTML output), one file each
#   mathjax/output/chtml/fonts/...   MathJax's CHTML fonts
#
# Why `.mjs`: Jupyter Book 1.x adds every `_static/**/*.js` file as a <script>
# to every page. These files must only be loaded where they are needed
# (myst-nb adds the widget scripts to pages with widget state, Sphinx adds
# MathJax to pages with math; see _config.yml), so they are stored under a
# name that does not end in `.js`. `.mjs` is served as text/javascript by
# Python's http.server and every common web server; the pages load them as
# ordinary (classic, non-module) scripts.
#
# Why embed-amd is enough offline: html-manager's dist/embed-amd.js is one
# bundle that defines the AMD modules @jupyter-widgets/base, base7, controls,
# controls7 and html-manager itself; HTMLManager.loadClass() resolves
# @jupyter-widgets/base and /controls (ipywidgets 8 and 7 state) and /output
# from that bundle, and uses requirejs + the CDN attribute only for other
# (custom) widget libraries. ipywidgets 8.x pairs with html-manager ^1.0.
#
# Why MathJax in pieces: its combined bundles carry what this book never uses (the
# 420 kB context menu, MathML input, every TeX extension in -full: 1.3 MB). The book's
# formulas need TeX's base and ams packages only, so startup.mjs loads exactly the
# components that _config.yml lists (mathjax3_config.loader: `load` names them, `source`
# maps each name to its .mjs file here): 0.75 MB in all. noundefined shows an unknown
# macro in red instead of failing the formula (tests/book checks that none shows).
#
# Needs npm (talks to the npm registry only). The result is committed, so a
# book build never needs the network. Run from anywhere:
#   bash scripts/vendor_js.sh
set -euo pipefail

HTML_MANAGER_VERSION="1.0.15"   # @jupyter-widgets/html-manager
REQUIREJS_VERSION="2.3.8"       # requirejs
MATHJAX_VERSION="3.2.2"         # mathjax (last 3.x; Sphinx 7 targets MathJax 3)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/_static/vendor"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

cd "$WORK"
npm pack --silent \
    "@jupyter-widgets/html-manager@${HTML_MANAGER_VERSION}" \
    "requirejs@${REQUIREJS_VERSION}" \
    "mathjax@${MATHJAX_VERSION}" >/dev/null
mkdir hm rq mj
tar xzf "jupyter-widgets-html-manager-${HTML_MANAGER_VERSION}.tgz" -C hm
tar xzf "requirejs-${REQUIREJS_VERSION}.tgz" -C rq
tar xzf "mathjax-${MATHJAX_VERSION}.tgz" -C mj

# Refuse a widget bundle that does not carry the standard widget modules itself.
for mod in '@jupyter-widgets/base' '@jupyter-widgets/controls' '@jupyter-widgets/html-manager'; do
    grep -q "define(\"${mod}\"" hm/package/dist/embed-amd.js \
        || { echo "embed-amd.js does not define ${mod}: cannot render widgets offline" >&2; exit 1; }
done

# Assemble in a staging folder, then swap it in: a failure leaves the old copy.
STAGE="$WORK/vendor"
mkdir -p "$STAGE/html-manager" "$STAGE/requirejs" "$STAGE/mathjax/output/chtml/fonts"

# html-manager: the AMD bundle plus the font files it references.
cp hm/package/dist/embed-amd.js "$STAGE/html-manager/embed-amd.mjs"
for ext in woff2 woff ttf eot svg; do
    cp hm/package/dist/*."$ext" "$STAGE/html-manager/"
done
cp hm/package/dist/embed.js.LICENSE.txt "$STAGE/html-manager/THIRD-PARTY-NOTICES.txt"

# require.js (the npm package ships it unminified at its root)
cp rq/package/require.js "$STAGE/requirejs/require.mjs"

# The bundle's modules find their font files from their AMD module URL, which
# require.js derives from the page's folder (e.g. notebooks/@jupyter-widgets/...),
# so every icon font would 404. Map the module names to the vendored folder.
# Loaded between require.mjs and embed-amd.mjs (nb_ipywidgets_js in _config.yml).
cat > "$STAGE/requirejs/widgets-paths.mjs" <<'JS'
// Written by scripts/vendor_js.sh. Runs after require.js, before embed-amd:
// resolve @jupyter-widgets/* AMD modules (and so their fonts) in the vendored
// html-manager folder next to this one, whatever folder the page is in.
(function () {
  var self = document.currentScript;
  if (!self || typeof requirejs === "undefined") { return; }
  var dir = new URL("../html-manager", self.src).href;
  requirejs.config({
    paths: {
      "@jupyter-widgets": dir,
      "@jupyter-widgets/html-manager/dist": dir
    }
  });
})();
JS

# MathJax: the loader, the components _config.yml names, and the fonts CHTML loads from
# [mathjax]/output/chtml/fonts/woff-v2.
for component in startup core input/tex-base input/tex/extensions/ams \
        input/tex/extensions/noundefined output/chtml output/chtml/fonts/tex a11y/assistive-mml; do
    mkdir -p "$STAGE/mathjax/$(dirname "$component")"
    cp "mj/package/es5/$component.js" "$STAGE/mathjax/$component.mjs"
done
cp -r mj/package/es5/output/chtml/fonts/woff-v2 "$STAGE/mathjax/output/chtml/fonts/"
cp mj/package/LICENSE "$STAGE/mathjax/LICENSE"

cat > "$STAGE/VERSIONS.txt" <<TXT
Made by scripts/vendor_js.sh from the npm registry. Do not edit by hand: change
the versions in that script and run it again.

@jupyter-widgets/html-manager ${HTML_MANAGER_VERSION}   BSD-3-Clause (Jupyter Development Team)
    html-manager/embed-amd.mjs  = dist/embed-amd.js
    html-manager/*.woff2 ...    = Font Awesome Free fonts it references (SIL OFL 1.1)
    html-manager/THIRD-PARTY-NOTICES.txt = licences of the code bundled into it
requirejs ${REQUIREJS_VERSION}   MIT
    requirejs/require.mjs       = require.js (licence in its header)
    requirejs/widgets-paths.mjs = written by the script (module paths for embed-amd)
mathjax ${MATHJAX_VERSION}   Apache-2.0
    mathjax/<component>.mjs     = es5/<component>.js for startup, core, input/tex-base,
                                  input/tex/extensions/{ams,noundefined}, output/chtml,
                                  output/chtml/fonts/tex, a11y/assistive-mml
    mathjax/output/chtml/fonts/woff-v2/ = es5/output/chtml/fonts/woff-v2/

The scripts are named .mjs so that Jupyter Book does not add them to every page
(it adds every _static/**/*.js); they are classic scripts, not ES modules.
TXT

rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$STAGE" "$DEST"

echo "vendored into $DEST ($(du -sh "$DEST" | cut -f1)):"
(cd "$DEST" && find . -type f | sort)
