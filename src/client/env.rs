//! The environment a request carries (`env`, PROTOCOL §2.2): the
//! submitter's whole environment (`submit --env-all`), a KEY=VALUE file
//! (`--env-file`) and single variables (`--env`), merged in that order so the
//! explicit ones win, within the protocol's limits.
//!
//! Without any of them a request carries no `env`: its steps get the
//! daemon's environment only (under systemd, the manager's PATH).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context as _};

/// At most this many variables in one `env` object (PROTOCOL §2.2).
pub const MAX_ENV_ENTRIES: usize = 256;

/// Whether `name` is a variable name a request may carry: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn valid_env_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

/// The submitting process's environment as a request may carry it.
#[derive(Debug, Default)]
pub struct Captured {
    /// The variables kept.
    pub env: BTreeMap<String, String>,
    /// Variables left out, each with why (a name outside the grammar, not UTF-8).
    pub skipped: Vec<String>,
}

/// Capture this process's environment (`--env-all`): every variable whose
/// name matches the grammar and whose name and value are UTF-8; the others
/// are listed in `skipped`.
pub fn capture_env() -> Captured {
    let mut c = Captured::default();
    for (k, v) in std::env::vars_os() {
        match (k.to_str(), v.to_str()) {
            (Some(k), Some(v)) if valid_env_name(k) => {
                c.env.insert(k.to_string(), v.to_string());
            }
            (Some(k), Some(_)) => c.skipped.push(format!("`{k}` (names must match [A-Za-z_][A-Za-z0-9_]*)")),
            (Some(k), None) => c.skipped.push(format!("`{k}` (its value is not UTF-8)")),
            (None, _) => c.skipped.push(format!("`{}` (its name is not UTF-8)", k.to_string_lossy())),
        }
    }
    c
}

/// Parse an env file: `NAME=value` lines (the value is everything after the
/// first `=`, as written: no quotes are removed), an optional leading
/// `export `, `#` comment lines and blank lines. Errors name the file and line.
pub fn parse_env_file(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    // The submitter's own file, named on its command line: read as any tool would.
    let bytes = std::fs::read(path).with_context(|| format!("cannot read the env file {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "the env file {} is not UTF-8 (byte {}); write it as UTF-8 text",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    parse_env_text(&text).map_err(|(line, why)| anyhow::anyhow!("{}:{line}: {why}", path.display()))
}

/// The lines of an env file; an error is (line number, why).
pub fn parse_env_text(text: &str) -> Result<BTreeMap<String, String>, (usize, String)> {
    let mut env = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_start();
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").map(str::trim_start).unwrap_or(line);
        let Some((k, v)) = line.split_once('=') else {
            return Err((i + 1, format!("`{}` needs the form NAME=value", raw.trim())));
        };
        let k = k.trim_end();
        if !valid_env_name(k) {
            return Err((i + 1, format!("`{k}` is not a variable name; names must match [A-Za-z_][A-Za-z0-9_]*")));
        }
        if v.contains('\0') {
            return Err((i + 1, format!("the value of `{k}` contains NUL, which a request cannot carry")));
        }
        env.insert(k.to_string(), v.to_string());
    }
    Ok(env)
}

/// Parse one `--env NAME=value`.
pub fn parse_env_arg(kv: &str) -> anyhow::Result<(String, String)> {
    let Some((k, v)) = kv.split_once('=') else { bail!("--env `{kv}` needs the form NAME=value") };
    if !valid_env_name(k) {
        bail!("--env `{kv}`: `{k}` is not a variable name; names must match [A-Za-z_][A-Za-z0-9_]*");
    }
    if v.contains('\0') {
        bail!("--env `{k}=...`: the value contains NUL, which a request cannot carry");
    }
    Ok((k.to_string(), v.to_string()))
}

/// Merge the layers (later ones win) and check the entry limit, with an
/// error that says where the variables came from and what to do instead.
pub fn merge_env(
    captured: Option<BTreeMap<String, String>>,
    files: Vec<BTreeMap<String, String>>,
    explicit: Vec<(String, String)>,
) -> anyhow::Result<BTreeMap<String, String>> {
    let from_all = captured.is_some();
    let mut env = captured.unwrap_or_default();
    for f in files {
        env.extend(f);
    }
    env.extend(explicit);
    if env.len() > MAX_ENV_ENTRIES {
        if from_all {
            bail!(
                "--env-all: the environment has {} variables; a request carries at most {MAX_ENV_ENTRIES} (PROTOCOL §2.2). \
                 Pass the ones the step needs with --env-file FILE or --env NAME=value instead of --env-all",
                env.len()
            );
        }
        bail!(
            "the request would carry {} environment variables; at most {MAX_ENV_ENTRIES} are allowed (PROTOCOL §2.2): \
             keep only the ones the step needs in --env-file / --env",
            env.len()
        );
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_lines() {
        let env = parse_env_text("# c\n\nA=1\nexport B=x\n C=a=b\nD=\"q\"\nE=\n").unwrap();
        assert_eq!(env["A"], "1");
        assert_eq!(env["B"], "x");
        assert_eq!(env["C"], "a=b");
        assert_eq!(env["D"], "\"q\"");
        assert_eq!(env["E"], "");
        assert_eq!(parse_env_text("A=1\nnovalue\n").unwrap_err().0, 2);
        assert_eq!(parse_env_text("1A=1\n").unwrap_err().0, 1);
    }

    #[test]
    fn explicit_wins_and_limit() {
        let all = BTreeMap::from([("A".to_string(), "all".to_string()), ("B".into(), "all".into())]);
        let file = BTreeMap::from([("B".to_string(), "file".to_string()), ("C".into(), "file".into())]);
        let env = merge_env(Some(all), vec![file], vec![("C".into(), "flag".into())]).unwrap();
        assert_eq!((env["A"].as_str(), env["B"].as_str(), env["C"].as_str()), ("all", "file", "flag"));
        let big: BTreeMap<String, String> = (0..300).map(|i| (format!("V{i}"), String::new())).collect();
        let e = merge_env(Some(big), vec![], vec![]).unwrap_err().to_string();
        assert!(e.contains("256") && e.contains("--env-file"), "{e}");
    }
}
