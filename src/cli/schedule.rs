//! Scheduling from the command line (PROTOCOL §15): the `submit` flags that
//! set a request's `lane`, `after`, `afterPolicy`, `notBefore` and `hold`,
//! and `runspool hold` / `runspool release` of a queued run.

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use serde_json::{json, Value};

use super::text::visible;
use crate::client::{read_error, resolve, Target};
use crate::protocol::status::State;
use crate::store::layout::{CONTROL_HOLD, CONTROL_RELEASE};
use crate::store::{inbox, run, Layout};

/// `submit`'s scheduling flags (not with --file: a file sets the fields itself).
#[derive(Args, Debug, Default)]
pub struct ScheduleArgs {
    /// Lane of the run ([lanes.NAME] max_running in the daemon's config caps it; default: "default")
    #[arg(long, value_name = "NAME", conflicts_with = "file")]
    lane: Option<String>,
    /// Start only after this run has ended (repeatable; up to 64)
    #[arg(long, value_name = "RUN_ID", conflicts_with = "file")]
    after: Vec<String>,
    /// With --after: `success` (default) fails this run unless every dependency completed; `any` starts it regardless
    #[arg(long, value_name = "POLICY", value_parser = ["success", "any"], requires = "after", conflicts_with = "file")]
    after_policy: Option<String>,
    /// Start no sooner than this long from now (500ms, 30s, 5m, 1h)
    #[arg(long, value_name = "DUR", value_parser = super::args::parse_duration, conflicts_with_all = ["at", "file"])]
    delay: Option<Duration>,
    /// Start no sooner than this time: ms since the epoch, or RFC 3339 (2030-01-31T08:00:00Z, +02:00 offsets)
    #[arg(long, value_name = "TIME", value_parser = parse_time, conflicts_with = "file")]
    at: Option<i64>,
    /// Queue the run held: it never starts until `runspool release <run>`
    #[arg(long, conflicts_with = "file")]
    hold: bool,
}

/// Add the flags' fields to the request being built.
pub fn apply(a: &ScheduleArgs, req: &mut Value) {
    if let Some(l) = &a.lane {
        req["lane"] = json!(l);
    }
    if !a.after.is_empty() {
        req["after"] = json!(a.after);
    }
    if let Some(p) = &a.after_policy {
        req["afterPolicy"] = json!(p);
    }
    let not_before = a.at.or(a.delay.map(|d| crate::now_ms() + d.as_millis() as i64));
    if let Some(t) = not_before {
        req["notBefore"] = json!(t);
    }
    if a.hold {
        req["hold"] = json!(true);
    }
}

/// `--at`: milliseconds since the epoch, or an RFC 3339 date and time.
pub fn parse_time(s: &str) -> Result<i64, String> {
    let s = s.trim();
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    rfc3339_ms(s).ok_or_else(|| {
        format!("`{s}` is not a time; give milliseconds since the epoch or RFC 3339 such as 2030-01-31T08:00:00Z")
    })
}

/// `YYYY-MM-DD[T ]HH:MM[:SS[.fff]](Z|±HH:MM)` in ms since the epoch.
fn rfc3339_ms(s: &str) -> Option<i64> {
    let num = |t: &str| -> Option<i64> { t.bytes().all(|b| b.is_ascii_digit()).then(|| t.parse().ok()).flatten() };
    let (date, rest) = (s.get(..10)?, s.get(11..)?);
    if !matches!(s.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    let (y, mo, d) = (num(date.get(..4)?)?, num(date.get(5..7)?)?, num(date.get(8..10)?)?);
    if date.as_bytes()[4] != b'-' || date.as_bytes()[7] != b'-' || !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    let zone_at = rest.find(['Z', 'z', '+', '-'])?;
    let (clock, zone) = rest.split_at(zone_at);
    let mut parts = clock.splitn(3, ':');
    let (h, mi) = (num(parts.next()?)?, num(parts.next()?)?);
    let (sec, ms) = match parts.next() {
        None => (0, 0),
        Some(sf) => {
            let (sec, frac) = sf.split_once('.').unwrap_or((sf, ""));
            let frac: String = frac.chars().chain("000".chars()).take(3).collect();
            (num(sec)?, if frac == "000" { 0 } else { num(&frac)? })
        }
    };
    if h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let offset_min = match zone {
        "Z" | "z" => 0,
        z => {
            let sign = if z.starts_with('-') { -1 } else { 1 };
            let (oh, om) = z.get(1..)?.split_once(':')?;
            sign * (num(oh)? * 60 + num(om)?)
        }
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((mo + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some(((days * 24 + h) * 60 + mi - offset_min) * 60_000 + sec * 1000 + ms)
}

/// `runspool hold <run>` (`held` true) and `runspool release <run>`: write
/// `control/hold.json` or `control/release.json` into a queued run of
/// runspool's; the daemon records it in status.json (`held`).
pub fn hold(layout: &Layout, arg: &str, held: bool) -> anyhow::Result<i32> {
    let verb = if held { "hold" } else { "release" };
    let id = match resolve(layout, arg)? {
        Target::Run(id) => id,
        Target::Pending(p) => bail!(
            "{} is still a request in the spool; the daemon claims it shortly, then `runspool {verb} {}` works \
             (to queue a run held from the start, submit it with --hold)",
            p.name,
            p.run_id
        ),
        Target::Rejected { name, error_file } => {
            let (code, _) = read_error(&error_file);
            bail!(
                "{name} was refused before it ran ({}); nothing to {verb} (see {})",
                visible(&code),
                error_file.display()
            )
        }
    };
    let dir = layout.run_dir(&id);
    let s = run::read_status(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .with_context(|| format!("run {id} has no status.json yet; try again in a moment"))?;
    if !run::ownership(&dir, Some(&s)).is_ours() {
        bail!("run {id} was launched by another host (pi-subagents), not by runspool; runspool never writes into it");
    }
    if s.state != State::Queued {
        bail!(
            "run {id} is {}, not queued; only a queued run can be {}",
            visible(s.state.as_str()),
            if held { "held" } else { "released" }
        );
    }
    let file = if held { CONTROL_HOLD } else { CONTROL_RELEASE };
    let body = json!({"type": verb, "ts": crate::now_ms(), "source": "runspool-cli"});
    let path = inbox::write(&dir, None, file, &serde_json::to_vec(&body)?)
        .with_context(|| format!("cannot write {}/control/{file}", dir.display()))?;
    eprintln!(
        "runspool: asked to {verb} run {id} ({}); the daemon records it as `\"held\": {held}` in its status",
        path.display()
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(parse_time("1767225600000"), Ok(1_767_225_600_000));
        assert_eq!(parse_time("2026-01-01T00:00:00Z"), Ok(1_767_225_600_000));
        assert_eq!(parse_time("2026-01-01T02:00:00+02:00"), Ok(1_767_225_600_000));
        assert_eq!(parse_time("2025-12-31T19:00:00.250-05:00"), Ok(1_767_225_600_250));
        assert_eq!(parse_time("1970-01-01T00:00Z"), Ok(0));
        assert_eq!(parse_time("2000-02-29T12:00:00Z"), Ok(951_825_600_000));
        for bad in ["tomorrow", "2026-13-01T00:00:00Z", "2026-01-01T00:00:00", "2026-01-01"] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }
}
