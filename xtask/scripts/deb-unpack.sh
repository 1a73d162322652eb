#!/usr/bin/env bash
# Downloads Debian packages from another suite and unpacks them (dpkg -x) into a directory, installing nothing:
# the machine's own packages and apt state stay as they are.
#   deb-unpack.sh SUITE DEST PACKAGE...   (DEST/usr/... afterwards; the packages' versions on stdout)
set -euo pipefail

suite="$1"
dest="$2"
shift 2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$dest"
echo "deb http://deb.debian.org/debian $suite main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -q >&2
(cd "$work/debs" && apt-get "${apt_opts[@]}" download "$@" >&2)
for deb in "$work"/debs/*.deb; do
    dpkg -x "$deb" "$dest"
    dpkg-deb -f "$deb" Package Version | sed 's/^[^:]*: //' | paste -sd' '
done
