//! Control requests (PROTOCOL §9) in pi-subagents 0.67's form:
//! `control/stop-requests/<ts>-<uuid>.json` =
//! `{"type":"stop","ts"?,"source"?,"reason"?,"targetIndex"?,"childId"?}`,
//! consumed in `ts` order. Pure: no I/O.

use serde_json::Value;

/// Largest stop-request file read; larger ones are removed unread.
pub const MAX_STOP_REQUEST_BYTES: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopRequest {
    pub ts: Option<i64>,
    pub source: Option<String>,
    pub reason: Option<String>,
    /// A flat step index (0.67: a child index, 0 to 1,000,000).
    pub target_index: Option<u64>,
    /// A child id (0.67: non-empty, no newline, at most 256 characters).
    pub child_id: Option<String>,
}

/// Parse a stop request the way 0.67's runner does: anything that is not an
/// object of `type: "stop"` with valid optional fields is not a request.
pub fn parse_stop_request(bytes: &[u8]) -> Option<StopRequest> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    let o = v.as_object()?;
    if o.get("type")?.as_str()? != "stop" {
        return None;
    }
    let target_index = match o.get("targetIndex") {
        None => None,
        Some(t) => Some(t.as_u64().filter(|i| *i <= 1_000_000)?),
    };
    let child_id = match o.get("childId") {
        None => None,
        Some(c) => {
            let c = c.as_str().filter(|c| !c.trim().is_empty() && !c.contains(['\n', '\r']) && c.len() <= 256)?;
            Some(c.to_string())
        }
    };
    let text = |k: &str| o.get(k).and_then(Value::as_str).map(str::to_string);
    Some(StopRequest {
        ts: o.get("ts").and_then(Value::as_i64),
        source: text("source"),
        reason: text("reason"),
        target_index,
        child_id,
    })
}

/// The file name 0.67 gives a stop request: `ts` zero-padded to 13 digits,
/// then a UUID, so names sort in `ts` order.
pub fn stop_request_name(ts: i64, uuid: &str) -> String {
    format!("{:013}-{uuid}.json", ts.max(0))
}

/// What a stop request says, as one line for status errors and events.
pub fn describe(r: &StopRequest, default_source: &str) -> String {
    let source = r.source.as_deref().unwrap_or(default_source);
    match &r.reason {
        Some(reason) => format!("stopped by {source}: {reason}"),
        None => format!("stopped by {source}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_requests_parse_as_0_67_does() {
        let r =
            parse_stop_request(br#"{"type":"stop","ts":5,"source":"pi","reason":"enough","targetIndex":2}"#).unwrap();
        assert_eq!((r.ts, r.target_index, r.reason.as_deref()), (Some(5), Some(2), Some("enough")));
        assert_eq!(describe(&r, "x"), "stopped by pi: enough");
        assert!(parse_stop_request(br#"{"type":"steer"}"#).is_none());
        assert!(parse_stop_request(br#"{"type":"stop","targetIndex":-1}"#).is_none());
        assert!(parse_stop_request(br#"{"type":"stop","childId":"a\nb"}"#).is_none());
        assert!(parse_stop_request(b"[1]").is_none());
        assert_eq!(parse_stop_request(br#"{"type":"stop"}"#), Some(StopRequest::default()));
        assert_eq!(stop_request_name(1700000000000, "u"), "1700000000000-u.json");
        assert!(stop_request_name(5, "u") < stop_request_name(40, "u"), "names sort in ts order");
    }
}
