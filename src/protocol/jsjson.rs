//! JSON as JavaScript reads and writes it: `JSON.parse` into JavaScript
//! values and `JSON.stringify(v)` / `JSON.stringify(v, null, 2)` back to text.
//!
//! The steward (PROTOCOL §14.1) must write exactly the bytes pi-subagents
//! 0.67's own code writes, so this module keeps what serde_json does not:
//! strings as UTF-16 code units (lone surrogates included), every number as
//! the IEEE double `JSON.parse` makes of it, property order as JavaScript
//! orders it (integer-like keys first, ascending, then insertion order),
//! `undefined` (omitted from objects, `null` in arrays) and ECMAScript's
//! Number::toString. Pure: no I/O.

use std::fmt::Write as _;

/// A JavaScript string: UTF-16 code units, possibly with lone surrogates.
pub type JsStr = Vec<u16>;

/// A JavaScript value as JSON.parse makes it, plus `undefined`.
#[derive(Debug, Clone, PartialEq)]
pub enum JsVal {
    Undefined,
    Null,
    Bool(bool),
    Num(f64),
    Str(JsStr),
    Arr(Vec<JsVal>),
    Obj(JsObj),
}

/// An ordinary object: own properties in insertion order. The order
/// JavaScript enumerates (integer-like keys first) is applied on output.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JsObj(pub Vec<(JsStr, JsVal)>);

/// UTF-16 code units of a Rust string.
pub fn js(s: &str) -> JsStr {
    s.encode_utf16().collect()
}

/// `JsVal::Str` of a Rust string.
pub fn jstr(s: &str) -> JsVal {
    JsVal::Str(js(s))
}

/// The Rust string of JavaScript string `s`, or None when it holds a lone
/// surrogate.
pub fn rust_string(s: &[u16]) -> Option<String> {
    String::from_utf16(s).ok()
}

impl JsObj {
    pub fn new() -> JsObj {
        JsObj(Vec::new())
    }

    /// `o[key]`: `Undefined` when missing.
    pub fn get(&self, key: &str) -> &JsVal {
        static UNDEFINED: JsVal = JsVal::Undefined;
        let k = js(key);
        self.0.iter().find(|(n, _)| *n == k).map(|(_, v)| v).unwrap_or(&UNDEFINED)
    }

    pub fn has(&self, key: &str) -> bool {
        let k = js(key);
        self.0.iter().any(|(n, _)| *n == k)
    }

    /// `o[key] = v`: an existing property keeps its place, a new one goes last.
    pub fn set_units(&mut self, key: JsStr, v: JsVal) {
        match self.0.iter_mut().find(|(n, _)| *n == key) {
            Some(slot) => slot.1 = v,
            None => self.0.push((key, v)),
        }
    }

    pub fn set(&mut self, key: &str, v: JsVal) {
        self.set_units(js(key), v)
    }

    /// `delete o[key]`.
    pub fn remove(&mut self, key: &str) {
        let k = js(key);
        self.0.retain(|(n, _)| *n != k);
    }
}

