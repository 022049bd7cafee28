# Homebrew formula for runspool (for a tap: `brew tap OWNER/runspool` with
# this file in its Formula/ directory; see packaging/README.md).
#
# Before the first release, replace OWNER below and the sha256 with the
# release tarball's (`brew fetch --build-from-source runspool` prints it).
# The version in the URL must match Cargo.toml (tests/it/packaging.rs checks).
class Runspool < Formula
  desc "Per-user supervisor for background runs, driven by files in a spool directory"
  homepage "https://github.com/OWNER/runspool"
  url "https://github.com/OWNER/runspool/archive/refs/tags/v0.1.0.tar.gz"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"
  license any_of: ["MIT", "Apache-2.0"]
  head "https://github.com/OWNER/runspool.git", branch: "main"

  depends_on "rust" => :build

  def install
    system "cargo", "install", *std_cargo_args
    # Completions and man pages come from the binary's own CLI definition.
    generate_completions_from_executable(bin/"runspool", "completions")
    system bin/"runspool", "man", "--dir", man1
  end

  # The same agent as launchd/dev.runspool.daemon.plist (what
  # `runspool service install` writes): start at load, restart after a crash
  # but not after a clean exit, background QoS. Homebrew's DSL has no
  # AbandonProcessGroup; runners call setsid() first thing, so they are out
  # of the daemon's process group and outlive a restart of it anyway.
  service do
    run [opt_bin/"runspool", "daemon"]
    keep_alive crashed: true
    process_type :background
    log_path var/"log/runspool.log"
    error_log_path var/"log/runspool.log"
  end

  def caveats
    <<~EOS
      Start the daemon at login with:
        brew services start runspool
      or, to choose its root or config, with runspool itself:
        runspool --root DIR service install --config FILE
      (not both: they would run two daemons under two labels).
    EOS
  end

  test do
    assert_match version.to_s, shell_output("#{bin}/runspool --version")
    assert_match "complete -F", shell_output("#{bin}/runspool completions bash")
    root = testpath/"root"
    run_id = shell_output("#{bin}/runspool --root #{root} submit -- true").strip
    assert_path_exists root/"spool/#{run_id}.json"
  end
end
