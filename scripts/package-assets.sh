#!/usr/bin/env bash
# Generate the files a distribution package installs besides the binary,
# all from the runspool binary itself (its clap definition and the unit
# template compiled into it), so no copy can drift from the code:
#
#   scripts/package-assets.sh BIN OUTDIR [BINDIR]
#
#   OUTDIR/runspool.service          user unit, ExecStart=BINDIR/runspool daemon
#   OUTDIR/completions/runspool.bash bash  (-> share/bash-completion/completions/runspool)
#   OUTDIR/completions/_runspool     zsh   (-> share/zsh/vendor-completions or site-functions)
#   OUTDIR/completions/runspool.fish fish  (-> share/fish/vendor_completions.d)
#   OUTDIR/man/runspool*.1           one page per command, uncompressed
#                                    (cargo-deb and rpmbuild gzip man pages)
#
# BINDIR is where the package puts the binary (default /usr/bin). Used by
# scripts/build-deb.sh and packaging/rpm/runspool.spec.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BIN OUTDIR [BINDIR]" >&2
  exit 2
fi
bin=$1 out=$2 bindir=${3:-/usr/bin}
[ -x "$bin" ] || { echo "package-assets.sh: $bin is not an executable runspool" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/completions" "$out/man"
env -u RUNSPOOL_ROOT -u PI_SUBAGENTS_TEMP_ROOT "$bin" service unit --bin "$bindir/runspool" >"$out/runspool.service"
"$bin" completions bash >"$out/completions/runspool.bash"
"$bin" completions zsh >"$out/completions/_runspool"
"$bin" completions fish >"$out/completions/runspool.fish"
"$bin" man --dir "$out/man"
grep -qxF "ExecStart=$bindir/runspool daemon" "$out/runspool.service" || {
  echo "package-assets.sh: the rendered unit does not start $bindir/runspool" >&2
  exit 1
}
