//! Printed sizes read back as byte intervals: a figure in an out-of-memory message stands for every byte
//! count that prints as it does, and this module finds that interval exactly.
//!
//! Two printers are inverted:
//! - PyTorch's `format_size` (`c10/cuda/CUDACachingAllocator.cpp`; vramsim's copy is
//!   [`crate::format::format_size`], fact sheet §6.3): `"N bytes"` up to 1024, else two decimals of KiB,
//!   MiB or GiB. The interval is found by bisection over `format_size` itself, which is monotone in the
//!   byte count, so rounding ties (glibc's `%.2f` rounds the exact binary value half to even) come out as
//!   PyTorch prints them.
//! - TensorFlow's and XLA's `HumanReadableNumBytes` (`tensorflow/core/lib/strings/numbers.cc`, later
//!   `tsl/platform/numbers.cc`): `"NB"` below 1024, else the count is divided by 1024 with *integer*
//!   division until it is below 1 MiB, then printed as `%.1f` KiB or `%.2f` of the next unit (`"1.77GiB"`).
//!   The truncation makes each printed figure stand for a wider interval than plain rounding would.
//!
//! Sizes written any other way (another number of decimals, a unit neither printer uses) get the
//! interval that plain rounding of their decimals gives, and are marked as not exact.

use crate::format::format_size;

/// A size as printed in a message, with the interval of byte counts it stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Size {
    /// The text as printed (`"20.00 MiB"`).
    pub printed: String,
    /// The printed value times its unit, rounded to a byte (`20.00 MiB` → 20,971,520).
    pub bytes: u64,
    /// The smallest byte count that prints as `printed`.
    pub min: u64,
    /// The largest byte count that prints as `printed`.
    pub max: u64,
    /// Whether the interval is the printer's own (else plain rounding of the decimals was assumed).
    pub exact: bool,
}

impl Size {
    /// A size known to the byte.
    pub fn exact(bytes: u64, printed: String) -> Size {
        Size {
            printed,
            bytes,
            min: bytes,
            max: bytes,
            exact: true,
        }
    }
}

/// Which printer wrote a size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Printer {
    /// PyTorch's `format_size` (`"20.00 MiB"`, `"512 bytes"`).
    PyTorch,
    /// `HumanReadableNumBytes` of TensorFlow, TSL and XLA (`"1.77GiB"`, `"512B"`).
    HumanReadable,
}

/// A number with its decimals: `mantissa / 10^decimals`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Decimal {
    mantissa: u128,
    decimals: u32,
}

impl Decimal {
    fn parse(text: &str) -> Option<Decimal> {
        let (int, frac) = match text.split_once('.') {
            Some((i, f)) => (i, f),
            None => (text, ""),
        };
        if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if !frac.bytes().all(|b| b.is_ascii_digit()) || frac.len() > 6 || int.len() > 24 {
            return None;
        }
        let mantissa: u128 = format!("{int}{frac}").parse().ok()?;
        Some(Decimal {
            mantissa,
            decimals: frac.len() as u32,
        })
    }

    /// `self × unit`, rounded to the nearest byte, saturating at `u64::MAX` (NVML's "not available",
    /// `17179869184.00 GiB`, is 2^64 printed).
    fn times(self, unit: u64) -> Option<u64> {
        let scale = 10u128.pow(self.decimals);
        let v = self.mantissa.checked_mul(unit as u128)?;
        Some(u64::try_from((v + scale / 2) / scale).unwrap_or(u64::MAX))
    }
}

/// 1024^k.
fn unit_bytes(k: u32) -> u64 {
    1u64 << (10 * k)
}

/// The power of 1024 a unit name stands for (`bytes`/`B` 0, `KiB` 1, ... `EiB` 6).
fn unit_power(unit: &str) -> Option<u32> {
    Some(match unit {
        "bytes" | "B" | "byte" => 0,
        "KiB" => 1,
        "MiB" => 2,
        "GiB" => 3,
        "TiB" => 4,
        "PiB" => 5,
        "EiB" => 6,
        _ => return None,
    })
}

