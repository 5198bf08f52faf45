//! Kubernetes resource quantities as exact numbers.
//!
//! A quantity (`"20Gi"`, `"1.5"`, `"500m"`, `"1e3"`) is held as an integer count of
//! nano-units (10^-9), which is the finest precision Kubernetes keeps, plus the
//! suffix family it was written in, to print computed values the same way.
//! Values finer than that are rounded up, as Kubernetes does. Parsing is
//! carve-model's (`carve_model::slices::quantity`), which rounds to milli-units
//! for its own checks; the allocator needs nano-units (CEL `quantity()`
//! comparisons, consumable capacity) and the suffix family.

use std::cmp::Ordering;
use std::fmt;

use carve_model::slices::quantity::{self, QuantityFormat};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

const NANO: i128 = 1_000_000_000;

/// Why a string is not a Kubernetes quantity (carve-model's, shared).
pub use carve_model::slices::quantity::QuantityError;

/// How a quantity was written, used to print computed values the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Powers of 1024 (`Ki`, `Mi`, `Gi`, ...).
    BinarySi,
    /// Powers of 1000 (`k`, `M`, `G`, ...) or no suffix.
    #[default]
    DecimalSi,
}

/// An exact quantity: nano-units plus the suffix family it was written in.
#[derive(Debug, Clone, Copy)]
pub struct Qty {
    nanos: i128,
    format: Format,
}

impl PartialEq for Qty {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}
impl Eq for Qty {}
impl PartialOrd for Qty {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Qty {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl Qty {
    /// Zero.
    pub const ZERO: Qty = Qty {
        nanos: 0,
        format: Format::DecimalSi,
    };

    /// The quantity `n` (a plain integer).
    pub fn from_int(n: i64) -> Qty {
        Qty {
            nanos: i128::from(n) * NANO,
            format: Format::DecimalSi,
        }
    }

    /// Parses the Kubernetes quantity grammar (carve-model's parser, kept at
    /// nano-unit precision), like Go's `resource.ParseQuantity`: no
    /// surrounding spaces, magnitudes up to 2^63-1.
    pub fn parse(input: &str) -> Result<Qty, QuantityError> {
        let exact = quantity::parse_exact(input)?;
        let format = match exact.format() {
            QuantityFormat::BinarySi => Format::BinarySi,
            QuantityFormat::DecimalSi | QuantityFormat::DecimalExponent => Format::DecimalSi,
        };
        Ok(Qty {
            nanos: exact.scaled(9)?,
            format,
        })
    }

    /// Parses a k8s-openapi [`Quantity`]; surrounding spaces are ignored, as
    /// the API server's JSON decoding does.
    pub fn from_quantity(q: &Quantity) -> Result<Qty, QuantityError> {
        Qty::parse(q.0.trim())
    }

    /// Nano-units.
    pub fn nanos(self) -> i128 {
        self.nanos
    }

    /// The suffix family this was written in.
    pub fn format(self) -> Format {
        self.format
    }

    /// Sum, keeping the left operand's format; `None` on overflow.
    pub fn checked_add(self, o: Qty) -> Option<Qty> {
        Some(Qty {
            nanos: self.nanos.checked_add(o.nanos)?,
            format: self.format,
        })
    }

    /// Difference, keeping the left operand's format; `None` on overflow.
    pub fn checked_sub(self, o: Qty) -> Option<Qty> {
        Some(Qty {
            nanos: self.nanos.checked_sub(o.nanos)?,
            format: self.format,
        })
    }

    /// Whether this is a whole number.
    pub fn is_integer(self) -> bool {
        self.nanos % NANO == 0
    }

    /// The value as an integer, rounded up like Kubernetes' `Quantity.Value()`;
    /// `None` if it does not fit in an `i64`.
    pub fn as_i64_ceil(self) -> Option<i64> {
        let v = self.nanos.div_euclid(NANO) + i128::from(self.nanos.rem_euclid(NANO) != 0);
        i64::try_from(v).ok()
    }

    /// The value as an `f64`, approximately.
    pub fn as_f64(self) -> f64 {
        self.nanos as f64 / NANO as f64
    }

    /// -1, 0 or 1.
    pub fn signum(self) -> i64 {
        self.nanos.signum() as i64
    }