impl JsVal {
    pub fn as_obj(&self) -> Option<&JsObj> {
        match self {
            JsVal::Obj(o) => Some(o),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&[u16]> {
        match self {
            JsVal::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_num(&self) -> Option<f64> {
        match self {
            JsVal::Num(n) => Some(*n),
            _ => None,
        }
    }
    /// `v === undefined || v === null` (what `??` and `?.` test).
    pub fn is_nullish(&self) -> bool {
        matches!(self, JsVal::Undefined | JsVal::Null)
    }
    /// JavaScript truthiness.
    pub fn truthy(&self) -> bool {
        match self {
            JsVal::Undefined | JsVal::Null => false,
            JsVal::Bool(b) => *b,
            JsVal::Num(n) => *n != 0.0 && !n.is_nan(),
            JsVal::Str(s) => !s.is_empty(),
            JsVal::Arr(_) | JsVal::Obj(_) => true,
        }
    }
    /// `a ?? b`.
    pub fn or_else(&self, b: impl FnOnce() -> JsVal) -> JsVal {
        if self.is_nullish() {
            b()
        } else {
            self.clone()
        }
    }
    /// `v === "s"`.
    pub fn is_str(&self, s: &str) -> bool {
        self.as_str().is_some_and(|u| u == js(s).as_slice())
    }
}

// ---------------------------------------------------------------------------
// JSON.parse
// ---------------------------------------------------------------------------

/// Deepest nesting `parse` accepts (deeper text is refused, where V8 might
/// still parse it: the caller then leaves the file alone).
pub const MAX_DEPTH: usize = 512;

/// Why `parse` refused a text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not JSON as JSON.parse reads it: {0} at byte {1}")]
pub struct ParseError(pub &'static str, pub usize);

/// `JSON.parse(text)`.
pub fn parse(text: &str) -> Result<JsVal, ParseError> {
    let mut p = Parser { s: text.as_bytes(), i: 0, text };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    if p.i != p.s.len() {
        return Err(ParseError("unexpected text after the value", p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    text: &'a str,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }
    fn err<T>(&self, what: &'static str) -> Result<T, ParseError> {
        Err(ParseError(what, self.i))
    }
    fn eat(&mut self, lit: &[u8]) -> bool {
        if self.s[self.i..].starts_with(lit) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }
    fn value(&mut self, depth: usize) -> Result<JsVal, ParseError> {
        if depth > MAX_DEPTH {
            return self.err("nesting too deep");
        }
        let Some(&c) = self.s.get(self.i) else { return self.err("unexpected end") };
        match c {
            b'{' => {
                self.i += 1;
                let mut o = JsObj::new();
                self.ws();
                if self.eat(b"}") {
                    return Ok(JsVal::Obj(o));
                }
                loop {
                    self.ws();
                    if self.s.get(self.i) != Some(&b'"') {
                        return self.err("expected a property name");
                    }
                    let k = self.string()?;
                    self.ws();
                    if !self.eat(b":") {
                        return self.err("expected ':'");
                    }
                    self.ws();
                    let v = self.value(depth + 1)?;
                    // JSON.parse: a repeated name keeps its first place, last value.
                    o.set_units(k, v);
                    self.ws();
                    if self.eat(b",") {
                        continue;
                    }
                    if self.eat(b"}") {
                        return Ok(JsVal::Obj(o));
                    }
                    return self.err("expected ',' or '}'");
                }
            }
            b'[' => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.eat(b"]") {
                    return Ok(JsVal::Arr(a));
                }
                loop {
                    self.ws();
                    a.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat(b",") {
                        continue;
                    }
                    if self.eat(b"]") {
                        return Ok(JsVal::Arr(a));
                    }
                    return self.err("expected ',' or ']'");
                }
            }
            b'"' => Ok(JsVal::Str(self.string()?)),
            b't' if self.eat(b"true") => Ok(JsVal::Bool(true)),
            b'f' if self.eat(b"false") => Ok(JsVal::Bool(false)),
            b'n' if self.eat(b"null") => Ok(JsVal::Null),
            b'-' | b'0'..=b'9' => self.number(),
            _ => self.err("unexpected character"),
        }
    }
    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
            self.i += 1;
        }
        self.i - start
    }
    fn number(&mut self) -> Result<JsVal, ParseError> {
        let start = self.i;
        self.eat(b"-");
        match self.s.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return self.err("bad number"),
        }
        if self.eat(b".") && self.digits() == 0 {
            return self.err("bad number: no digit after '.'");
        }
        if matches!(self.s.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.s.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return self.err("bad number: no exponent digit");
            }
        }
        // Rust's parse is correctly rounded, as JSON.parse is; overflow gives ±inf.
        match self.text[start..self.i].parse::<f64>() {
            Ok(n) => Ok(JsVal::Num(n)),
            Err(_) => self.err("bad number"),
        }
    }
    fn hex4(&mut self) -> Result<u16, ParseError> {
        let Some(h) = self.s.get(self.i..self.i + 4) else { return self.err("bad \\u escape") };
        let h = std::str::from_utf8(h).ok().filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()));
        let Some(v) = h.and_then(|h| u16::from_str_radix(h, 16).ok()) else { return self.err("bad \\u escape") };
        self.i += 4;
        Ok(v)
    }
    fn string(&mut self) -> Result<JsStr, ParseError> {
        self.i += 1; // the opening quote
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.s.get(self.i) else { return self.err("unterminated string") };
            match c {
                b'"' => {
                    self.i += 1;
                    return Ok(out);
                }
                b'\\' => {
                    self.i += 1;
                    let Some(&e) = self.s.get(self.i) else { return self.err("unterminated string") };
                    self.i += 1;
                    match e {
                        b'"' => out.push(0x22),
                        b'\\' => out.push(0x5c),
                        b'/' => out.push(0x2f),
                        b'b' => out.push(0x08),
                        b'f' => out.push(0x0c),
                        b'n' => out.push(0x0a),
                        b'r' => out.push(0x0d),
                        b't' => out.push(0x09),
                        b'u' => out.push(self.hex4()?),
                        _ => return self.err("bad escape"),
                    }
                }
                0x00..=0x1f => return self.err("control character in string"),
                _ => {
                    // One whole character of the (valid UTF-8) text.
                    let ch = self.text[self.i..].chars().next().expect("inside the text");
                    let mut buf = [0u16; 2];
                    out.extend_from_slice(ch.encode_utf16(&mut buf));
                    self.i += ch.len_utf8();
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// JSON.stringify
// ---------------------------------------------------------------------------

/// `JSON.stringify(v, null, 2)`; None for a top-level `undefined`.
pub fn stringify_pretty(v: &JsVal) -> Option<String> {
    let mut out = String::new();
    write_value(&mut out, v, Some("  "), "").then_some(out)
}

/// `JSON.stringify(v)`; None for a top-level `undefined`.
pub fn stringify(v: &JsVal) -> Option<String> {
    let mut out = String::new();
    write_value(&mut out, v, None, "").then_some(out)
}

/// True when `k` is an array index (a canonical integer in 0..2^32-1):
/// JavaScript lists such own properties first, in ascending order.
pub fn is_index_key(k: &[u16]) -> Option<u32> {
    if k.is_empty() || k.len() > 10 || !k.iter().all(|&u| (b'0' as u16..=b'9' as u16).contains(&u)) {
        return None;
    }
    if k.len() > 1 && k[0] == b'0' as u16 {
        return None;
    }
    let n: u64 = k.iter().fold(0, |a, &u| a * 10 + (u - b'0' as u16) as u64);
    (n < u32::MAX as u64).then_some(n as u32)
}

/// The own keys of `o` in JavaScript's [[OwnPropertyKeys]] order.
pub fn ordered(o: &JsObj) -> Vec<&(JsStr, JsVal)> {
    let mut idx: Vec<(u32, &(JsStr, JsVal))> = o.0.iter().filter_map(|p| is_index_key(&p.0).map(|n| (n, p))).collect();
    idx.sort_by_key(|(n, _)| *n);
    let mut out: Vec<&(JsStr, JsVal)> = idx.into_iter().map(|(_, p)| p).collect();
    out.extend(o.0.iter().filter(|p| is_index_key(&p.0).is_none()));
    out
}

fn write_value(out: &mut String, v: &JsVal, gap: Option<&str>, indent: &str) -> bool {
    match v {
        JsVal::Undefined => return false,
        JsVal::Null => out.push_str("null"),
        JsVal::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        JsVal::Num(n) => {
            if n.is_finite() {
                out.push_str(&number_to_string(*n))
            } else {
                out.push_str("null")
            }
        }
        JsVal::Str(s) => quote(out, s),
        JsVal::Arr(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return true;
            }
            let inner = gap.map(|g| format!("{indent}{g}"));
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if let Some(inner) = &inner {
                    out.push('\n');
                    out.push_str(inner);
                }
                if !write_value(out, x, gap, inner.as_deref().unwrap_or("")) {
                    out.push_str("null");
                }
            }
            if gap.is_some() {
                out.push('\n');
                out.push_str(indent);
            }
            out.push(']');
        }
        JsVal::Obj(o) => {
            let inner = gap.map(|g| format!("{indent}{g}"));
            let mut any = false;
            out.push('{');
            for (k, x) in ordered(o) {
                if matches!(x, JsVal::Undefined) {
                    continue;
                }
                if any {
                    out.push(',');
                }
                any = true;
                if let Some(inner) = &inner {
                    out.push('\n');
                    out.push_str(inner);
                }
                quote(out, k);
                out.push(':');
                if gap.is_some() {
                    out.push(' ');
                }
                write_value(out, x, gap, inner.as_deref().unwrap_or(""));
            }
            if any && gap.is_some() {
                out.push('\n');
                out.push_str(indent);
            }
            out.push('}');
        }
    }
    true
}

/// JSON.stringify's QuoteJSONString (well-formed: lone surrogates escaped).
fn quote(out: &mut String, s: &[u16]) {
    out.push('"');
    for r in char::decode_utf16(s.iter().copied()) {
        match r {
            Ok('"') => out.push_str("\\\""),
            Ok('\\') => out.push_str("\\\\"),
            Ok('\u{8}') => out.push_str("\\b"),
            Ok('\u{c}') => out.push_str("\\f"),
            Ok('\n') => out.push_str("\\n"),
            Ok('\r') => out.push_str("\\r"),
            Ok('\t') => out.push_str("\\t"),
            Ok(c) if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            Ok(c) => out.push(c),
            Err(e) => {
                let _ = write!(out, "\\u{:04x}", e.unpaired_surrogate());
            }
        }
    }
    out.push('"');
}

/// ECMAScript Number::toString(10) of `x` ("NaN", "Infinity", "-0" as "0").
pub fn number_to_string(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x == 0.0 {
        return "0".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` prints the shortest digits that round-trip, the closest
    // of them to x: ECMAScript's k, s and n.
    let e = format!("{:e}", x.abs());
    let (mant, exp) = e.split_once('e').expect("LowerExp has an exponent");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i32;
    let n = exp.parse::<i32>().expect("LowerExp exponent") + 1;
    let mut out = String::new();
    if x < 0.0 {
        out.push('-');
    }
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        let e = n - 1;
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{}", if e >= 0 { "+" } else { "-" }, e.abs());
    }
    out
}

// ---------------------------------------------------------------------------
// String operations where pi-subagents cuts or trims text
// ---------------------------------------------------------------------------

/// `String.prototype.trim`: ECMAScript WhiteSpace and LineTerminator at
/// both ends (not Rust's `trim`, which differs on U+0085 and U+FEFF).
pub fn js_trim(s: &[u16]) -> &[u16] {
    fn ws(u: u16) -> bool {
        matches!(
            u,
            0x09 | 0x0a | 0x0b | 0x0c | 0x0d | 0x20 | 0xa0 | 0x1680 | 0x2000
                ..=0x200a | 0x2028 | 0x2029 | 0x202f | 0x205f | 0x3000 | 0xfeff
        )
    }
    let start = s.iter().position(|&u| !ws(u)).unwrap_or(s.len());
    let end = s.iter().rposition(|&u| !ws(u)).map(|i| i + 1).unwrap_or(start);
    &s[start..end.max(start)]
}

/// `s.slice(-n)` in UTF-16 code units (may split a surrogate pair, as JavaScript does).
pub fn slice_last(s: &[u16], n: usize) -> &[u16] {
    &s[s.len().saturating_sub(n)..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pretty(text: &str) -> String {
        stringify_pretty(&parse(text).unwrap()).unwrap()
    }

    /// Each `(input, JSON.stringify(JSON.parse(input), null, 2))` was printed by node 20.
    #[test]
    fn pretty_printing_matches_node() {
        let cases: &[(&str, &str)] = &[
            ("{}", "{}"),
            ("[]", "[]"),
            ("{\"a\":[]}", "{\n  \"a\": []\n}"),
            ("{\"a\":{}}", "{\n  \"a\": {}\n}"),
            ("[1,[2,{\"x\":null}]]", "[\n  1,\n  [\n    2,\n    {\n      \"x\": null\n    }\n  ]\n]"),
            ("{\"b\":1,\"a\":2,\"10\":3,\"2\":4,\"01\":5,\"-1\":6,\"4294967294\":7,\"4294967295\":8}",
             "{\n  \"2\": 4,\n  \"10\": 3,\n  \"4294967294\": 7,\n  \"b\": 1,\n  \"a\": 2,\n  \"01\": 5,\n  \"-1\": 6,\n  \"4294967295\": 8\n}"),
            ("{\"a\":1,\"b\":2,\"a\":3}", "{\n  \"a\": 3,\n  \"b\": 2\n}"),
            ("\"\\u0000\\u001f\\b\\f\\n\\r\\t\\\"\\\\\\/\\u007f\\u2028\"", "\"\\u0000\\u001f\\b\\f\\n\\r\\t\\\"\\\\/\u{7f}\u{2028}\""),
            ("\"\\ud800 \\udfff \\ud83d\\ude00 \\uDE00\\uD83D\"", "\"\\ud800 \\udfff 😀 \\ude00\\ud83d\""),
            ("\"é ü 日本\"", "\"é ü 日本\""),
            ("[true,false,null]", "[\n  true,\n  false,\n  null\n]"),
        ];
        for (input, want) in cases {
            assert_eq!(pretty(input), *want, "input {input}");
        }
        assert_eq!(
            stringify(&parse("{\"a\":[1,{\"b\":\"c\"}],\"d\":{}}").unwrap()).unwrap(),
            "{\"a\":[1,{\"b\":\"c\"}],\"d\":{}}"
        );
    }

    /// `String(Number(x))` in node 20 for each literal.
    #[test]
    fn numbers_match_node() {
        let cases: &[(&str, &str)] = &[
            ("0", "0"),
            ("-0", "0"),
            ("1", "1"),
            ("-1", "-1"),
            ("1.5", "1.5"),
            ("0.1", "0.1"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("123456789012345678901", "123456789012345680000"),
            ("1.5e-7", "1.5e-7"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("5e-324", "5e-324"),
            ("9007199254740993", "9007199254740992"),
            ("9007199254740995", "9007199254740996"),
            ("18446744073709551615", "18446744073709552000"),
            ("1e400", "null"),
            ("-1e400", "null"),
            ("123.456e2", "12345.6"),
            ("1.23456789012e-5", "0.0000123456789012"),
            ("2.5e+25", "2.5e+25"),
            ("1781234567890.25", "1781234567890.25"),
            ("0.30000000000000004", "0.30000000000000004"),
        ];
        for (input, want) in cases {
            let v = parse(input).unwrap();
            assert_eq!(stringify(&v).unwrap(), *want, "input {input}");
        }
        assert_eq!(number_to_string(f64::NAN), "NaN");
        assert_eq!(number_to_string(f64::INFINITY), "Infinity");
        assert_eq!(number_to_string(-1e-7), "-1e-7");
    }

    #[test]
    fn undefined_is_omitted_from_objects_and_null_in_arrays() {
        let mut o = JsObj::new();
        o.set("a", JsVal::Undefined);
        assert_eq!(stringify_pretty(&JsVal::Obj(o.clone())).unwrap(), "{}");
        o.set("b", JsVal::Num(1.0));
        assert_eq!(stringify_pretty(&JsVal::Obj(o)).unwrap(), "{\n  \"b\": 1\n}");
        let a = JsVal::Arr(vec![JsVal::Undefined, JsVal::Num(f64::NAN)]);
        assert_eq!(stringify(&a).unwrap(), "[null,null]");
        assert_eq!(stringify(&JsVal::Undefined), None);
    }

    #[test]
    fn parse_refuses_what_json_parse_refuses() {
        for bad in [
            "",
            " ",
            "{",
            "[1,]",
            "{\"a\":1,}",
            "01",
            "1.",
            ".5",
            "+1",
            "1e",
            "\"\t\"",
            "\"\\x\"",
            "\"\\u12\"",
            "NaN",
            "'a'",
            "\u{feff}{}",
            "{} x",
            "[1 2]",
            "tru",
            "nul",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(parse(" \t\r\n{\"a\" : [ 1 , 2 ] }\n").is_ok());
        let deep = "[".repeat(MAX_DEPTH + 2);
        assert!(parse(&deep).is_err());
    }

    #[test]
    fn trim_and_slice_work_on_code_units() {
        let s = js("\u{feff}\u{85} a \u{3000}\n");
        assert_eq!(js_trim(&s), js("\u{85} a").as_slice());
        assert_eq!(js_trim(&js(" \n ")), &[] as &[u16]);
        let s = js("a😀");
        assert_eq!(slice_last(&s, 1), &[0xde00]);
        assert_eq!(slice_last(&s, 9), s.as_slice());
    }
}
