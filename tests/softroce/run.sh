#!/usr/bin/env bash
# Soft-RoCE harness: boots a QEMU (TCG) guest running Debian's kernel with rdma_rxe,
# chroots into this machine's root (shared read-only over virtio-9p), creates rxe0 on a
# veth pair and runs one host script there. Recipe: tests/softroce/README.md,
# docs/design.md §7.
#
# Usage:  tests/softroce/run.sh [-t TIMEOUT_S] [-o OUTDIR] [-s DIR]... [--] SCRIPT [ARGS...]
#         (or SOFTROCE_SCRIPT=path tests/softroce/run.sh)
# SCRIPT is a host path run with bash inside the guest chroot, in the caller's working
# directory, with the caller's PATH/LD_LIBRARY_PATH/HOME/RUST_*/KVFERRY_*/CARGO_* env.
# Inside, $SOFTROCE_OUT is a writable directory that is OUTDIR on the host (same path),
# $SOFTROCE_IP is rxe0's IPv4 address; the RDMA device is rxe0. The guest has fresh
# tmpfs on /tmp, /var/tmp and /run, which hide the host's files there: the caller's working
# directory and every `-s DIR` (and each directory of $SOFTROCE_SHARES, colon-separated) are
# shared read-only and mounted again at their own paths, so a clone and a target directory
# under /tmp work. SCRIPT itself is copied into OUTDIR, $SOFTROCE_SCRIPT_DIR names its
# original directory.
# Exit status: the script's; non-zero with the guest console printed on any boot
# failure, crash or timeout (default 900 s for the whole QEMU run).
set -euo pipefail

TIMEOUT=${SOFTROCE_TIMEOUT:-900}
OUTDIR=${SOFTROCE_OUTDIR:-}
SCRIPT=${SOFTROCE_SCRIPT:-}
CACHE=${SOFTROCE_CACHE:-/var/tmp/kvferry-softroce}
SHARES=()
IFS=: read -ra _env_shares <<<"${SOFTROCE_SHARES:-}"
for d in "${_env_shares[@]}"; do [ -n "$d" ] && SHARES+=("$d"); done
while [ $# -gt 0 ]; do
    case "$1" in
        -t) TIMEOUT=$2; shift 2 ;;
        -o) OUTDIR=$2; shift 2 ;;
        -s) SHARES+=("$2"); shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n "2,20p" "$0"; exit 0 ;;
        -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -gt 0 ]; then SCRIPT=$1; shift; fi
[ -n "$SCRIPT" ] || { echo "run.sh: no script given (usage: run.sh [--] SCRIPT [ARGS...])" >&2; exit 2; }
SCRIPT=$(realpath "$SCRIPT")
[ -f "$SCRIPT" ] || { echo "run.sh: $SCRIPT is not a file" >&2; exit 2; }