/// Reads a size as `printer` writes it: the number and the unit (`"20.00"`, `"MiB"`). `None` when the
/// number or unit is not one.
pub fn read(number: &str, unit: &str, printer: Printer) -> Option<Size> {
    let value = Decimal::parse(number)?;
    let power = unit_power(unit)?;
    let printed = match printer {
        Printer::PyTorch => format!("{number} {unit}"),
        Printer::HumanReadable => format!("{number}{unit}"),
    };
    let bytes = value.times(unit_bytes(power))?;
    let exact = match printer {
        Printer::PyTorch => pytorch_interval(value, power),
        Printer::HumanReadable => human_readable_interval(value, power),
    };
    Some(match exact {
        Some((min, max)) => Size {
            printed,
            bytes,
            min,
            max,
            exact: true,
        },
        None => {
            let (min, max) = rounding_interval(value, power)?;
            Size {
                printed,
                bytes,
                min,
                max,
                exact: false,
            }
        }
    })
}

/// The bytes that round to `value` at its decimals in unit 1024^power (half a last digit either side).
fn rounding_interval(value: Decimal, power: u32) -> Option<(u64, u64)> {
    let unit = unit_bytes(power) as u128;
    let scale = 10u128.pow(value.decimals) * 2;
    let twice = value.mantissa.checked_mul(2)?;
    let lo = twice.saturating_sub(1).checked_mul(unit)?;
    let hi = (twice + 1).checked_mul(unit)?;
    let min = lo.div_ceil(scale);
    let max = (hi / scale).min(u64::MAX as u128);
    Some((u64::try_from(min).ok()?, max as u64))
}

/// `(unit power, value in hundredths)` of a `format_size` text, which orders texts as byte counts do.
fn pytorch_key(text: &str) -> (u32, u128) {
    let (number, unit) = text.split_once(' ').unwrap_or((text, ""));
    let power = unit_power(unit).unwrap_or(0);
    let d = Decimal::parse(number).unwrap_or(Decimal {
        mantissa: 0,
        decimals: 0,
    });
    (power, d.mantissa * 100 / 10u128.pow(d.decimals))
}

/// The bytes `format_size` prints as `value` in unit 1024^power, found by bisection over
/// `format_size` (monotone in the byte count); `None` when no byte count prints so (a unit or a
/// number of decimals `format_size` never writes).
fn pytorch_interval(value: Decimal, power: u32) -> Option<(u64, u64)> {
    // §6.3: whole bytes up to 1024, two decimals of KiB, MiB or GiB above.
    let ok = match power {
        0 => value.decimals == 0,
        1..=3 => value.decimals == 2,
        _ => false,
    };
    if !ok {
        return None;
    }
    let target = (power, value.mantissa * if power == 0 { 100 } else { 1 });
    let first = first_at_least(|b| pytorch_key(&format_size(b)) >= target)?;
    if pytorch_key(&format_size(first)) != target {
        return None;
    }
    let last =
        first_at_least(|b| pytorch_key(&format_size(b)) > target).map_or(u64::MAX, |b| b - 1);
    Some((first, last))
}

/// The smallest `b` with `pred(b)` for a monotone `pred` over u64, if any.
fn first_at_least(pred: impl Fn(u64) -> bool) -> Option<u64> {
    if !pred(u64::MAX) {
        return None;
    }
    let (mut lo, mut hi) = (0u64, u64::MAX);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// `HumanReadableNumBytes`'s text for a byte count (the printer, for the bisection and for tests).
pub fn human_readable(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes}B");
    }
    const UNITS: [char; 6] = ['K', 'M', 'G', 'T', 'P', 'E'];
    let mut n = bytes;
    let mut unit = 0;
    // numbers.cc: `while (num_bytes >= 1024 * 1024) { num_bytes /= 1024; ++unit; }` (integer division)
    while n >= 1024 * 1024 {
        n /= 1024;
        unit += 1;
    }
    if unit == 0 {
        format!("{:.1}{}iB", n as f64 / 1024.0, UNITS[unit])
    } else {
        format!("{:.2}{}iB", n as f64 / 1024.0, UNITS[unit])
    }
}

