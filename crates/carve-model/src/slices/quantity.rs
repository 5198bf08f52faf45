//! Kubernetes resource quantities (`81559Mi`, `1.5Gi`, `500m`, `16`, `1e3`)
//! parsed into an exact value in milli-units.
//!
//! k8s-openapi's `Quantity` is a plain string newtype and kube-core offers no
//! parser, so carve has this small one. It follows the grammar in the Quantity
//! API docs; like Kubernetes it rounds anything finer than a milli-unit up (away
//! from zero) and rejects magnitudes above 2^63-1.

use std::cmp::Ordering;
use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// An exact quantity, in milli-units (`1` is 1000, `500m` is 500).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Amount {
    milli: i128,
}

impl Amount {
    /// Zero.
    pub const ZERO: Self = Self { milli: 0 };

    /// A whole number of units.
    #[must_use]
    pub const fn from_int(v: i64) -> Self {
        Self {
            milli: v as i128 * 1000,
        }
    }

    /// The value in milli-units.
    #[must_use]
    pub const fn milli(self) -> i128 {
        self.milli
    }

    /// The value in whole units, rounded up (Kubernetes `Quantity.Value()`).
    #[must_use]
    pub fn value_ceil(self) -> i128 {
        self.milli.div_euclid(1000) + i128::from(self.milli.rem_euclid(1000) != 0)
    }

    /// Sum, `None` on overflow.
    #[must_use]
    pub fn checked_add(self, o: Self) -> Option<Self> {
        self.milli.checked_add(o.milli).map(|milli| Self { milli })
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.milli % 1000 == 0 {
            write!(f, "{}", self.milli / 1000)
        } else {
            write!(f, "{}m", self.milli)
        }
    }
}

/// A string that is not a Kubernetes quantity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text does not follow the quantity grammar.
    #[error("quantity {input:?} is malformed: {why}")]
    Malformed {
        /// The text.
        input: String,
        /// What is wrong.
        why: &'static str,
    },
    /// The magnitude is above 2^63-1 (or too large to compute exactly).
    #[error("quantity {input:?} is out of range (magnitude above 2^63-1)")]
    OutOfRange {
        /// The text.
        input: String,
    },
}

/// Most digits carve accepts in a mantissa, and largest decimal exponent: far
/// beyond any value below 2^63 in milli-units, and safe in i128 arithmetic.
const MAX_DIGITS: usize = 30;
const MAX_EXP: i32 = 30;

/// The suffix family a quantity is written in; Kubernetes prints values
/// computed from a quantity in the same family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantityFormat {
    /// `Ki`, `Mi`, ... `Ei`.
    BinarySi,
    /// No suffix, or `n`, `u`, `m`, `k`, `M`, ... `E`.
    DecimalSi,
    /// `e<n>` / `E<n>`.
    DecimalExponent,
}

/// A quantity exactly as written, before any rounding: `±mantissa × 2^base2 ×
/// 10^exp10`. [`parse_exact`] makes it; [`Exact::scaled`] rounds it to a
/// precision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exact {
    input: String,
    parts: Parts,
}

impl Exact {
    /// The suffix family.
    #[must_use]
    pub fn format(&self) -> QuantityFormat {
        self.parts.format
    }

    /// The value in units of 10^-`decimals` (3: milli-units, 9: nano-units),
    /// rounded up away from zero like Kubernetes.
    ///
    /// # Errors
    /// [`QuantityError::OutOfRange`] when the magnitude is above 2^63-1 or the
    /// precision is too fine to compute exactly.
    pub fn scaled(&self, decimals: u32) -> Result<i128, QuantityError> {
        self.parts
            .scaled(decimals)
            .ok_or_else(|| QuantityError::OutOfRange {
                input: self.input.clone(),
            })
    }
}

/// The parsed form of a quantity without its text: what [`Exact`] holds, made
/// without allocating so that validating many quantities stays cheap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Parts {
    negative: bool,
    mantissa: i128,
    base2: u32,
    exp10: i32,
    format: QuantityFormat,
}

