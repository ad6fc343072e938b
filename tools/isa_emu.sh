#!/usr/bin/env bash
# isa_emu.sh -- runs the AVX-512 copy of libfsdp.so's kernels on an emulated AVX-512 CPU and
# compares its results with the lower copies' (make isa-emu-check).
#
# The portable build compiles the kernel files three times (sse2, avx2, avx512f: src/backend/cpu/
# cpu.h) and tests/backends/portable_spec.lua compares the levels the CPU has; on a machine without
# AVX-512 the avx512f copy never runs. Bochs (Debian's 2.7 emulates AVX-512 F/BW/CD/DQ/VL; QEMU 7.2
# does not) stands in for such a machine, as the CUDA executor stands in for a GPU: it checks
# results, not speed. The steps:
#   1. Debian's packages (tools/deps.sh emu): bochs, its BIOS, busybox-static, isolinux, xorriso,
#      cpio; a Debian kernel is downloaded and unpacked into build/isa-emu (never installed)
#   2. here, on the real CPU: the sse2 and avx2 copies' runs of the op-case table and of the wide
#      cases (tests/scripts/isa_emu.lua lower; tests/backends/isa_levels.lua)
#   3. a guest: an uncompressed initramfs (the emulated CPU would spend minutes decompressing)
#      holding busybox, luajit, busted, libfsdp.so and the shared libraries all of them load,
#      the Lua files, the specs and step 2's runs, on an ISO that isolinux boots (made without
#      mounting anything)
#   4. Bochs boots it headless, the serial port into build/isa-emu/serial.txt: the guest proves
#      it runs the avx512f copy, runs it, compares with step 2's runs (tests/scripts/isa_emu.lua
#      guest) and powers off, which ends Bochs
# Exits 0 when the guest printed "ISA-EMU RESULT: PASS"; 1 when it printed a failure, printed no
# result, its kernel panicked, or it ran out of time (ISA_EMU_TIMEOUT seconds, default 3600: Bochs
# runs some tens of millions of instructions a second).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=build/isa-emu
timeout_s=${ISA_EMU_TIMEOUT:-3600}

[ -e libfsdp.so ] || { echo "isa_emu: libfsdp.so is missing (run make first)" >&2; exit 2; }
tools/deps.sh emu
mkdir -p "$cache/dumps"

# ---- 1. the kernel ----------------------------------------------------------------------------------
# Debian's cloud flavour: a smaller kernel with fewer drivers to probe (the boot costs emulated
# instructions) that still has the 8250 serial console and initramfs support built in.
if [ ! -e "$cache/vmlinuz" ]; then
  meta=linux-image-cloud-amd64
  apt-cache show "$meta" >/dev/null 2>&1 || apt-get update -qq
  pkg=$(apt-cache depends "$meta" | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -1)
  [ -n "$pkg" ] || { echo "isa_emu: cannot tell which kernel $meta depends on" >&2; exit 2; }
  echo "isa_emu: downloading $pkg into $cache"
  rm -rf "$cache/kernel" && mkdir -p "$cache/kernel"
  (cd "$cache/kernel" && apt-get download -q "$pkg" 2>&1 | grep -v "couldn't be accessed by user '_apt'" || true)
  dpkg-deb -x "$cache"/kernel/"$pkg"_*.deb "$cache/kernel/root"
  cp "$cache"/kernel/root/boot/vmlinuz-* "$cache/vmlinuz.part"
  mv "$cache/vmlinuz.part" "$cache/vmlinuz"
  rm -rf "$cache/kernel"
fi

# ---- 2. the lower copies, here ------------------------------------------------------------------------
luajit tests/scripts/isa_emu.lua lower "$cache/dumps"

# ---- 3. the guest -------------------------------------------------------------------------------------
g=$cache/guest
rm -rf "$g" && mkdir -p "$g/root" "$g/iso/isolinux"
r=$g/root
mkdir -p "$r/bin" "$r/proc" "$r/sys" "$r/dev" "$r/tmp" "$r/usr/bin" "$r/usr/share/lua" "$r/usr/lib/x86_64-linux-gnu/lua" "$r/fsdp"
cp /bin/busybox "$r/bin/"
ln -s busybox "$r/bin/sh"
luajit=$(command -v luajit)
cp -L "$luajit" "$r/usr/bin/luajit"
ln -s luajit "$r/usr/bin/lua"  # busted's first line is "#!/usr/bin/env lua"; .busted then picks luajit
ln -s ../../bin/busybox "$r/usr/bin/env"
cp /usr/bin/busted "$r/usr/bin/"
cp -r /usr/share/lua/5.1 "$r/usr/share/lua/"
cp -rL /usr/lib/x86_64-linux-gnu/lua/5.1 "$r/usr/lib/x86_64-linux-gnu/lua/"
# every shared library luajit, libfsdp.so and busted's C modules load, at the path ldd names
for f in "$luajit" libfsdp.so $(find /usr/lib/x86_64-linux-gnu/lua/5.1 -name '*.so'); do
  for lib in $(ldd "$f" | grep -o '/[^ ]*'); do
    mkdir -p "$r$(dirname "$lib")"
    [ -e "$r$lib" ] || cp -L "$lib" "$r$lib"
  done
