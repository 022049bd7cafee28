//! Cross-checks `seg()` / `seg250()` (PROTOCOL 6.3) against an independent
//! JavaScript transcription of the spec run under Node.js, which supplies the
//! reference `encodeURIComponent` and SHA-256.
//!
//! Skipped (with a note on stderr) when `node` is not on PATH.

use std::io::Write;
use std::process::Command;

use runspool::protocol::seg::{seg, seg250};

const CASES: usize = 12_000;

/// Node side: reads a JSON array of strings from the file named by
/// `SEG_INPUT`, writes a JSON array of `[seg255, seg250]` pairs to the file
/// named by `SEG_OUTPUT`. Written straight from PROTOCOL 6.3.
const NODE_SCRIPT: &str = r#"
const fs = require('fs');
const crypto = require('crypto');

function portable(e) {
  if (e === '' || e === '.' || e === '..') return false;
  if (e.endsWith('.')) return false;
  if (/^(con|prn|aux|nul|com[1-9]|lpt[1-9])(\.|$)/i.test(e)) return false;
  if (/%5C/i.test(e)) return false;
  if (/\.[A-Za-z][A-Za-z0-9]{0,7}$/.test(e)) return false;
  return true;
}

function seg(v, max) {
  const e = encodeURIComponent(v);
  if (Buffer.byteLength(e, 'utf8') <= max && portable(e)) return e;
  return '~sha256-' + crypto.createHash('sha256').update(Buffer.from(v, 'utf8')).digest('hex');
}

const input = JSON.parse(fs.readFileSync(process.env.SEG_INPUT, 'utf8'));
if (!Array.isArray(input)) throw new Error('input is not an array');
const out = input.map((v) => [seg(v, 255), seg(v, 250)]);
fs.writeFileSync(process.env.SEG_OUTPUT, JSON.stringify(out));
"#;

/// xorshift64* PRNG, deterministic.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform-ish in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn range(&mut self, lo: usize, hi_inclusive: usize) -> usize {
        lo + self.below(hi_inclusive - lo + 1)
    }
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next() % den < num
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

const SEPARATORS: &[char] = &[
    '/', '\\', '%', '.', ' ', '+', '=', '?', '#', '&', ':', ';', '@', ',', '"', '<', '>', '|', '*', '~', '!', '\'',
    '(', ')', '-', '_', '\t', '\n', '\0',
];

const MULTIBYTE: &[char] = &[
    'é',
    'ß',
    'ñ',
    'Ω',
    'ж',
    '\u{7FF}', // 2 bytes
    '€',
    '日',
    '本',
    '語',
    '\u{800}',
    '\u{FFFD}',
    '\u{FEFF}',
    '\u{2028}',
    '\u{FFFF}', // 3 bytes
    '😀',
    '🚀',
    '👍',
    '\u{10000}',
    '\u{10FFFF}',
    '𝄞', // 4 bytes
];

const RESERVED: &[&str] = &[
    "con",
    "prn",
    "aux",
    "nul",
    "com0",
    "com1",
    "com5",
    "com9",
    "lpt0",
    "lpt1",
    "lpt9",
    "console",
    "connect",
    "nullable",
    "auxiliary",
    "com",
    "lpt",
    "com10",
];

const SUFFIXES: &[&str] = &[
    "",
    ".",
    "..",
    ".txt",
    ".x",
    ".jsonl",
    ".json",
    ".1",
    ".1b",
    ".b1",
    ".abcdefgh",
    ".abcdefghi",
    ".a-b",
    ".tar.gz",
    "%5C",
    "%5c",
    "\\",
    "-x",
    " ",
    "/",
    ".é",
    ".123456789",
];

fn random_ascii_char(rng: &mut Rng) -> char {
    // Printable ASCII plus a few controls.
    if rng.chance(1, 20) {
        char::from(rng.below(0x20) as u8)
    } else if rng.chance(1, 40) {
        '\x7f'
    } else {
        char::from(rng.range(0x20, 0x7e) as u8)
    }
}