impl Parts {
    /// As [`Exact::scaled`]; `None` when out of range.
    fn scaled(&self, decimals: u32) -> Option<i128> {
        if self.mantissa == 0 {
            return Some(0);
        }
        let decimals_i = i32::try_from(decimals).ok()?;
        // value = mant * 2^base2 * 10^(exp10 + decimals)
        let scale = self.exp10 + decimals_i;
        let mut v = self.mantissa.checked_mul(1i128.checked_shl(self.base2)?)?;
        if scale >= 0 {
            v = v.checked_mul(pow10(scale.unsigned_abs())?)?;
        } else {
            // Divide in steps that fit an i128, rounding up each time; for
            // positive integers ceil(ceil(x / a) / b) == ceil(x / (a * b)).
            let mut left = scale.unsigned_abs();
            while left > 0 {
                let step = left.min(38);
                let den = 10i128.pow(step);
                v = v / den + i128::from(v % den != 0);
                left -= step;
            }
        }
        let limit = i128::from(i64::MAX).checked_mul(pow10(decimals)?)?;
        if v.cmp(&limit) == Ordering::Greater {
            return None;
        }
        Some(if self.negative { -v } else { v })
    }
}

/// 10^`e`, `None` when it does not fit an i128 (`e` > 38).
fn pow10(e: u32) -> Option<i128> {
    const POW10: [i128; 39] = {
        let mut t = [1i128; 39];
        let mut i = 1;
        while i < 39 {
            t[i] = t[i - 1] * 10;
            i += 1;
        }
        t
    };
    POW10.get(usize::try_from(e).ok()?).copied()
}

/// Parse a Kubernetes quantity string.
///
/// # Errors
/// [`QuantityError`] naming the text and what is wrong with it.
pub fn parse_quantity(input: &str) -> Result<Amount, QuantityError> {
    if let Some(a) = plain(input) {
        return Ok(a);
    }
    let milli = parse_parts(input)?
        .scaled(3)
        .ok_or_else(|| QuantityError::OutOfRange {
            input: input.to_string(),
        })?;
    Ok(Amount { milli })
}

/// The forms carve writes, by far the most common ones it validates: up to 15
/// digits, bare or with `Ki`, `Mi`, `Gi` or `Ti`. `None` for anything else,
/// including a value above the grammar's range, which [`parse_parts`] then
/// judges. Same result as the general path (tested).
fn plain(input: &str) -> Option<Amount> {
    let b = input.as_bytes();
    let digits = b.iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 || digits > 15 {
        return None;
    }
    let shift = match &b[digits..] {
        b"" => 0,
        b"Ki" => 10,
        b"Mi" => 20,
        b"Gi" => 30,
        b"Ti" => 40,
        _ => return None,
    };
    let n = b[..digits]
        .iter()
        .fold(0i128, |v, &c| v * 10 + i128::from(c - b'0'));
    let v = n << shift;
    (v <= i128::from(i64::MAX)).then_some(Amount { milli: v * 1000 })
}

/// Parse a Kubernetes quantity string into its exact value (the grammar of
/// [`parse_quantity`], without rounding): for callers that need another
/// precision or the suffix family.
///
/// # Errors
/// [`QuantityError`] naming the text and what is wrong with it.
pub fn parse_exact(input: &str) -> Result<Exact, QuantityError> {
    Ok(Exact {
        input: input.to_string(),
        parts: parse_parts(input)?,
    })
}