    /// The smallest `min + n*step` that is `>= self` (n >= 0).
    pub fn round_up_to_step(self, min: Qty, step: Qty) -> Qty {
        if self <= min || step.nanos <= 0 {
            return Qty {
                nanos: self.nanos.max(min.nanos),
                format: min.format,
            };
        }
        let over = self.nanos - min.nanos;
        let n = (over + step.nanos - 1) / step.nanos;
        Qty {
            nanos: min.nanos + n * step.nanos,
            format: min.format,
        }
    }

    /// A k8s-openapi [`Quantity`] in canonical form.
    pub fn to_quantity(self) -> Quantity {
        Quantity(self.to_string())
    }
}

impl fmt::Display for Qty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.nanos;
        if n == 0 {
            return f.write_str("0");
        }
        if n % NANO != 0 {
            if n % 1_000_000 == 0 {
                return write!(f, "{}m", n / 1_000_000);
            }
            if n % 1_000 == 0 {
                return write!(f, "{}u", n / 1_000);
            }
            return write!(f, "{n}n");
        }
        let v = n / NANO;
        match self.format {
            Format::BinarySi => {
                for (shift, suffix) in [
                    (60, "Ei"),
                    (50, "Pi"),
                    (40, "Ti"),
                    (30, "Gi"),
                    (20, "Mi"),
                    (10, "Ki"),
                ] {
                    let unit = 1i128 << shift;
                    if v % unit == 0 {
                        return write!(f, "{}{suffix}", v / unit);
                    }
                }
                write!(f, "{v}")
            }
            Format::DecimalSi => {
                for (exp, suffix) in [
                    (18, "E"),
                    (15, "P"),
                    (12, "T"),
                    (9, "G"),
                    (6, "M"),
                    (3, "k"),
                ] {
                    let unit = 10i128.pow(exp);
                    if v % unit == 0 {
                        return write!(f, "{}{suffix}", v / unit);
                    }
                }
                write!(f, "{v}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_grammar() {
        let gi = 1i128 << 30;
        assert_eq!(Qty::parse("20Gi").unwrap().nanos(), 20 * gi * NANO);
        assert_eq!(Qty::parse("1.5Gi").unwrap().nanos(), 3 * gi / 2 * NANO);
        assert_eq!(Qty::parse("500m").unwrap().nanos(), NANO / 2);
        assert_eq!(Qty::parse("1e3").unwrap().nanos(), 1000 * NANO);
        assert_eq!(Qty::parse("-2k").unwrap().nanos(), -2000 * NANO);
        assert_eq!(Qty::parse(".5").unwrap().nanos(), NANO / 2);
        assert_eq!(Qty::parse("132").unwrap(), Qty::from_int(132));
        assert!(Qty::parse("20GB").is_err());
        assert!(Qty::parse("").is_err());
        assert!(Qty::parse("1.2.3").is_err());
        assert!(Qty::parse("abc").is_err());
        assert_eq!(Qty::parse("1n").unwrap().nanos(), 1);
        assert_eq!(Qty::parse("0.1n").unwrap().nanos(), 1);
        assert_eq!(Qty::parse("1e3").unwrap().to_string(), "1k");
        // Go's ParseQuantity takes no spaces; decoding an API object trims them.
        assert!(Qty::parse(" 1Gi").is_err());
        let q = Quantity(" 1Gi ".into());
        assert_eq!(Qty::from_quantity(&q).unwrap().to_string(), "1Gi");
        // Above 2^63-1 is refused, naming the text.
        let e = Qty::parse("9223372036854775808").unwrap_err();
        assert!(e.to_string().contains("9223372036854775808"), "{e}");
    }

    #[test]
    fn formats_canonically() {
        assert_eq!(Qty::parse("20480Mi").unwrap().to_string(), "20Gi");
        assert_eq!(Qty::parse("1000").unwrap().to_string(), "1k");
        assert_eq!(Qty::parse("1500m").unwrap().to_string(), "1500m");
        assert_eq!(Qty::parse("0Gi").unwrap().to_string(), "0");
        assert_eq!(Qty::parse("33").unwrap().to_string(), "33");
    }

    #[test]
    fn rounds_to_steps() {
        let min = Qty::parse("1Gi").unwrap();
        let step = Qty::parse("1Gi").unwrap();
        let r = Qty::parse("1500Mi").unwrap().round_up_to_step(min, step);
        assert_eq!(r.to_string(), "2Gi");
        let r = Qty::parse("1Mi").unwrap().round_up_to_step(min, step);
        assert_eq!(r.to_string(), "1Gi");
    }
}
