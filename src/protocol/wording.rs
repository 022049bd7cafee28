//! serde's type errors in a user's words: `invalid type: string "four",
//! expected u64` says Rust type names; a config file's or a request's author
//! needs "must be a whole number, 0 or more (got "four")".

/// How a nested table is written: `a table ([section] or { ... })` in TOML,
/// `an object ({...})` in JSON.
#[derive(Clone, Copy)]
pub enum Format {
    Toml,
    Json,
}

/// `msg` (a serde `invalid type` / `invalid value` message) as `must be WHAT
/// (got VALUE)`; None when it is another message or names a type that has no
/// plainer name (an enum's variants, a custom `expected` text).
pub fn plain(msg: &str, format: Format) -> Option<String> {
    let rest = msg.strip_prefix("invalid type: ").or_else(|| msg.strip_prefix("invalid value: "))?;
    let (got, expected) = rest.rsplit_once(", expected ")?;
    let table = match format {
        Format::Toml => "a table ([section] or { key = value })",
        Format::Json => "an object ({...})",
    };
    let range = |max: u64| format!("a whole number from 0 to {max}");
    let want = match expected.trim() {
        "u8" => range(u8::MAX.into()),
        "u16" => range(u16::MAX.into()),
        "u32" => range(u32::MAX.into()),
        "u64" | "usize" => "a whole number, 0 or more".to_string(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".to_string(),
        "f32" | "f64" => "a number".to_string(),
        "a boolean" => "true or false".to_string(),
        "a string" | "a borrowed string" | "a character" | "a path string" => "a string in quotes".to_string(),
        "a sequence" => "a list ([...])".to_string(),
        "a map" => table.to_string(),
        e if e.starts_with("struct ") => table.to_string(),
        _ => return None,
    };
    let got = got.trim();
    let value = |kind: &str| got.strip_prefix(kind).map(|v| v.trim().trim_matches('`').to_string());
    let shown = value("string ")
        .or_else(|| value("integer "))
        .or_else(|| value("floating point "))
        .or_else(|| value("boolean "))
        .unwrap_or_else(|| match got {
            "sequence" => "a list".to_string(),
            "map" => table.split(" (").next().unwrap_or(table).to_string(),
            "unit value" | "null" => "null".to_string(),
            other => other.to_string(),
        });
    Some(format!("must be {want} (got {shown})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_type_names_become_words() {
        let p = |m: &str| plain(m, Format::Toml).unwrap();
        assert_eq!(
            p("invalid type: string \"four\", expected u64"),
            "must be a whole number, 0 or more (got \"four\")"
        );
        assert_eq!(p("invalid value: integer `-1`, expected u64"), "must be a whole number, 0 or more (got -1)");
        assert_eq!(
            p("invalid value: integer `70000`, expected u16"),
            "must be a whole number from 0 to 65535 (got 70000)"
        );
        assert_eq!(p("invalid type: integer `1`, expected a boolean"), "must be true or false (got 1)");
        assert_eq!(p("invalid type: integer `1`, expected a string"), "must be a string in quotes (got 1)");
        assert_eq!(p("invalid type: string \"x\", expected a sequence"), "must be a list ([...]) (got \"x\")");
        assert_eq!(
            plain("invalid type: sequence, expected struct Step", Format::Json).unwrap(),
            "must be an object ({...}) (got a list)"
        );
        assert!(plain("unknown field `x`, expected one of `a`, `b`", Format::Toml).is_none());
        assert!(plain("invalid value: string \"z\", expected one of `a`, `b`", Format::Json).is_none());
    }
}