log() { echo "[softroce] $*" >&2; }
die() { echo "[softroce] FAIL: $*" >&2; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

# --- 1. host packages -------------------------------------------------------------
PKGS="qemu-system-x86 busybox-static cpio kmod rdma-core ibverbs-providers ibverbs-utils perftest iproute2"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    log "installing:$missing"
    as_root apt-get install -y $missing >/dev/null 2>&1 || {
        as_root apt-get update >/dev/null
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y $missing >/dev/null
    } || die "could not install$missing"
fi

# --- 2. kernel + modules (Debian's 6.1 kernel has rdma_rxe as a module) ------------
mkdir -p "$CACHE"
KPKG=${SOFTROCE_KERNEL_PKG:-}
if [ -z "$KPKG" ]; then
    # the newest linux-image-6.1.0-N-amd64 the archive offers (older ones vanish from mirrors)
    KPKG=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' 2>/dev/null \
        | awk '{print $1}' | sort -V | tail -1)
    if [ -z "$KPKG" ]; then
        as_root apt-get update >/dev/null || true
        KPKG=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' \
            | awk '{print $1}' | sort -V | tail -1)
    fi
    [ -n "$KPKG" ] || KPKG=$(ls -d "$CACHE"/linux-image-* 2>/dev/null | xargs -rn1 basename | sort -V | tail -1)
fi
[ -n "$KPKG" ] || die "no linux-image-6.1.0-*-amd64 package found with apt-cache"
KVER=${KPKG#linux-image-}
KDIR=$CACHE/$KPKG
if [ ! -f "$KDIR/boot/vmlinuz-$KVER" ]; then
    log "fetching $KPKG"
    tmp=$(mktemp -d "$CACHE/dl.XXXXXX")
    (cd "$tmp" && apt-get download "$KPKG" >/dev/null 2>&1) || die "apt-get download $KPKG failed"
    rm -rf "$KDIR.part"
    dpkg -x "$tmp"/*.deb "$KDIR.part" || die "dpkg -x failed"
    rm -rf "$tmp" "$KDIR"
    mv "$KDIR.part" "$KDIR"
fi
KERNEL=$KDIR/boot/vmlinuz-$KVER
MODDIR=$KDIR/lib/modules/$KVER

# --- 3. initramfs: busybox + modules + init ---------------------------------------
# crc32_generic first: without it rxe cannot init crc32 and `rdma link add` fails.
MODULES="crc32_generic virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
udp_tunnel ip6_udp_tunnel ib_core ib_uverbs rdma_rxe netfs fscache 9pnet 9p 9pnet_virtio veth"
HERE=$(cd "$(dirname "$0")" && pwd)
INITRD=$CACHE/initramfs-$KVER.cpio.gz
stamp=$(cat "$HERE/init.sh" <(echo "$MODULES") | sha256sum | cut -c1-16)
if [ ! -f "$INITRD" ] || [ "$(cat "$INITRD.stamp" 2>/dev/null)" != "$stamp" ]; then
    log "building initramfs for $KVER"
    root=$(mktemp -d)
    mkdir -p "$root"/{bin,proc,sys,dev,host,modules}
    cp /bin/busybox "$root/bin/busybox"
    i=0
    for m in $MODULES; do
        f=$(find "$MODDIR" -name "$m.ko" | head -1)
        [ -n "$f" ] || die "module $m.ko not in $KPKG"
        i=$((i + 1))
        cp "$f" "$root/modules/$(printf %02d "$i")-$m.ko"
    done
    cp "$HERE/init.sh" "$root/init"
    chmod +x "$root/init" "$root/bin/busybox"
    (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$INITRD.part"
    rm -rf "$root"
    mv "$INITRD.part" "$INITRD"
    echo "$stamp" >"$INITRD.stamp"
fi

# --- 4. the run directory (writable share) and the guest-side wrapper ---------------
if [ -z "$OUTDIR" ]; then OUTDIR=$(mktemp -d /tmp/softroce-run.XXXXXX); fi
mkdir -p "$OUTDIR"
OUTDIR=$(realpath "$OUTDIR")
rm -f "$OUTDIR"/{rc,guest.log,console.log,guest.sh,script.sh,shares}
# Host directories the guest mounts again at their own paths (init.sh): the working
# directory and the -s directories, parents first, none inside another, at most 16.
share_args=()
share_dirs=()
candidates=()
for d in "$PWD" "${SHARES[@]}"; do
    [ -d "$d" ] || die "share $d is not a directory"
    d=$(realpath "$d")
    case "$d" in *$'\t'*|*$'\n'*) die "cannot share a path with a tab or newline: $d" ;; esac
    [ "$d" = / ] || candidates+=("$d")
done
while IFS= read -r d; do
    inside=0
    for p in "${share_dirs[@]}"; do
        case "$d/" in "$p"/*) inside=1 ;; esac
    done
    [ "$inside" = 1 ] || share_dirs+=("$d")
done < <(printf '%s\n' "${candidates[@]}" | sort -u)
[ "${#share_dirs[@]}" -le 16 ] || die "more than 16 shared directories"
for i in "${!share_dirs[@]}"; do
    printf 'share%d %s\n' "$i" "${share_dirs[$i]}" >>"$OUTDIR/shares"
    share_args+=(-virtfs "local,path=${share_dirs[$i]},mount_tag=share$i,security_model=none,readonly=on,multidevs=remap")
done
# the guest has a fresh tmpfs on /tmp, /var/tmp and /run: copy the script to the run dir
cp "$SCRIPT" "$OUTDIR/script.sh"
{
    echo "# generated by tests/softroce/run.sh"
    for v in $(compgen -e); do
        case "$v" in
            PATH|LD_LIBRARY_PATH|HOME|USER|LANG|LC_ALL|TERM|RUST_*|KVFERRY_*|CARGO_*|RUSTUP_*|SOFTROCE_*)
                printf 'export %s=%q\n' "$v" "${!v}" ;;
        esac
    done
    printf 'export SOFTROCE_OUT=%q SOFTROCE_IP=10.99.0.1 SOFTROCE_GUEST=1\n' "$OUTDIR"
    cat <<'EOF'
set -e
ip link set lo up
ip link add veth0 type veth peer name veth1
ip addr add 10.99.0.1/24 dev veth0
ip link set veth0 up
ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0
for i in $(seq 1 50); do
    ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE && break
    sleep 0.2
done
ibv_devinfo -d rxe0 | grep -E 'hca_id|state|active_mtu' || true
set +e
EOF
    printf 'cd %q\n' "$PWD"
    printf 'echo "[guest] running %s"\n' "$SCRIPT"
    printf 'export SOFTROCE_SCRIPT_DIR=%q\n' "$(dirname "$SCRIPT")"
    printf 'bash %q' "$OUTDIR/script.sh"
    for a in "$@"; do printf ' %q' "$a"; done
    echo
}>"$OUTDIR/guest.sh"

# --- 5. boot ------------------------------------------------------------------------
log "booting $KVER (TCG, 2 vCPU, 2 GiB), script $SCRIPT, out $OUTDIR, shares ${share_dirs[*]:-none}, timeout ${TIMEOUT}s"
: >"$OUTDIR/guest.log"
tail -n +1 -F "$OUTDIR/guest.log" 2>/dev/null &
tailpid=$!
start=$(date +%s)
set +e
timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -smp 2 -m 2048 \
    -nic none -display none -no-reboot -monitor none \
    -serial "file:$OUTDIR/console.log" \
    -kernel "$KERNEL" -initrd "$INITRD" \
    -append "console=ttyS0 panic=-1 quiet loglevel=4 softroce.out=$OUTDIR" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$OUTDIR,mount_tag=results,security_model=none,multidevs=remap" \
    "${share_args[@]}"
qrc=$?
set -e
sleep 0.5
kill "$tailpid" 2>/dev/null || true
wait "$tailpid" 2>/dev/null || true
log "guest ran $(( $(date +%s) - start ))s (qemu exit $qrc)"

show_console() { echo "----- guest console ($OUTDIR/console.log) -----" >&2; cat "$OUTDIR/console.log" >&2 || true; echo "-----" >&2; }
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
    show_console; die "timeout after ${TIMEOUT}s"
fi
if [ ! -s "$OUTDIR/rc" ]; then
    show_console; die "guest ended without a result (qemu exit $qrc)"
fi
rc=$(cat "$OUTDIR/rc")
if [ "$rc" != 0 ]; then
    show_console; echo "[softroce] FAIL: guest script exited $rc" >&2; exit "$rc"
fi
log "OK (results in $OUTDIR)"
