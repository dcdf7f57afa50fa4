#!/usr/bin/env bash
# Copy a built CRIU and every shared library it loads (glibc's included) into DEST, so
# that it runs on another x86-64 machine without installing anything there (the GPU
# machines: unknown distribution, no network). DEST/criu is the command:
#
#   tools/bundle_criu.sh DEST [CRIU]     # CRIU: default $CUINTERPOSE_CRIU, else criu on PATH
#   CUINTERPOSE_CRIU=$PWD/DEST/criu ...  # how the suite, bench/criu.py and the verbs find it
#
# DEST/criu runs DEST/bin/criu through the bundled dynamic loader with
# `--library-path DEST/lib`: nothing is put into the environment, so the processes CRIU
# starts (action scripts, and through them Python and the CUDA driver) load the host's
# own libraries. The bundle must stay under 40 MiB (it is carried to the GPU machine).
set -euo pipefail
[[ $# -ge 1 && $# -le 2 ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
DEST=$1
CRIU=${2:-${CUINTERPOSE_CRIU:-$(command -v criu || true)}}
[[ -n $CRIU && -x $CRIU ]] || { echo "no criu binary (give it, or set CUINTERPOSE_CRIU)" >&2; exit 1; }
CRIU=$(readlink -f "$CRIU")
file -L "$CRIU" 2>/dev/null | grep -q ELF || head -c4 "$CRIU" | grep -q ELF \
  || { echo "$CRIU is not an ELF binary (a wrapper? name the real one)" >&2; exit 1; }
rm -rf "$DEST" && mkdir -p "$DEST/bin" "$DEST/lib"
cp "$CRIU" "$DEST/bin/criu"
loader=""
while read -r name arrow path _; do
  case $name in
    linux-vdso.so.*) continue ;;
    /*) loader=$name; cp -L "$name" "$DEST/lib/"; continue ;;
  esac
  [[ $arrow == "=>" && -f $path ]] || { echo "ldd: $name not found" >&2; exit 1; }
  cp -L "$path" "$DEST/lib/$name"
done < <(ldd "$CRIU")
[[ -n $loader ]] || { echo "ldd named no dynamic loader for $CRIU" >&2; exit 1; }
cat >"$DEST/criu" <<WRAP
#!/bin/sh
# CRIU with its own libraries (tools/bundle_criu.sh); nothing leaks into its children.
d=\$(dirname "\$(readlink -f "\$0")")
exec "\$d/lib/$(basename "$loader")" --library-path "\$d/lib" "\$d/bin/criu" "\$@"
WRAP
chmod +x "$DEST/criu"
size=$(du -sb "$DEST" | cut -f1)
(( size < 40 << 20 )) || { echo "bundle is $size bytes, over 40 MiB" >&2; exit 1; }
"$DEST/criu" --version
echo "$DEST: $size bytes; run it as $DEST/criu (CUINTERPOSE_CRIU=$(readlink -f "$DEST")/criu)"
