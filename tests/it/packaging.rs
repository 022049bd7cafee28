//! The packages in packaging/ and Cargo.toml's [package.metadata.deb]:
//!
//! - the .deb that scripts/build-deb.sh makes (from the debug binary `cargo
//!   test` built, so no release build here): its file list and control
//!   fields, and its unit, completions and man pages as extracted;
//! - the RPM spec, through `rpmspec -P` and `rpmlint`;
//! - the Homebrew formula, through `ruby -c` and its `service do` block held
//!   against launchd/dev.runspool.daemon.plist.
//!
//! As root (CI) the tools are installed when missing (cargo-deb by the
//! script, the rest by scripts/fixtures.sh); otherwise what is missing is
//! skipped with a SKIP line. RUNSPOOL_PACKAGING_TESTS=1 lets a non-root run
//! build the .deb (installing cargo-deb if needed).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use clap::CommandFactory as _;

const BIN: &str = env!("CARGO_BIN_EXE_runspool");
const VERSION: &str = env!("CARGO_PKG_VERSION");
const DESCRIPTION: &str = env!("CARGO_PKG_DESCRIPTION");

fn root_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn has(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed ({}):\n{}{}", out.status, text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

/// Make `tool` available: present, or installed by scripts/fixtures.sh as
/// root; false (after a SKIP line naming `what`) otherwise.
fn tool(tool: &str, fixture: &str, what: &str) -> bool {
    if !has(tool) && is_root() {
        let st = Command::new("bash").arg(root_dir().join("scripts/fixtures.sh")).arg(fixture).status().unwrap();
        assert!(st.success(), "scripts/fixtures.sh {fixture} failed");
    }
    if has(tool) {
        return true;
    }
    eprintln!("SKIP: {tool} is not installed and we are not root to install it; {what} not checked");
    false
}

/// The visible commands as man page names: runspool.1, runspool-submit.1, runspool-service-install.1, ...
fn man_pages() -> BTreeSet<String> {
    fn walk(c: &clap::Command, prefix: &str, out: &mut BTreeSet<String>) {
        for s in c.get_subcommands().filter(|s| !s.is_hide_set()) {
            let name = format!("{prefix}-{}", s.get_name());
            out.insert(format!("{name}.1"));
            walk(s, &name, out);
        }
    }
    let mut out = BTreeSet::from(["runspool.1".to_string()]);
    walk(&runspool::cli::Cli::command(), "runspool", &mut out);
    out
}

/// What every package installs, by its distribution's own paths; the zsh
/// directory differs (Debian: vendor-completions; Fedora, openSUSE,
/// Homebrew: site-functions).
fn installed_files(zsh_dir: &str, man_suffix: &str) -> BTreeSet<String> {
    let mut s: BTreeSet<String> = [
        "/usr/bin/runspool".to_string(),
        "/usr/bin/runspool-runner".into(),
        "/usr/lib/systemd/user/runspool.service".into(),
        "/usr/share/bash-completion/completions/runspool".into(),
        format!("{zsh_dir}/_runspool"),
        "/usr/share/fish/vendor_completions.d/runspool.fish".into(),
    ]
    .into();
    s.extend(man_pages().into_iter().map(|p| format!("/usr/share/man/man1/{p}{man_suffix}")));
    s
}

/// The docs a package ships next to README.md: SECURITY.md and docs/*.md,
/// which must cover every relative path README.md mentions.
fn shipped_docs() -> BTreeSet<String> {
    let mut docs: BTreeSet<String> = fs::read_dir(root_dir().join("docs"))
        .unwrap()
        .map(|e| format!("docs/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|n| n.ends_with(".md"))
        .collect();
    docs.insert("SECURITY.md".into());
    let readme = fs::read_to_string(root_dir().join("README.md")).unwrap();
    for word in readme.split(|c: char| c.is_whitespace() || "()[]`,;:".contains(c)) {
        let word = word.trim_end_matches('.');
        if (word.starts_with("docs/") || word == "SECURITY.md") && word.ends_with(".md") {
            assert!(docs.contains(word), "README.md mentions {word}, which the package would not ship");
        }
    }
    docs
}

#[test]
fn readme_mentions_only_shipped_docs() {
    assert!(shipped_docs().contains("docs/config.md"));
}

// ---------------------------------------------------------------- .deb ----

fn deb_enabled() -> bool {
    if !has("dpkg-deb") {
        eprintln!("SKIP: dpkg-deb is not installed (not Debian?); the .deb was not built");
        return false;
    }
    let asked = std::env::var("RUNSPOOL_PACKAGING_TESTS").is_ok_and(|v| v == "1");
    let have = Command::new(env!("CARGO")).args(["deb", "--version"]).output().is_ok_and(|o| o.status.success());
    if is_root() || asked || have {
        return true;
    }
    eprintln!("SKIP: cargo-deb is not installed and installing it takes minutes; run as root or with RUNSPOOL_PACKAGING_TESTS=1 (CI runs this as root)");
    false
}

/// Build the .deb into `out` from the debug binary and return its path.
fn build_deb(out: &Path) -> PathBuf {
    let t = std::time::Instant::now();
    let res = Command::new("bash")
        .arg(root_dir().join("scripts/build-deb.sh"))
        .args(["--profile", "dev", "--no-build", "--fast", "--output"])
        .arg(out)
        .env("CARGO", env!("CARGO"))
        .stdin(Stdio::null())
        // Shown as it happens: a first run installs cargo-deb, for minutes.
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let stdout = ok(res, "scripts/build-deb.sh");
    eprintln!("scripts/build-deb.sh took {:.1}s", t.elapsed().as_secs_f64());
    let deb = PathBuf::from(stdout.lines().last().expect("build-deb.sh printed nothing"));
    assert!(deb.starts_with(out) && deb.extension().is_some_and(|e| e == "deb"), "{}", deb.display());
    deb
}

#[test]
fn deb_installs_binary_unit_completions_and_man_pages() {
    if !deb_enabled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let deb = build_deb(&tmp.path().join("out"));

    // The file list: exactly these files, the binary executable.
    let list = ok(Command::new("dpkg-deb").arg("-c").arg(&deb).output().unwrap(), "dpkg-deb -c");
    let mut files = BTreeSet::new();
    for l in list.lines() {
        let path = l.split_whitespace().last().unwrap().trim_start_matches('.');
        if !l.starts_with('d') {
            files.insert(path.to_string());
        }
        if path == "/usr/bin/runspool" || path == "/usr/bin/runspool-runner" {
            assert!(l.starts_with("-rwxr-xr-x root/root") || l.starts_with("-rwxr-xr-x 0/0"), "{l}");
        }
    }
    let mut want = installed_files("/usr/share/zsh/vendor-completions", ".gz");
    want.extend(["/usr/share/doc/runspool/README.md".to_string(), "/usr/share/doc/runspool/copyright".into()]);
    // Every local file README.md links to (docs/*.md, SECURITY.md) is shipped at the same relative path.
    want.extend(shipped_docs().into_iter().map(|d| format!("/usr/share/doc/runspool/{d}")));
    assert_eq!(files, want, "dpkg-deb -c:\n{list}");

    // The control fields.
    let info = ok(Command::new("dpkg-deb").arg("-I").arg(&deb).output().unwrap(), "dpkg-deb -I");
    let field = |name: &str| -> String {
        let out = ok(Command::new("dpkg-deb").args(["-f"]).arg(&deb).arg(name).output().unwrap(), "dpkg-deb -f");
        out.trim_end().to_string()
    };
    let arch = ok(Command::new("dpkg").arg("--print-architecture").output().unwrap(), "dpkg --print-architecture");
    assert_eq!(field("Package"), "runspool", "{info}");
    assert_eq!(field("Version"), format!("{VERSION}-1"), "{info}");
    assert_eq!(field("Architecture"), arch.trim(), "{info}");
    assert_eq!(field("Section"), "admin", "{info}");
    assert_eq!(field("Priority"), "optional", "{info}");
    assert!(field("Maintainer").contains('<'), "{info}");
    assert!(field("Depends").contains("libc6"), "no libc6 dependency worked out:\n{info}");
    let desc = field("Description");
    assert_eq!(desc.lines().next(), Some(DESCRIPTION), "{info}");
    assert!(DESCRIPTION.len() <= 80, "a Debian short description is at most 80 characters");
    assert!(desc.contains("systemctl --user enable --now"), "{info}");

    // What it installs, extracted.
    let x = tmp.path().join("x");
    ok(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&x).output().unwrap(), "dpkg-deb -x");
    let bin = x.join("usr/bin/runspool");
    let v = ok(Command::new(&bin).arg("--version").output().unwrap(), "runspool --version");
    assert_eq!(v.trim(), format!("runspool {VERSION}"));

    let unit = fs::read_to_string(x.join("usr/lib/systemd/user/runspool.service")).unwrap();
    assert_eq!(
        unit.lines().filter(|l| l.starts_with("ExecStart=")).collect::<Vec<_>>(),
        ["ExecStart=/usr/bin/runspool daemon"]
    );
    let rendered = ok(
        Command::new(BIN).args(["service", "unit", "--bin", "/usr/bin/runspool"]).output().unwrap(),
        "runspool service unit",
    );
    assert_eq!(unit, rendered, "the packaged unit is not what `runspool service unit` renders");
    verify_unit(&unit, &bin, tmp.path());

    let bash = x.join("usr/share/bash-completion/completions/runspool");
    ok(Command::new("bash").arg("-n").arg(&bash).output().unwrap(), "bash -n on the packaged completion");
    assert!(fs::read_to_string(x.join("usr/share/zsh/vendor-completions/_runspool"))
        .unwrap()
        .starts_with("#compdef runspool"));
    assert!(fs::read_to_string(x.join("usr/share/fish/vendor_completions.d/runspool.fish"))
        .unwrap()
        .contains("complete -c runspool"));

    for page in man_pages() {
        let gz = x.join("usr/share/man/man1").join(format!("{page}.gz"));
        let roff = ok(Command::new("gzip").arg("-dc").arg(&gz).output().unwrap(), "gzip -dc");
        let title = format!(".TH {} 1 ", page.trim_end_matches(".1"));
        assert!(roff.contains(&title), "{page} has no `{title}`");
    }
    let top = ok(
        Command::new("gzip").arg("-dc").arg(x.join("usr/share/man/man1/runspool.1.gz")).output().unwrap(),
        "gzip -dc",
    );
    if tool("groff", "groff", "the packaged runspool.1's rendering") {
        let mut child = Command::new("groff")
            .args(["-man", "-Tutf8", "-ww", "-z"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), top.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success() && out.stderr.is_empty(), "groff: {}", text(&out.stderr));
    }
}

/// `systemd-analyze verify` on the packaged unit. It insists that ExecStart
/// exists, and /usr/bin/runspool is not installed here: the copy checked
/// points at the extracted binary instead, everything else as shipped.
fn verify_unit(unit: &str, bin: &Path, tmp: &Path) {
    if !has("systemd-analyze") {
        eprintln!("SKIP: systemd-analyze is not installed; the packaged unit was not verified");
        return;
    }
    let copy = unit.replace("ExecStart=/usr/bin/runspool ", &format!("ExecStart={} ", bin.display()));
    let dir = tmp.join("verify");
    fs::create_dir_all(&dir).unwrap();
    let f = dir.join("runspool.service");
    fs::write(&f, copy).unwrap();
    let v = Command::new("systemd-analyze").arg("verify").arg(&f).output().unwrap();
    assert!(v.status.success() && v.stderr.is_empty(), "systemd-analyze verify: {}", text(&v.stderr));
    eprintln!("systemd-analyze verify: packaged unit OK");
}

// ----------------------------------------------------------------- RPM ----

#[test]
fn rpm_spec_parses_lints_and_installs_the_same_files() {
    let spec = root_dir().join("packaging/rpm/runspool.spec");
    if tool("rpmspec", "rpm", "the RPM spec (rpmspec -P)") {
        let expanded = ok(Command::new("rpmspec").arg("-P").arg(&spec).output().unwrap(), "rpmspec -P");
        let tag = |t: &str| -> String {
            let l = expanded
                .lines()
                .find(|l| l.starts_with(&format!("{t}:")))
                .unwrap_or_else(|| panic!("no {t}: in\n{expanded}"));
            l[t.len() + 1..].trim().to_string()
        };
        assert_eq!(tag("Version"), VERSION, "the spec's Version is not Cargo.toml's");
        assert_eq!(tag("Summary"), DESCRIPTION);
        assert_eq!(tag("License"), env!("CARGO_PKG_LICENSE"));
        // %files, expanded: the same files as the .deb (man pages by glob).
        let section =
            expanded.split("\n%files\n").nth(1).expect("a %files section").split("\n%changelog").next().unwrap();
        let listed: BTreeSet<&str> = section.lines().filter(|l| l.starts_with('/')).collect();
        let want = installed_files("/usr/share/zsh/site-functions", "");
        let (man, other): (BTreeSet<&str>, BTreeSet<&str>) =
            listed.iter().partition(|l| l.starts_with("/usr/share/man/"));
        let want_other: BTreeSet<&str> =
            want.iter().map(String::as_str).filter(|p| !p.starts_with("/usr/share/man/")).collect();
        assert_eq!(other, want_other, "%files:\n{section}");
        assert_eq!(
            man,
            BTreeSet::from(["/usr/share/man/man1/runspool.1*", "/usr/share/man/man1/runspool-*.1*"]),
            "%files:\n{section}"
        );
        assert!(
            expanded.contains("bash scripts/package-assets.sh target/profiling/runspool pkg-assets /usr/bin"),
            "{expanded}"
        );
        assert!(
            expanded.contains("\n%doc README.md SECURITY.md pkg-docs/docs\n"),
            "the docs README.md links to: {section}"
        );
        eprintln!("rpmspec -P: OK (Version {VERSION}, %files as the .deb)");
    }
    if tool("rpmlint", "rpmlint", "the RPM spec (rpmlint)") {
        let rc = root_dir().join("packaging/rpm/runspool.rpmlintrc");
        let out = Command::new("rpmlint").arg("-r").arg(&rc).arg(&spec).output().unwrap();
        let printed = text(&out.stdout) + &text(&out.stderr);
        eprintln!("rpmlint:\n{printed}");
        assert!(out.status.success(), "rpmlint failed:\n{printed}");
        assert!(printed.contains("0 errors, 0 warnings"), "rpmlint found something:\n{printed}");
    }
}

// ------------------------------------------------------------ Homebrew ----

/// The value after `<key>key</key>` in a plist: the inner text of the next
/// element, or `true`/`false`.
fn plist_value<'a>(plist: &'a str, key: &str) -> Option<&'a str> {
    let at = plist.find(&format!("<key>{key}</key>"))? + key.len() + 11;
    let mut rest = &plist[at..];
    loop {
        rest = rest.trim_start();
        match rest.strip_prefix("<!--") {
            Some(r) => rest = &r[r.find("-->")? + 3..],
            None => break,
        }
    }
    if rest.starts_with("<true/>") {
        return Some("true");
    }
    if rest.starts_with("<false/>") {
        return Some("false");
    }
    let name_end = rest.find('>')?;
    let name = &rest[1..name_end];
    let close = rest.find(&format!("</{name}>"))?;
    Some(rest[name_end + 1..close].trim())
}

