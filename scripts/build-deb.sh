#!/usr/bin/env bash
# Build the Debian package with cargo-deb ([package.metadata.deb] in
# Cargo.toml): the binary in /usr/bin, the user unit in
# /usr/lib/systemd/user, bash/zsh/fish completions and one man page per
# command, all generated from the binary by scripts/package-assets.sh.
#
#   scripts/build-deb.sh                       release build; the .deb to ship
#   scripts/build-deb.sh --profile dev --no-build --fast
#                                              package the debug binary that
#                                              `cargo test` already built (the
#                                              CI check in tests/it/packaging.rs)
#   scripts/build-deb.sh --profile profiling --dbgsym
#                                              line tables in a -dbgsym package
#                                              (other options go to cargo deb)
#
# Prints the path of the .deb as its last line. Installs cargo-deb
# (CARGO_DEB_VERSION, default below) when `cargo deb` is missing. $CARGO, when
# set, is the cargo to use.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo=${CARGO:-cargo}

profile=release
build=1
deb_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --profile=*) profile=${1#--profile=}; shift ;;
    --no-build) build=0; shift ;;
    *) deb_args+=("$1"); shift ;;
  esac
done

# One build at a time: cargo install and the asset directory are shared.
mkdir -p target
exec 9>target/.build-deb.lock
flock 9

if ! "$cargo" deb --version >/dev/null 2>&1; then
  # Pinned: cargo-deb warns that the dev profile (used by the CI check) will
  # become an error; a newer one is used as it is when already installed.
  version=${CARGO_DEB_VERSION:-3.8.0}
  echo "build-deb.sh: installing cargo-deb $version (cargo install --locked)" >&2
  "$cargo" install cargo-deb --locked --version "$version" >&2
fi

target_dir=$("$cargo" metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target_dir" ] || { echo "build-deb.sh: cannot find the target directory from cargo metadata" >&2; exit 1; }
case "$profile" in
  dev | debug) profile=dev; out_dir=debug ;;
  *) out_dir=$profile ;;
esac

if [ "$build" = 1 ]; then
  "$cargo" build --locked --profile "$profile" --bin runspool --bin runspool-runner >&2
fi
bin="$target_dir/$out_dir/runspool"
[ -x "$bin" ] || { echo "build-deb.sh: no $bin; build it first or drop --no-build" >&2; exit 1; }
[ -x "$bin-runner" ] || { echo "build-deb.sh: no $bin-runner; build it first (cargo build --bin runspool-runner) or drop --no-build" >&2; exit 1; }

# cargo-deb maps the target/release/ prefix of the assets to this profile's
# directory, so the generated files live next to the binary they came from.
bash scripts/package-assets.sh "$bin" "$target_dir/$out_dir/pkg" /usr/bin >&2
# Debian policy: man pages gzipped, -9, no name or time stamp (-n).
gzip -9n "$target_dir/$out_dir/pkg/man/"*.1

# Strip unless the caller chose what to do with debug info: release has none
# left but its symbols; `--profile profiling --dbgsym` ships line tables in a
# -dbgsym package.
strip=(--strip)
for a in "${deb_args[@]+"${deb_args[@]}"}"; do
  case "$a" in --no-strip | --dbgsym | --separate-debug-symbols) strip=() ;; esac
done

# The binary was built above (or by the caller): cargo deb packages it as is.
"$cargo" deb --no-build --profile "$profile" "${strip[@]+"${strip[@]}"}" "${deb_args[@]+"${deb_args[@]}"}" >"$target_dir/debian-build.out"
cat "$target_dir/debian-build.out" >&2
deb=$(tail -n 1 "$target_dir/debian-build.out")
[ -f "$deb" ] || { echo "build-deb.sh: cargo deb did not name a .deb (last line: $deb)" >&2; exit 1; }
echo "$deb"
