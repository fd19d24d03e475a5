#!/usr/bin/env bash
# Put github.com/llm-d/llm-d-router v0.10.0 where picker/go.mod's replace
# directive expects it (<repo>/.cache/llm-d-router@v0.10.0, git-ignored).
#
# Why a replace at all: the Go module proxy reachable from moerl's dev/CI
# machines answers 403 "This module version is not available" for every
# version of github.com/llm-d/llm-d-router (its dependencies are served fine),
# and github.com itself is not reachable. The replace keeps the pin exact
# (tag v0.10.0, commit below) while letting the source come from wherever it
# can: LLMD_ROUTER_SRC (a checkout or git mirror), the module proxy, or git.
set -euo pipefail
VERSION=v0.10.0
COMMIT=71f4f0999f95b96c49a9d0c4afbd18dfdb943c26
here=$(cd "$(dirname "$0")" && pwd)
dest="$here/../../../.cache/llm-d-router@$VERSION"
[ -f "$dest/go.mod" ] && { echo "llm-d-router $VERSION already at $dest"; exit 0; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [ -n "${LLMD_ROUTER_SRC:-}" ] && git -C "$LLMD_ROUTER_SRC" rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1; then
  git -C "$LLMD_ROUTER_SRC" archive "$COMMIT" | tar -x -C "$tmp"
elif dir=$(cd "$tmp" && GOFLAGS=-mod=mod go mod download -json "github.com/llm-d/llm-d-router@$VERSION" 2>/dev/null | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p') && [ -n "$dir" ]; then
  cp -r "$dir"/. "$tmp"/ && chmod -R u+w "$tmp"
elif git clone -q --depth 1 --branch "$VERSION" https://github.com/llm-d/llm-d-router "$tmp/src" 2>/dev/null; then
  [ "$(git -C "$tmp/src" rev-parse HEAD)" = "$COMMIT" ] || { echo "tag $VERSION is not $COMMIT" >&2; exit 1; }
  rm -rf "$tmp/src/.git" && mv "$tmp/src"/* "$tmp"/ && rmdir "$tmp/src" 2>/dev/null || true
else
  echo "cannot get github.com/llm-d/llm-d-router $VERSION: proxy refuses it (403), github unreachable;" >&2
  echo "set LLMD_ROUTER_SRC to a git checkout/mirror holding commit $COMMIT" >&2
  exit 2
fi
mkdir -p "$(dirname "$dest")" && rm -rf "$dest" && mv "$tmp" "$dest" && trap - EXIT
echo "llm-d-router $VERSION at $dest"
