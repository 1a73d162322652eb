#!/usr/bin/env bash
# Prints the path of a Vulkan ICD manifest for Mesa's lavapipe from bookworm-backports, creating it on first use.
#
# Debian 12's own lavapipe (Mesa 22.3) corrupts the heap within a few UNet calls of ggml's Vulkan kernels;
# bookworm-backports' Mesa 25 computes them correctly. Only its lavapipe library is unpacked (nothing
# installed), next to a manifest naming it by absolute path; it links Debian 12's libLLVM-15, which the
# distribution's mesa-vulkan-drivers package brings in.
set -euo pipefail

prefix="${SDHIVE_LAVAPIPE:-$HOME/.cache/sdhive-lavapipe-bookworm-backports}"
if [ -f "$prefix/.complete" ]; then
    echo "$prefix/lvp_icd.json"
    exit 0
fi

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
version="$("$(dirname "$0")/deb-unpack.sh" bookworm-backports "$root" mesa-vulkan-drivers)"
lib="$root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"
[ -f "$lib" ] || { echo "mesa-vulkan-drivers from bookworm-backports has no libvulkan_lvp.so" >&2; exit 1; }
api="$(sed -n 's/.*"api_version": *"\([0-9.]*\)".*/\1/p' "$root/usr/share/vulkan/icd.d/lvp_icd.json")"

rm -rf "$prefix"
mkdir -p "$prefix"
cp "$lib" "$prefix/"
echo "$version" > "$prefix/version"
cat > "$prefix/lvp_icd.json" <<JSON
{"file_format_version": "1.0.0", "ICD": {"library_path": "$prefix/libvulkan_lvp.so", "api_version": "${api:-1.3.0}"}}
JSON
touch "$prefix/.complete"
echo "$prefix/lvp_icd.json"
