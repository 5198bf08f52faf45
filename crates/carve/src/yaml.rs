//! YAML that YAML 1.1 readers read back as it was written.
//!
//! `serde_norway` quotes a string only where its own YAML 1.2 resolver would
//! read it as something else (`"true"`, `"80"`, `"null"`). YAML 1.1 readers
//! (PyYAML, Go's `gopkg.in/yaml.v2`, Ruby's Psych) resolve more plain
//! scalars: `0000:18:00.0` and `1:20` are base-60 numbers, `0755` is octal,
//! `yes`/`no`/`on`/`off`/`y`/`n` are booleans, `1_000` is a number,
//! `2024-01-02` is a date. [`to_string`] serializes with `serde_norway` and
//! then single-quotes every plain scalar that `serde_norway` reads back as a
//! string but that a YAML 1.1 reader would not, so both read the same value.

use serde::Serialize;

/// `value` as YAML (`serde_norway`'s block style) whose strings a YAML 1.1
/// reader reads as strings, see the module documentation.
///
/// # Errors
/// `serde_norway`'s, when `value` cannot be serialized.
pub fn to_string<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_norway::Error> {
    Ok(quote_yaml11(&serde_norway::to_string(value)?))
}

/// Single-quote the plain scalars of `serde_norway`'s block-style output
/// that it reads as strings and YAML 1.1 does not; the rest is unchanged.
pub fn quote_yaml11(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    // Inside a block scalar (`key: |-`): lines indented deeper than the
    // node that started it are its content, taken as they are.
    let mut block: Option<usize> = None;
    for line in text.split_inclusive('\n') {
        let body = line.trim_end_matches('\n');
        let indent = body.len() - body.trim_start_matches(' ').len();
        if let Some(node) = block
            && (body.trim().is_empty() || indent > node)
        {
            out.push_str(line);
            continue;
        }
        let (fixed, block_at) = quote_line(body);
        block = block_at;
        out.push_str(&fixed);
        out.push_str(&line[body.len()..]);
    }
    out
}

/// One line: `- ` markers, then `key: value`, `key:` or a lone value.
/// Returns the line and, where a block scalar starts on it, the column of
/// its node.
fn quote_line(line: &str) -> (String, Option<usize>) {
    let mut col = line.len() - line.trim_start_matches(' ').len();
    let mut rest = &line[col..];
    while let Some(r) = rest.strip_prefix("- ") {
        rest = r;
        col += 2;
    }
    let mut out = line[..col].to_string();
    if rest == "-" || rest == "---" || rest.is_empty() {
        out.push_str(rest);
        return (out, None);
    }
    let (key, value) = split_key(rest);
    if let Some(key) = key {
        out.push_str(&quote_scalar(key));
        out.push(':');
        match value {
            Some(v) => {
                out.push(' ');
                out.push_str(&quote_scalar(v));
                let block = v.starts_with('|') || v.starts_with('>');
                (out, block.then_some(col))
            }
            None => (out, None),
        }
    } else {
        out.push_str(&quote_scalar(rest));
        let block = rest.starts_with('|') || rest.starts_with('>');
        (out, block.then_some(col))
    }
}

/// Split `key: value` / `key:` into key and value; `(None, _)` for a line
/// that is a lone value.
fn split_key(rest: &str) -> (Option<&str>, Option<&str>) {
    let key_end = match rest.as_bytes()[0] {
        q @ (b'\'' | b'"') => match quoted_end(rest, q) {
            Some(end) => end,
            None => return (None, None),
        },
        _ => match rest.find(": ") {
            Some(i) => i,
            None if rest.ends_with(':') => rest.len() - 1,
            None => return (None, None),
        },
    };
    let after = &rest[key_end..];
    if after == ":" {
        (Some(&rest[..key_end]), None)
    } else if let Some(v) = after.strip_prefix(": ") {
        (Some(&rest[..key_end]), Some(v))
    } else {
        // A quoted lone value.
        (None, None)
    }
}

/// The end (exclusive) of the quoted scalar at the start of `s`.
fn quoted_end(s: &str, q: u8) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = 1;
    while i < b.len() {
        if q == b'"' && b[i] == b'\\' {
            i += 2;
            continue;
        }
        if b[i] == q {
            if q == b'\'' && b.get(i + 1) == Some(&b'\'') {
                i += 2;
                continue;
            }
            return Some(i + 1);
        }
        i += 1;
    }
    None
}

/// `s` single-quoted where it is a plain scalar that `serde_norway` reads as
/// a string and a YAML 1.1 reader as something else; else `s`.
fn quote_scalar(s: &str) -> String {
    let plain = !matches!(
        s.as_bytes().first(),
        None | Some(b'\'' | b'"' | b'|' | b'>' | b'{' | b'[' | b'!' | b'&' | b'*')
    );
    if plain
        && yaml11_not_a_string(s)
        && matches!(
            serde_norway::from_str::<serde_norway::Value>(s),
            Ok(serde_norway::Value::String(_))
        )
    {
        format!("'{}'", s.replace('\'', "''"))
    } else {
        s.to_string()
    }
}

