#!/bin/busybox sh
# /init of the soft-RoCE guest (built into the initramfs by run.sh): load modules, mount
# the host root (read-only 9p), the shared host directories (read-only 9p, listed in the run
# directory's `shares`) and the run directory (writable 9p), chroot into the host root, run
# the generated guest.sh, record its exit status, power off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# two passes tolerate order mistakes
for pass in 1 2; do
    for m in /modules/*.ko; do insmod "$m" 2>/dev/null; done
done

OUT=
for a in $(cat /proc/cmdline); do
    case "$a" in softroce.out=*) OUT=${a#softroce.out=} ;; esac
done

fail() { echo "[init] FAIL: $*"; echo "[init] loaded modules:"; cat /proc/modules; poweroff -f; }

O=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o $O,ro,cache=loose hostroot /host || fail "mount hostroot"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/pts /host/dev/shm 2>/dev/null
mount -t devpts devpts /host/dev/pts
mount -t tmpfs shm /host/dev/shm
mount -t tmpfs tmp /host/tmp
mount -t tmpfs run /host/run
mount -t tmpfs vartmp /host/var/tmp
# The run directory first at /results, to read the list of host directories shared
# explicitly (run.sh: the repo, the target directory, ...): the tmpfs mounts above hide
# anything under /tmp, /var/tmp and /run, so each is mounted again at its own path.
mkdir -p /results
mount -t 9p -o $O results /results || fail "mount results (for $OUT)"
if [ -f /results/shares ]; then
    while read -r tag path; do
        [ -n "$tag" ] || continue
        mkdir -p "/host$path" 2>/dev/null
        mount -t 9p -o $O,ro,cache=loose "$tag" "/host$path" || fail "mount share $tag at $path"
    done </results/shares
fi
# last, so that it lies on top of the shares (a run directory inside the target directory)
mkdir -p "/host$OUT" 2>/dev/null
mount -o bind /results "/host$OUT" || fail "bind results at $OUT"

echo "[init] running guest.sh"
chroot /host /bin/bash "$OUT/guest.sh" >>"/host$OUT/guest.log" 2>&1 </dev/null
rc=$?
echo "[init] guest.sh exited $rc"
echo "$rc" >"/host$OUT/rc"
sync
umount "/host$OUT" 2>/dev/null
umount /results 2>/dev/null
poweroff -f