done
cp -r lua tests .busted libfsdp.so "$r/fsdp/"
mkdir -p "$r/fsdp/dumps"
cp "$cache"/dumps/sse2.* "$cache"/dumps/avx2.* "$r/fsdp/dumps/"
cat >"$r/init" <<'EOF'
#!/bin/sh
# the guest's first and only process: the check, then power off (which ends Bochs)
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin HOME=/tmp
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
cd /fsdp
echo "guest: $(grep -m1 'model name' /proc/cpuinfo)"
echo "guest: $(grep MemTotal /proc/meminfo), $(grep MemAvailable /proc/meminfo)"
luajit tests/scripts/isa_emu.lua guest dumps || echo "guest: isa_emu.lua exited with $?"
sleep 2  # poweroff -f does not wait for the serial port to send what it holds
poweroff -f
EOF
chmod +x "$r/init"
(cd "$r" && find . | cpio -o -H newc --quiet) >"$g/iso/initrd.cpio"
cp "$cache/vmlinuz" "$g/iso/vmlinuz"
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 "$g/iso/isolinux/"
# clearcpuid=xsaves,xsavec: Bochs 2.7 reports the standard-format XSAVE size where Linux asks for
# the compacted one (CPUID 0xD), and Linux, seeing the two disagree, turns XSAVE off, and with it
# AVX and AVX-512 ("XSAVE consistency problem: size 2432 != kernel_size 2688"); without XSAVES and
# XSAVEC it uses the standard format, whose sizes agree. quiet: fewer bytes through the emulated UART.
cat >"$g/iso/isolinux/isolinux.cfg" <<'EOF'
DEFAULT linux
LABEL linux
  KERNEL /vmlinuz
  APPEND initrd=/initrd.cpio rdinit=/init console=ttyS0 quiet panic=0 mitigations=off clearcpuid=xsaves,xsavec
EOF
xorriso -as mkisofs -quiet -o "$g/guest.iso" -b isolinux/isolinux.bin -c isolinux/boot.cat \
  -no-emul-boot -boot-load-size 4 -boot-info-table "$g/iso" 2>&1 | grep -v '^xorriso 1\.' || true
rm -rf "$g/root" "$g/iso"

# ---- 4. Bochs -------------------------------------------------------------------------------------------
# corei7_skylake_x: AVX-512 F, BW, CD, DQ and VL, what x86-64-v4 (and so our avx512f copy) needs.
# Debian's Bochs has no "nogui" display; "term" draws nothing we read (the guest speaks on the
# serial port), and setsid keeps it off the terminal make runs in. Its debugger starts first and
# waits for a command: the rc file says "continue". Bochs's errors (a triple fault, a reset) go
# to bochs.log.
cat >"$g/bochsrc" <<EOF
memory: guest=2048, host=2048
cpu: model=corei7_skylake_x, count=1, ips=25000000
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
ata0-master: type=cdrom, path=$PWD/$g/guest.iso, status=inserted
boot: cdrom
display_library: term
com1: enabled=1, mode=file, dev=$PWD/$cache/serial.txt
log: $PWD/$cache/bochs.log
panic: action=fatal
error: action=report
info: action=ignore
debug: action=ignore
EOF
echo c >"$g/debugger.rc"
rm -f "$cache/serial.txt"
echo "isa_emu: booting the guest in Bochs (serial console: $cache/serial.txt; timeout ${timeout_s}s)"
t0=$(date +%s)
TERM=dumb setsid bochs -q -f "$g/bochsrc" -rc "$g/debugger.rc" </dev/null >"$cache/bochs.out" 2>&1 &
bochs_pid=$!
# The guest powers off at the end, which ends Bochs. A kernel panic hangs it (panic=0: a reboot
# would start the run again and Bochs would empty the serial file), so watch for one, and for the time.
stopped=""
while kill -0 "$bochs_pid" 2>/dev/null; do
  sleep 5
  if grep -aq 'Kernel panic' "$cache/serial.txt" 2>/dev/null; then
    stopped="the guest's kernel panicked"
  elif [ $(($(date +%s) - t0)) -ge "$timeout_s" ]; then
    stopped="no result within ${timeout_s}s (ISA_EMU_TIMEOUT)"
  fi
  if [ -n "$stopped" ]; then
    pkill -KILL -P "$bochs_pid" 2>/dev/null || true  # bochs-bin, under the wrapper script
    kill -KILL "$bochs_pid" 2>/dev/null || true
    break
  fi
done
wait "$bochs_pid" 2>/dev/null || true
echo "isa_emu: Bochs ran $(($(date +%s) - t0)) s"
# the guest's own lines (the kernel's start with a timestamp in brackets)
grep -v '^\[' "$cache/serial.txt" 2>/dev/null | tr -d '\r' || true
result=$(grep -a '^ISA-EMU RESULT:' "$cache/serial.txt" 2>/dev/null | tr -d '\r' | tail -1 || true)
if [ "$result" = "ISA-EMU RESULT: PASS" ]; then
  exit 0
fi
if [ -n "$result" ]; then
  echo "isa_emu: the guest reported a failure" >&2
elif [ -n "$stopped" ]; then
  grep -a -A20 'Kernel panic' "$cache/serial.txt" 2>/dev/null | head -20 || true
  echo "isa_emu: $stopped; see $cache/serial.txt and $cache/bochs.log" >&2
else
  echo "isa_emu: the guest reported no result; see $cache/serial.txt, $cache/bochs.out and $cache/bochs.log" >&2
fi
exit 1
