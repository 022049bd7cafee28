//! The names and ids of the protocol, one newtype each, with their grammar
//! `[A-Za-z0-9][A-Za-z0-9._-]{0,MAX-1}` and their cap in one place. A value
//! of one of these types was checked when it was made (`parse`); `is_valid`
//! asks the same of a string that is only compared. `store::RunId` (a run
//! directory's name) is made through `run_id_grammar`.

/// `[A-Za-z0-9][A-Za-z0-9._-]{0,max-1}`: the grammar every type here shares.
/// Only the constructors and checks of this file (and `store::RunId::parse`,
/// through `run_id_grammar`) call it.
fn is_id(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// Longest run-directory name (a file name's limit; requests allow 128).
pub const RUN_ID_MAX: usize = 255;

/// The grammar of a run directory's name (`store::RunId`), also what an
/// `after` entry must match: a run id of any origin, pi's included.
pub fn run_id_grammar(s: &str) -> bool {
    is_id(s, RUN_ID_MAX)
}

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident, $max:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// The longest value, in bytes.
            pub const MAX: usize = $max;

            /// `s` when it matches the grammar and the cap, else None.
            pub fn parse(s: &str) -> Option<$name> {
                Self::is_valid(s).then(|| $name(s.to_string()))
            }

            /// Whether `s` matches the grammar and the cap.
            pub fn is_valid(s: &str) -> bool {
                is_id(s, Self::MAX)
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }
    };
}

id_type!(
    /// The name of a launch request in the spool without `.json` (PROTOCOL
    /// §2.1): a name outside the grammar is `bad-name`.
    RequestName,
    200
);

id_type!(
    /// The `runId` (or `restartOf`) a launch request may ask for (PROTOCOL
    /// §2.2): stricter than a run directory's name, so every one is also a
    /// valid `store::RunId`.
    RequestedRunId,
    128
);

id_type!(
    /// A lane's name (PROTOCOL §15): a request's `lane`, `[lanes.NAME]`.
    LaneName,
    64
);

id_type!(
    /// The NAME of `[providers.NAME]` (PROTOCOL §8.4), as a step's
    /// `externalJob.provider` names it.
    ProviderName,
    128
);

id_type!(
    /// A bridge request's id, also its file name without `.json` (PROTOCOL §8.1).
    BridgeRequestId,
    super::bridge::MAX_REQUEST_ID
);

// A requested run id is always a valid run directory name (`store::RunId: From<RequestedRunId>`).
const _: () = assert!(RequestedRunId::MAX <= RUN_ID_MAX);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_grammar() {
        assert!(is_id("a", 128));
        assert!(is_id("run-1.x_y", 128));
        assert!(!is_id("", 128));
        assert!(!is_id(".a", 128));
        assert!(!is_id("-a", 128));
        assert!(!is_id("a/b", 128));
        assert!(!is_id("..", 128));
        assert!(is_id(&"x".repeat(128), 128));
        assert!(!is_id(&"x".repeat(129), 128));
    }

    /// Each type takes its grammar up to its cap, and nothing past it or outside the grammar.
    #[test]
    fn each_type_has_its_cap() {
        fn caps<T>(max: usize, parse: fn(&str) -> Option<T>, valid: fn(&str) -> bool, show: fn(&T) -> &str) {
            let longest = "x".repeat(max);
            assert_eq!(parse(&longest).as_ref().map(show), Some(longest.as_str()));
            assert!(valid(&longest));
            assert!(parse(&"x".repeat(max + 1)).is_none() && !valid(&"x".repeat(max + 1)));
            for bad in ["", ".x", "-x", "_x", "a/b", "a b", "..", "é", "a\0"] {
                assert!(parse(bad).is_none() && !valid(bad), "{bad:?}");
            }
            assert_eq!(parse("A-1.b_c").as_ref().map(show), Some("A-1.b_c"));
        }
        caps(200, RequestName::parse, RequestName::is_valid, RequestName::as_str);
        caps(128, RequestedRunId::parse, RequestedRunId::is_valid, RequestedRunId::as_str);
        caps(64, LaneName::parse, LaneName::is_valid, LaneName::as_str);
        caps(128, ProviderName::parse, ProviderName::is_valid, ProviderName::as_str);
        caps(200, BridgeRequestId::parse, BridgeRequestId::is_valid, BridgeRequestId::as_str);
        assert!(run_id_grammar(&"x".repeat(RUN_ID_MAX)) && !run_id_grammar(&"x".repeat(RUN_ID_MAX + 1)));
    }

    #[test]
    fn values_read_and_write_as_their_string() {
        let n = LaneName::parse("gpu").unwrap();
        assert_eq!(
            (n.to_string(), &*n, serde_json::to_value(&n).unwrap()),
            ("gpu".into(), "gpu", serde_json::json!("gpu"))
        );
        assert_eq!(RequestName::parse("r1").unwrap().into_string(), "r1");
    }
}
