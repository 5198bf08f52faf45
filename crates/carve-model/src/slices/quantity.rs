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

/// Parse a Kubernetes quantity string.
///
/// # Errors
/// [`QuantityError`] naming the text and what is wrong with it.
pub fn parse_quantity(input: &str) -> Result<Amount, QuantityError> {
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
    let num_end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(num_end);
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => {
            if f.contains('.') {
                return Err(bad("more than one decimal point"));
            }
            (i, f)
        }
        None => (number, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(bad("no digits"));
    }
    // Base 2 or 10 exponent of the suffix.
    let (base2, exp10): (u32, i32) = match suffix {
        "" => (0, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
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
            (0, v as i32)
        }
        _ => {
            return Err(bad(
                "unknown suffix (want n, u, m, k, M, G, T, P, E, Ki..Ei or e<n>)",
            ));
        }
    };
    // Mantissa digits, without trailing fractional zeros or leading zeros.
    let frac = frac_part.trim_end_matches('0');
    let digits = format!("{int_part}{frac}");
    let mant_digits = digits.trim_start_matches('0');
    if mant_digits.len() > MAX_DIGITS || frac.len() > MAX_DIGITS {
        return Err(bad("too many digits"));
    }
    let mant: i128 = if mant_digits.is_empty() {
        0
    } else {
        mant_digits.parse().map_err(|_| range())?
    };
    // milli = mant * 2^base2 * 10^(exp10 + 3 - frac.len())
    let scale = exp10 + 3 - frac.len() as i32;
    let mut num = mant.checked_mul(1i128 << base2).ok_or_else(range)?;
    let mut den: i128 = 1;
    if scale >= 0 {
        num = num
            .checked_mul(10i128.checked_pow(scale as u32).ok_or_else(range)?)
            .ok_or_else(range)?;
    } else {
        den = 10i128.checked_pow((-scale) as u32).ok_or_else(range)?;
    }
    let mut milli = num / den;
    if num % den != 0 {
        milli += 1;
    }
    if milli.cmp(&(i128::from(i64::MAX) * 1000)) == Ordering::Greater {
        return Err(range());
    }
    Ok(Amount {
        milli: if negative { -milli } else { milli },
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
    fn display_round_trips() {
        for s in ["0", "7", "500m", "-3"] {
            assert_eq!(parse_quantity(s).unwrap().to_string(), s);
        }
    }
}
