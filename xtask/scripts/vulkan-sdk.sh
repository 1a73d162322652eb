#!/usr/bin/env bash
# Prints a VULKAN_SDK prefix for building sd-worker-vulkan on Debian 12, creating it on first use.
#
# ggml's Vulkan backend (vendored by diffusion-rs-sys) uses VK_EXT_layer_settings from Vulkan-Hpp, which
# Debian 12's headers (1.3.239) predate. Debian 13's libvulkan-dev and spirv-headers carry headers new enough;
# only their include/ trees are unpacked (dpkg -x, nothing installed), next to a link to the system's loader,
# which is all the build needs: newer entry points are resolved at run time through the loader.
set -euo pipefail

prefix="${SDHIVE_VULKAN_SDK:-$HOME/.cache/sdhive-vulkan-sdk-trixie}"
if [ -f "$prefix/.complete" ]; then
    echo "$prefix"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb http://deb.debian.org/debian trixie main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -q >&2
(cd "$work/debs" && apt-get "${apt_opts[@]}" download libvulkan-dev spirv-headers >&2)

rm -rf "$prefix"
mkdir -p "$prefix/lib"
for deb in "$work"/debs/*.deb; do
    dpkg -x "$deb" "$work/root"
done
cp -r "$work/root/usr/include" "$prefix/include"
loader="$(ls /usr/lib/x86_64-linux-gnu/libvulkan.so.1 2>/dev/null || true)"
[ -n "$loader" ] || { echo "the Vulkan loader (libvulkan1) is not installed" >&2; exit 1; }
ln -sf "$loader" "$prefix/lib/libvulkan.so"
touch "$prefix/.complete"
echo "$prefix"