fn random_multibyte_char(rng: &mut Rng) -> char {
    if rng.chance(1, 2) {
        rng.pick(MULTIBYTE)
    } else {
        // Any scalar value, weighted towards each UTF-8 width.
        loop {
            let cp = match rng.below(3) {
                0 => rng.range(0x80, 0x7FF),
                1 => rng.range(0x800, 0xFFFF),
                _ => rng.range(0x10000, 0x10FFFF),
            } as u32;
            if let Some(c) = char::from_u32(cp) {
                return c;
            }
        }
    }
}

fn random_mixed_char(rng: &mut Rng) -> char {
    match rng.below(10) {
        0..=4 => {
            let alnum = b"abcxyzABCXYZ0123456789";
            char::from(rng.pick(alnum))
        }
        5 | 6 => rng.pick(SEPARATORS),
        7 | 8 => random_ascii_char(rng),
        _ => random_multibyte_char(rng),
    }
}

fn random_case(rng: &mut Rng, s: &str) -> String {
    s.chars().map(|c| if rng.chance(1, 2) { c.to_ascii_uppercase() } else { c }).collect()
}

fn gen_string(rng: &mut Rng) -> String {
    match rng.below(10) {
        // Short printable ASCII.
        0 => (0..rng.range(0, 20)).map(|_| random_ascii_char(rng)).collect(),
        // Identifier-like with separators.
        1 | 2 => (0..rng.range(1, 30)).map(|_| random_mixed_char(rng)).collect(),
        // Multibyte-heavy.
        3 => (0..rng.range(1, 25))
            .map(|_| if rng.chance(2, 3) { random_multibyte_char(rng) } else { random_mixed_char(rng) })
            .collect(),
        // Reserved names, random case, with suffixes.
        4 => {
            let mut s = {
                let name = rng.pick(RESERVED);
                random_case(rng, name)
            };
            let suffix = rng.pick(SUFFIXES);
            s.push_str(&random_case(rng, suffix));
            if rng.chance(1, 4) {
                let suffix = rng.pick(SUFFIXES);
                s.push_str(&random_case(rng, suffix));
            }
            s
        }
        // Dots, extensions, near-extensions.
        5 => {
            let mut s = String::new();
            for _ in 0..rng.range(0, 3) {
                s.push(random_mixed_char(rng));
            }
            for _ in 0..rng.range(1, 3) {
                if rng.chance(1, 2) {
                    s.push_str(rng.pick(SUFFIXES));
                } else {
                    s.push('.');
                    for _ in 0..rng.range(0, 10) {
                        let pool = b"aZ09_-.";
                        s.push(char::from(rng.pick(pool)));
                    }
                }
            }
            s
        }
        // Long strings, 200-300 chars.
        6 | 7 => {
            let n = rng.range(200, 300);
            let style = rng.below(3);
            (0..n)
                .map(|_| match style {
                    0 => char::from(b'a' + rng.below(26) as u8),
                    1 => random_mixed_char(rng),
                    _ => {
                        if rng.chance(1, 30) {
                            random_multibyte_char(rng)
                        } else {
                            char::from(rng.pick(b"xyz-_0"))
                        }
                    }
                })
                .collect()
        }
        // Around the 250/255 encoded-byte boundaries.
        8 => {
            let target = rng.range(244, 262);
            let mut s = String::new();
            let mut enc = 0usize;
            while enc < target {
                let c = match rng.below(4) {
                    0 => '/', // 3 encoded bytes
                    1 => 'é', // 6 encoded bytes
                    _ => 'x', // 1 encoded byte
                };
                s.push(c);
                enc += match c {
                    '/' => 3,
                    'é' => 6,
                    _ => 1,
                };
            }
            if rng.chance(1, 3) {
                s.push_str(rng.pick(SUFFIXES));
            }
            s
        }
        // Tiny strings, including empty.
        _ => (0..rng.range(0, 3))
            .map(|_| match rng.below(3) {
                0 => '.',
                1 => random_mixed_char(rng),
                _ => random_ascii_char(rng),
            })
            .collect(),
    }
}