/// The grammar of [`parse_quantity`]; allocates only for an error.
fn parse_parts(input: &str) -> Result<Parts, QuantityError> {
    let bad = |why| QuantityError::Malformed {
        input: input.to_string(),
        why,
    };
    let range = || QuantityError::OutOfRange {
        input: input.to_string(),
    };
    let (negative, rest) = match input.as_bytes().first() {
        None => return Err(bad("empty")),
        Some(b'-') => (true, &input[1..]),
        Some(b'+') => (false, &input[1..]),
        Some(_) => (false, input),
    };
    // The number is the longest prefix of digits and '.'; both are ASCII, so
    // the byte after it starts a character.
    let bytes = rest.as_bytes();
    let mut num_end = 0;
    let mut dot = None;
    while let Some(&b) = bytes.get(num_end) {
        match b {
            b'0'..=b'9' => {}
            b'.' if dot.is_none() => dot = Some(num_end),
            b'.' => return Err(bad("more than one decimal point")),
            _ => break,
        }
        num_end += 1;
    }
    let (number, suffix) = rest.split_at(num_end);
    let (int_part, frac_part) = match dot {
        Some(d) => (&number[..d], &number[d + 1..]),
        None => (number, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(bad("no digits"));
    }
    // Base 2 or 10 exponent of the suffix.
    let (base2, exp10, format): (u32, i32, QuantityFormat) = match suffix {
        "" => (0, 0, QuantityFormat::DecimalSi),
        "n" => (0, -9, QuantityFormat::DecimalSi),
        "u" => (0, -6, QuantityFormat::DecimalSi),
        "m" => (0, -3, QuantityFormat::DecimalSi),
        "k" => (0, 3, QuantityFormat::DecimalSi),
        "M" => (0, 6, QuantityFormat::DecimalSi),
        "G" => (0, 9, QuantityFormat::DecimalSi),
        "T" => (0, 12, QuantityFormat::DecimalSi),
        "P" => (0, 15, QuantityFormat::DecimalSi),
        "E" => (0, 18, QuantityFormat::DecimalSi),
        "Ki" => (10, 0, QuantityFormat::BinarySi),
        "Mi" => (20, 0, QuantityFormat::BinarySi),
        "Gi" => (30, 0, QuantityFormat::BinarySi),
        "Ti" => (40, 0, QuantityFormat::BinarySi),
        "Pi" => (50, 0, QuantityFormat::BinarySi),
        "Ei" => (60, 0, QuantityFormat::BinarySi),
        s if s.starts_with(['e', 'E']) => {
            let e = &s[1..];
            let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad("exponent is not an integer"));
            }
            let v: i64 = e.parse().map_err(|_| bad("exponent is not an integer"))?;
            if v.unsigned_abs() > MAX_EXP as u64 {
                return Err(range());
            }
            (0, v as i32, QuantityFormat::DecimalExponent)
        }
        _ => {
            return Err(bad(
                "unknown suffix (want n, u, m, k, M, G, T, P, E, Ki..Ei or e<n>)",
            ));
        }
    };
    // Mantissa digits: the integer part then the fraction without its
    // trailing zeros, leading zeros not counted.
    let frac = frac_part.trim_end_matches('0');
    let int_digits = int_part.trim_start_matches('0');
    let mant_len = if int_digits.is_empty() {
        frac.trim_start_matches('0').len()
    } else {
        int_digits.len() + frac.len()
    };
    if mant_len > MAX_DIGITS || frac.len() > MAX_DIGITS {
        return Err(bad("too many digits"));
    }
    // At most 30 significant digits: always fits an i128.
    let mantissa = int_digits
        .bytes()
        .chain(frac.bytes())
        .fold(0i128, |m, b| m * 10 + i128::from(b - b'0'));
    Ok(Parts {
        negative,
        mantissa,
        base2,
        exp10: exp10 - frac.len() as i32,
        format,
    })
}

/// Parse a [`Quantity`].
///
/// # Errors
/// As [`parse_quantity`].
pub fn parse(q: &Quantity) -> Result<Amount, QuantityError> {
    parse_quantity(&q.0)
}

/// A quantity of `mib` mebibytes, as carve publishes memory (`81559Mi`).
#[must_use]
pub fn mebibytes(mib: u64) -> Quantity {
    Quantity(format!("{mib}Mi"))
}

