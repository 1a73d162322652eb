#!/usr/bin/env bash
# Prints a VULKAN_SDK prefix for building sd-worker-vulkan on Debian 12, creating it on first use.
#
# ggml's Vulkan backend (vendored by diffusion-rs-sys) uses VK_EXT_layer_settings from Vulkan-Hpp, which
# Debian 12's headers (1.3.239) predate. Debian 13's libvulkan-dev and spirv-headers carry headers new enough;
# only their include/ trees are unpacked (nothing installed), next to a link to the system's loader, which is
# all the build needs: newer entry points are resolved at run time through the loader.
set -euo pipefail

prefix="${SDHIVE_VULKAN_SDK:-$HOME/.cache/sdhive-vulkan-sdk-trixie}"
if [ -f "$prefix/.complete" ]; then
    echo "$prefix"
    exit 0
fi

loader="$(ls /usr/lib/x86_64-linux-gnu/libvulkan.so.1 2>/dev/null || true)"
[ -n "$loader" ] || { echo "the Vulkan loader (libvulkan1) is not installed" >&2; exit 1; }
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
"$(dirname "$0")/deb-unpack.sh" trixie "$root" libvulkan-dev spirv-headers >&2

rm -rf "$prefix"
mkdir -p "$prefix/lib"
cp -r "$root/usr/include" "$prefix/include"
ln -sf "$loader" "$prefix/lib/libvulkan.so"
touch "$prefix/.complete"
echo "$prefix"