fn fixed_cases() -> Vec<String> {
    let mut v: Vec<String> = [
        "",
        ".",
        "..",
        "...",
        "CON",
        "con",
        "nul.txt",
        "trailing.",
        "s.jsonl",
        "call/a+b=",
        "com0",
        "com1",
        "con.x",
        "con.",
        "console",
        "%5C",
        "%5c",
        "\\",
        "a\\b",
        "a.b1",
        "a.1b",
        "x.123456789",
        "x.abcdefgh",
        "x.abcdefghi",
        "é",
        "€",
        "😀",
        "\u{10FFFF}",
        "\0",
        "~sha256-x",
        "a b",
        "?",
        "=",
        "+",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for n in [249, 250, 251, 254, 255, 256, 300] {
        v.push("x".repeat(n));
    }
    v.push("/".repeat(83)); // 249 encoded bytes
    v.push("/".repeat(84)); // 252
    v.push("/".repeat(85)); // 255
    v.push("/".repeat(86)); // 258
    v.push("😀".repeat(21)); // 252
    v
}

#[test]
fn seg_matches_node() {
    match Command::new("node").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            eprintln!(
                "skipped: node not installed (node --version failed: {})",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return;
        }
        Err(err) => {
            eprintln!("skipped: node not installed ({err})");
            return;
        }
    }

    let mut rng = Rng::new(0x5EED_0006_0003_u64);
    let mut inputs = fixed_cases();
    while inputs.len() < CASES {
        inputs.push(gen_string(&mut rng));
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let input_path = dir.path().join("input.json");
    let output_path = dir.path().join("output.json");
    {
        let mut f = std::fs::File::create(&input_path).expect("create input");
        f.write_all(serde_json::to_string(&inputs).unwrap().as_bytes()).expect("write input");
    }

    let out = Command::new("node")
        .arg("-e")
        .arg(NODE_SCRIPT)
        .env("SEG_INPUT", &input_path)
        .env("SEG_OUTPUT", &output_path)
        .output()
        .expect("run node");
    assert!(
        out.status.success(),
        "node failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let text = std::fs::read_to_string(&output_path).expect("read node output");
    let expected: Vec<(String, String)> = serde_json::from_str(&text).expect("parse node output");
    assert_eq!(expected.len(), inputs.len(), "node returned a different count");

    let mut mismatches = Vec::new();
    let (mut hashed, mut plain) = (0usize, 0usize);
    for (i, (v, (js255, js250))) in inputs.iter().zip(expected.iter()).enumerate() {
        let rs255 = seg(v);
        let rs250 = seg250(v);
        if rs255.starts_with("~sha256-") {
            hashed += 1;
        } else {
            plain += 1;
        }
        if &rs255 != js255 {
            mismatches.push(format!("#{i} seg (max 255) of {v:?}:\n    rust: {rs255}\n    node: {js255}"));
        }
        if &rs250 != js250 {
            mismatches.push(format!("#{i} seg250 (max 250) of {v:?}:\n    rust: {rs250}\n    node: {js250}"));
        }
    }

    eprintln!("seg_node: {} inputs compared ({plain} plain, {hashed} hashed at max 255)", inputs.len());
    // Both outcomes must be well represented for the comparison to mean much.
    assert!(plain > inputs.len() / 10, "too few plain results: {plain}");
    assert!(hashed > inputs.len() / 10, "too few hashed results: {hashed}");

    if !mismatches.is_empty() {
        let shown: Vec<&str> = mismatches.iter().take(20).map(|s| s.as_str()).collect();
        panic!(
            "{} mismatches between Rust and Node seg(); first {}:\n{}",
            mismatches.len(),
            shown.len(),
            shown.join("\n")
        );
    }
}