/// `(unit power, value scaled to 1/100)` of a `HumanReadableNumBytes` text.
fn human_key(text: &str) -> (u32, u128) {
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let power = unit_power(unit).unwrap_or(0);
    let d = Decimal::parse(number).unwrap_or(Decimal {
        mantissa: 0,
        decimals: 0,
    });
    let scaled = if power == 0 {
        d.mantissa * 100
    } else {
        d.mantissa * 100 / 10u128.pow(d.decimals)
    };
    (power, scaled)
}

/// The bytes `HumanReadableNumBytes` prints as `value` in unit 1024^power.
fn human_readable_interval(value: Decimal, power: u32) -> Option<(u64, u64)> {
    let ok = match power {
        0 => value.decimals == 0,
        1 => value.decimals == 1,
        2..=6 => value.decimals == 2,
        _ => false,
    };
    if !ok {
        return None;
    }
    let target = (power, value.mantissa * 100 / 10u128.pow(value.decimals));
    let first = first_at_least(|b| human_key(&human_readable(b)) >= target)?;
    if human_key(&human_readable(first)) != target {
        return None;
    }
    let last =
        first_at_least(|b| human_key(&human_readable(b)) > target).map_or(u64::MAX, |b| b - 1);
    Some((first, last))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn pt(number: &str, unit: &str) -> Size {
        read(number, unit, Printer::PyTorch).unwrap()
    }

    #[test]
    fn pytorch_intervals_are_what_format_size_prints() {
        // 20.00 MiB: 20 MiB ± 0.005 MiB = ±5242.88 bytes; the edges by hand: 20.005 MiB =
        // 20,976,762.88 B, so 20,976,762 is the last that prints 20.00 (20.0049996... MiB) and
        // 19.995 MiB = 20,966,277.12 B, so 20,966,278 the first.
        let s = pt("20.00", "MiB");
        assert_eq!((s.bytes, s.min, s.max), (20 * MIB, 20_966_278, 20_976_762));
        assert!(s.exact);
        // whole bytes are exact
        let b = pt("512", "bytes");
        assert_eq!((b.min, b.max), (512, 512));
        // 1.00 KiB starts right above 1024 bytes (1024 prints "1024 bytes")
        assert_eq!(pt("1.00", "KiB").min, 1025);
        // 1024.00 MiB is 1 GiB exactly at its top: 1 GiB + 1 prints 1.00 GiB
        assert_eq!(pt("1024.00", "MiB").max, GIB);
        // a tie: 1152 bytes = 1.125 KiB prints 1.12 (half to even), so 1.12 KiB includes 1152 and 1.13 not
        assert!(pt("1.12", "KiB").max >= 1152);
        assert!(pt("1.13", "KiB").min > 1152);
    }

    #[test]
    fn other_decimals_fall_back_to_plain_rounding() {
        let s = read("1.5", "GiB", Printer::PyTorch).unwrap();
        assert!(!s.exact);
        // 1.45 GiB .. 1.55 GiB
        assert_eq!(s.min, (1.45 * GIB as f64).ceil() as u64);
        assert_eq!(s.max, (1.55 * GIB as f64).floor() as u64);
    }

    #[test]
    fn human_readable_truncates_before_printing() {
        // numbers.cc by hand: 1.77GiB = n/1024 with n = floor(bytes / 2^20) in [1807.36, 1817.6),
        // i.e. n = 1808..=1817, so bytes 1808 MiB ..= 1818 MiB - 1.
        let s = read("1.77", "GiB", Printer::HumanReadable).unwrap();
        assert!(s.exact);
        assert_eq!((s.min, s.max), (1808 * MIB, 1818 * MIB - 1));
        assert_eq!(human_readable(1808 * MIB), "1.77GiB");
        assert_eq!(human_readable(1818 * MIB - 1), "1.77GiB");
        // KiB has one decimal
        assert_eq!(human_readable(1536), "1.5KiB");
        assert_eq!(human_readable(512), "512B");
    }
}
