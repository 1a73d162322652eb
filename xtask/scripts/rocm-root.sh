#!/usr/bin/env bash
# Prints the path of a Debian sid root that holds ROCm's HIP compiler and libraries, making it first when it is
# missing. Debian 12 has no hipBLAS/rocBLAS; sid carries ROCm 6.4 (hipcc on clang-21), whose tools need sid's glibc,
# so `cargo xtask rocm` builds sd-worker-rocm inside this root (debootstrap + chroot) with the host's Rust toolchain
# and cargo registry bind-mounted. The root lives outside the clone and is reused while its package list is the one
# below; it is only a cache: a fresh machine makes it again (about 1.3 GB of packages).
#
# rocBLAS's GEMM kernels (its Tensile library, 3.9 GB installed) are left out by a dpkg path filter: linking needs
# only the shared library, and nothing runs on an AMD GPU here.
set -euo pipefail

root="${SDHIVE_ROCM_ROOT:-$HOME/.cache/sdhive/rocm-sid}"
packages=(ca-certificates gcc g++ libc6-dev cmake ninja-build pkg-config libclang-dev clang-21
    hipcc libamdhip64-dev libhipblas-dev librocblas-dev rocm-cmake rocm-device-libs-21)
stamp="$root/.sdhive-root"
want="sid ${packages[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "$root"
    exit 0
fi

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if ! command -v debootstrap >/dev/null 2>&1; then
    $sudo apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends debootstrap >&2
fi

$sudo rm -rf "$root"
$sudo mkdir -p "$root/etc/dpkg/dpkg.cfg.d"
echo 'path-exclude=/usr/lib/x86_64-linux-gnu/rocblas/*/library/*' | $sudo tee "$root/etc/dpkg/dpkg.cfg.d/sdhive-no-tensile" >/dev/null
echo 'path-exclude=/usr/share/doc/*' | $sudo tee "$root/etc/dpkg/dpkg.cfg.d/sdhive-no-doc" >/dev/null
$sudo debootstrap --variant=minbase sid "$root" http://deb.debian.org/debian >&2
# The registry's sid may be a frozen snapshot whose Release file is past its Valid-Until date.
$sudo chroot "$root" apt-get -o Acquire::Check-Valid-Until=false update -q >&2
$sudo env DEBIAN_FRONTEND=noninteractive chroot "$root" \
    apt-get install -y -q --no-install-recommends "${packages[@]}" >&2
$sudo chroot "$root" apt-get clean >&2
echo "$want" | $sudo tee "$stamp" >/dev/null
echo "$root"
