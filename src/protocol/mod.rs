//! Serde types and validation of the on-disk protocol. Pure: no I/O.

pub mod bridge;
pub mod control;
pub mod daemon;
pub mod ids;
pub mod jsjson;
pub mod outcome;
pub mod request;
pub mod seg;
pub mod status;
pub mod wording;

/// A string-valued enum that keeps values it does not know (PROTOCOL §14:
/// readers accept every state, mode and step status a pi-subagents host
/// writes, and unknown ones, without error). Known values get a variant;
/// anything else is kept verbatim in `Other` and written back unchanged.
macro_rules! open_enum {
    ($(#[$m:meta])* pub enum $name:ident { $($(#[$vm:meta])* $v:ident => $s:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vm])* $v,)*
            /// A value this version of runspool does not know, kept as written.
            Other(String),
        }
        impl $name {
            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$v => $s,)*
                    $name::Other(s) => s,
                }
            }
        }
        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                match s {
                    $($s => $name::$v,)*
                    other => $name::Other(other.to_string()),
                }
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
                Ok($name::from(s.as_ref()))
            }
        }
    };
}
pub(crate) use open_enum;