#[test]
fn homebrew_formula_is_ruby_and_its_service_is_the_plist() {
    let formula = root_dir().join("packaging/homebrew/runspool.rb");
    if !tool("ruby", "ruby", "the Homebrew formula") {
        return;
    }
    let syntax = Command::new("ruby").arg("-wc").arg(&formula).output().unwrap();
    let printed = text(&syntax.stdout) + &text(&syntax.stderr);
    eprintln!("ruby -wc: {}", printed.trim());
    assert!(syntax.status.success() && printed.trim() == "Syntax OK", "ruby -wc:\n{printed}");

    let out = ok(
        Command::new("ruby").arg(root_dir().join("tests/packaging/brew_formula.rb")).arg(&formula).output().unwrap(),
        "tests/packaging/brew_formula.rb",
    );
    let f: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(f["class"], "Runspool");
    assert_eq!(f["calls"]["desc"][0][0], DESCRIPTION);
    let url = f["calls"]["url"][0][0].as_str().unwrap();
    assert!(url.contains(&format!("/v{VERSION}.tar.gz")), "the formula's url is not for version {VERSION}: {url}");
    assert_eq!(f["calls"]["license"][0][0]["any_of"], serde_json::json!(["MIT", "Apache-2.0"]));
    assert_eq!(f["install"], true);

    let plist = fs::read_to_string(root_dir().join("launchd/dev.runspool.daemon.plist")).unwrap();
    let s = &f["service"];
    // ProgramArguments: the binary, then `daemon`.
    let args: Vec<&str> = plist_value(&plist, "ProgramArguments")
        .unwrap()
        .split("<string>")
        .skip(1)
        .map(|x| x.split("</string>").next().unwrap())
        .collect();
    let run: Vec<&str> = s["run"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(run[0].ends_with("/opt/runspool/bin/runspool") && args[0].ends_with("/runspool"), "{run:?} vs {args:?}");
    assert_eq!(run[1..], args[1..], "the service runs other arguments than the plist");
    // KeepAlive {SuccessfulExit: false} is `keep_alive crashed: true`.
    let keep = plist_value(&plist, "KeepAlive").unwrap();
    assert_eq!(plist_value(keep, "SuccessfulExit"), Some("false"), "{keep}");
    assert_eq!(s["keep_alive"], serde_json::json!({"crashed": true}));
    assert_eq!(plist_value(&plist, "ProcessType"), Some("Background"));
    assert_eq!(s["process_type"], "background");
    // RunAtLoad: Homebrew's default run_type (:immediate) sets it.
    assert_eq!(plist_value(&plist, "RunAtLoad"), Some("true"));
    assert!(s.get("run_type").is_none_or(|t| t == "immediate"), "{s}");
    // The plist logs stderr to a file; so does the service, stdout too.
    assert!(plist_value(&plist, "StandardErrorPath").is_some());
    for k in ["log_path", "error_log_path"] {
        assert!(s[k].as_str().is_some_and(|p| p.ends_with("/var/log/runspool.log")), "{k}: {s}");
    }
    eprintln!("Homebrew formula: service block matches launchd/dev.runspool.daemon.plist");
}