/// A plain integer quantity.
#[must_use]
pub fn int(v: u64) -> Quantity {
    Quantity(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn milli(s: &str) -> i128 {
        parse_quantity(s)
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .milli()
    }

    #[test]
    fn the_plain_forms_parse_as_the_general_grammar_does() {
        let general = |s: &str| parse_parts(s).ok().and_then(|p| p.scaled(3));
        let mut inputs: Vec<String> = [
            "0",
            "1",
            "007",
            "16",
            "132",
            "81559Mi",
            "143771Mi",
            "1Ki",
            "1Gi",
            "8Ti",
            "999999999999999",
            "999999999999999Ti",
            "8388607Ti",
            "8388608Ti",
            "9223372036854775807",
            "1Pi",
            "1.5",
            "1e3",
            "-1",
            "+1",
            "1m",
            "Mi",
            "",
            "1 ",
        ]
        .map(String::from)
        .to_vec();
        inputs.extend((0..64).map(|i| format!("{}Mi", 1u64 << (i % 40))));
        for s in &inputs {
            let fast = plain(s).map(|a| a.milli);
            if let Some(f) = fast {
                assert_eq!(Some(f), general(s), "{s:?}");
            }
            assert_eq!(parse_quantity(s).ok().map(|a| a.milli), general(s), "{s:?}");
        }
        assert!(plain("81559Mi").is_some() && plain("16").is_some());
        assert!(
            plain("8388608Ti").is_none(),
            "above 2^63-1: left to the general path"
        );
    }

    #[test]
    fn parses_every_suffix_form_exactly() {
        assert_eq!(milli("81559Mi"), 81559 * 1024 * 1024 * 1000);
        assert_eq!(milli("1"), 1000);
        assert_eq!(milli("16"), 16000);
        assert_eq!(milli("1.5Gi"), 1_610_612_736_000);
        assert_eq!(milli("500m"), 500);
        assert_eq!(milli("1e3"), 1_000_000);
        assert_eq!(milli("1E3"), 1_000_000);
        assert_eq!(milli("2E"), 2_000_000_000_000_000_000_000);
        assert_eq!(milli("1.5"), 1500);
        assert_eq!(milli(".5"), 500);
        assert_eq!(milli("5."), 5000);
        assert_eq!(milli("-2k"), -2_000_000);
        assert_eq!(milli("+7"), 7000);
        assert_eq!(milli("0"), 0);
        assert_eq!(milli("000120"), 120_000);
        assert_eq!(milli("1.000"), 1000);
        assert_eq!(milli("1e-3"), 1);
        assert_eq!(milli("0.000"), 0);
        assert_eq!(milli("250u"), 1);
        assert_eq!(milli("2000000n"), 2);
        assert_eq!(milli("0.0012"), 2);
        assert_eq!(milli("00.5"), 500);
        assert_eq!(milli("1.0000000000000000000000000001"), 1001);
        assert_eq!(
            milli("123456789012345678901234567890e-20"),
            1_234_567_890_124
        );
    }

    #[test]
    fn finer_than_milli_rounds_up() {
        assert_eq!(milli("0.1m"), 1);
        assert_eq!(milli("1n"), 1);
        assert_eq!(milli("-0.1m"), -1);
        assert_eq!(parse_quantity("1500m").unwrap().value_ceil(), 2);
        assert_eq!(parse_quantity("2").unwrap().value_ceil(), 2);
    }

    #[test]
    fn rejects_malformed_and_huge_with_the_text() {
        for s in [
            "", "Mi", "1.2.3", "1x", "1 Mi", "1e", "1e1.5", "1ee3", ".", "-", "1Ki5", "mi",
        ] {
            match parse_quantity(s) {
                Err(QuantityError::Malformed { input, .. }) => assert_eq!(input, s),
                other => panic!("{s:?}: {other:?}"),
            }
        }
        for s in ["9223372036854775808", "16Ei", "1e31", "1e19"] {
            assert!(
                matches!(parse_quantity(s), Err(QuantityError::OutOfRange { .. })),
                "{s}"
            );
        }
        assert_eq!(milli("9223372036854775807"), i128::from(i64::MAX) * 1000);
    }

    #[test]
    fn exact_values_scale_to_nanos_and_keep_the_suffix_family() {
        let e = parse_exact("1.5Gi").unwrap();
        assert_eq!(e.format(), QuantityFormat::BinarySi);
        assert_eq!(e.scaled(9).unwrap(), 1_610_612_736 * 1_000_000_000);
        assert_eq!(parse_exact("1n").unwrap().scaled(9).unwrap(), 1);
        assert_eq!(parse_exact("1n").unwrap().scaled(3).unwrap(), 1);
        assert_eq!(parse_exact("-0.5n").unwrap().scaled(9).unwrap(), -1);
        assert_eq!(
            parse_exact("2e3").unwrap().format(),
            QuantityFormat::DecimalExponent
        );
        assert_eq!(
            parse_exact("2k").unwrap().format(),
            QuantityFormat::DecimalSi
        );
        assert_eq!(parse_exact("0e30").unwrap().scaled(9).unwrap(), 0);
        let tiny = format!(".{}1e-30", "0".repeat(29));
        assert_eq!(parse_exact(&tiny).unwrap().scaled(9).unwrap(), 1);
        assert!(matches!(
            parse_exact("16Ei").unwrap().scaled(9),
            Err(QuantityError::OutOfRange { input }) if input == "16Ei"
        ));
    }

    #[test]
    fn display_round_trips() {
        for s in ["0", "7", "500m", "-3"] {
            assert_eq!(parse_quantity(s).unwrap().to_string(), s);
        }
    }
}