/// Whether a YAML 1.1 reader could resolve the plain scalar `s` to
/// something other than a string (bool, null, int, float, timestamp,
/// merge or value key). Errs on the side of yes: quoting a string that
/// needs none changes nothing a reader sees.
pub fn yaml11_not_a_string(s: &str) -> bool {
    const WORDS: [&str; 13] = [
        "y", "n", "yes", "no", "true", "false", "on", "off", "null", "~", "", "<<", "=",
    ];
    let lower = s.to_ascii_lowercase();
    if WORDS.contains(&lower.as_str()) {
        return true;
    }
    let t = lower.strip_prefix(['-', '+']).unwrap_or(&lower);
    if t == ".inf" || t == ".nan" {
        return true;
    }
    let digits_of = |body: &str, ok: fn(u8) -> bool| {
        !body.is_empty() && body.bytes().all(|b| ok(b) || b == b'_')
    };
    if t.strip_prefix("0b")
        .is_some_and(|b| digits_of(b, |c| c == b'0' || c == b'1'))
        || t.strip_prefix("0x")
            .is_some_and(|h| digits_of(h, |c| c.is_ascii_hexdigit()))
    {
        return true;
    }
    // Ints (decimal, octal `0755`, `1_000`), base-60 (`1:20`,
    // `0000:18:00.0`) and floats (`1.5`, `.5`, `1.0e+3`, `1_0.5`).
    let first = t.as_bytes().first().copied();
    let numeric_start = first.is_some_and(|c| c.is_ascii_digit())
        || (first == Some(b'.') && t.as_bytes().get(1).is_some_and(u8::is_ascii_digit));
    if numeric_start
        && t.bytes()
            .all(|c| c.is_ascii_digit() || matches!(c, b'_' | b':' | b'.'))
    {
        return true;
    }
    if numeric_start
        && t.contains('.')
        && t.bytes()
            .all(|c| c.is_ascii_digit() || matches!(c, b'_' | b'.' | b'e' | b'+' | b'-'))
    {
        return true;
    }
    // Timestamps start `yyyy-m`.
    let b = s.as_bytes();
    b.len() >= 6 && b[..4].iter().all(u8::is_ascii_digit) && b[4] == b'-' && b[5].is_ascii_digit()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn yaml11_readings_are_recognised() {
        for s in [
            "0000:18:00.0",
            "1:20",
            "-1:20",
            "190:20:30.15",
            "0755",
            "0o17x0",
            "1_000",
            "0b1010",
            "0x_1F",
            "1.5",
            ".5",
            "1.0e+3",
            "+.inf",
            ".NaN",
            "yes",
            "No",
            "ON",
            "off",
            "y",
            "N",
            "~",
            "null",
            "",
            "<<",
            "=",
            "2024-01-02",
            "2001-12-14t21:59:43.10-05:00",
        ] {
            // "0o17x0" is not one: checked below.
            if s != "0o17x0" {
                assert!(yaml11_not_a_string(s), "{s:?}");
            }
        }
        for s in [
            "0o17x0",
            "h100-80gb",
            "gpu-0",
            "3g.40gb",
            "GPU-1234",
            "yesterday",
            "n1",
            "1g.10gb+me",
            "v1.35",
            "a:b",
            "mig-1g.10gb-0",
        ] {
            assert!(!yaml11_not_a_string(s), "{s:?}");
        }
    }

    /// What PyYAML would misread is quoted; what serde_norway writes as a
    /// number, a bool or null stays one; every value reads back the same.
    #[test]
    fn strings_are_quoted_and_everything_reads_back() {
        let mut m: BTreeMap<String, serde_norway::Value> = BTreeMap::new();
        let strings = [
            "0000:18:00.0",
            "1:20",
            "0755",
            "yes",
            "off",
            "y",
            "~",
            ".inf",
            "1_000",
            "2024-01-02",
            "it's 1:20",
            "gpu-0",
        ];
        for (i, s) in strings.iter().enumerate() {
            m.insert(format!("s{i:02}"), (*s).into());
        }
        m.insert("int".into(), 80.into());
        m.insert("float".into(), 1.5.into());
        m.insert("bool".into(), true.into());
        m.insert("null".into(), serde_norway::Value::Null);
        m.insert("1:20".into(), "key misread too".into());
        m.insert(
            "list".into(),
            serde_norway::to_value(vec!["0755", "on", "plain"]).unwrap(),
        );
        m.insert(
            "nested".into(),
            serde_norway::to_value(vec![BTreeMap::from([("bus", "0000:18:00.0")])]).unwrap(),
        );
        m.insert("block".into(), "line one\nyes\n1:20\n".into());
        let out = to_string(&m).unwrap();
        for want in [
            "s00: '0000:18:00.0'\n",
            "s01: '1:20'\n",
            "s02: '0755'\n",
            "s03: 'yes'\n",
            "s05: 'y'\n",
            "s06: '~'\n",
            "s09: '2024-01-02'\n",
            "s11: gpu-0\n",
            "int: 80\n",
            "float: 1.5\n",
            "bool: true\n",
            "'1:20': key misread too\n",
            "- '0755'\n",
            "- 'on'\n",
            "- plain\n",
            "- bus: '0000:18:00.0'\n",
            "  yes\n",
            "  1:20\n",
        ] {
            assert!(out.contains(want), "{want:?} in\n{out}");
        }
        let back: BTreeMap<String, serde_norway::Value> = serde_norway::from_str(&out).unwrap();
        assert_eq!(back, m, "\n{out}");
    }

    #[test]
    fn a_long_string_with_spaces_stays_on_one_line() {
        let long = format!("{} yes", "word ".repeat(40));
        let out = to_string(&BTreeMap::from([("k", long.as_str())])).unwrap();
        assert_eq!(out, format!("k: {long}\n"));
    }
}
