//! The verdict on an out-of-memory message, by the rule the output states:
//!
//! 1. `exceeds_device` if the request is larger than the device (than the memory-fraction limit when one
//!    is set): nothing but a smaller request can succeed;
//! 2. else `fragmentation` if the request is no larger than the free bytes plus PyTorch's reserved but
//!    unallocated bytes: the bytes are there, not in one piece — before raising, the caching allocator
//!    already released every cached segment that was wholly free (`release_cached_blocks`, fact sheet
//!    §3 and §5.3), so what stays reserved is split segments partly in use;
//! 3. else `capacity`, short by `request − free − reserved-but-unallocated` bytes.
//!
//! Every figure is an interval (what the printed, rounded value stands for), so each comparison is
//! certain, impossible, or undecided; when rounding leaves the rule undecided the verdict says so and
//! lists the causes still possible instead of guessing.

use super::figures::{Figures, Range};

/// A cause of an out-of-memory error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The request alone is larger than the device.
    ExceedsDevice,
    /// Enough bytes are free or cached, not in one piece.
    Fragmentation,
    /// Not enough bytes: the rest of the program holds too much.
    Capacity,
}

impl Cause {
    /// The name the JSON uses.
    pub fn name(self) -> &'static str {
        match self {
            Cause::ExceedsDevice => "exceeds_device",
            Cause::Fragmentation => "fragmentation",
            Cause::Capacity => "capacity",
        }
    }
}

/// The rule, as the output states it.
pub const RULE: &str = "exceeds_device if the request is larger than the device (or the memory-fraction \
limit); else fragmentation if the request is no larger than free + reserved-but-unallocated bytes (the \
caching allocator released every wholly free cached segment before raising); else capacity, short by \
request - free - reserved-but-unallocated";

/// The outcome of the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The cause, when the figures decide it.
    pub cause: Option<Cause>,
    /// The causes the figures leave possible (one when decided).
    pub possible: Vec<Cause>,
    /// Bytes that must go, when `capacity` is possible: `request − free − reserved-but-unallocated`.
    pub shortfall: Option<Range>,
    /// Why the rule could not decide (missing figures, or rounding).
    pub undecided: Option<String>,
}

/// Three-valued comparison of intervals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tri {
    Yes,
    No,
    Maybe,
}

/// Is `a > b` for every pair of values the intervals allow (Yes), none (No), or some (Maybe)?
fn greater(a: Range, b: Range) -> Tri {
    if a.min > b.max {
        Tri::Yes
    } else if a.max <= b.min {
        Tri::No
    } else {
        Tri::Maybe
    }
}

/// Applies the rule to the figures.
pub fn decide(f: &Figures) -> Verdict {
    let undecided = |possible: Vec<Cause>, why: String, shortfall: Option<Range>| Verdict {
        cause: None,
        possible,
        shortfall,
        undecided: Some(why),
    };
    // PyTorch's "more than 1EB" (2^60 bytes): larger than any device made
    if f.requested.min >= 1 << 60 {
        return decided(Cause::ExceedsDevice, None);
    }
    let Some(limit) = f.limit else {
        return undecided(
            vec![Cause::ExceedsDevice, Cause::Fragmentation, Cause::Capacity],
            "the message gives no device figures (its size, free bytes), only the request; give the \
             device with --gpu or --capacity to test the request against it"
                .into(),
            None,
        );
    };
    let exceeds = greater(f.requested, limit);
    if exceeds == Tri::Yes {
        return decided(Cause::ExceedsDevice, None);
    }
    let available = match (f.obtainable, f.reserved_unallocated) {
        (Some(free), Some(unallocated)) => free.plus(unallocated),
        _ => {
            let mut possible = vec![Cause::Fragmentation, Cause::Capacity];
            if exceeds == Tri::Maybe {
                possible.insert(0, Cause::ExceedsDevice);
            }
            return undecided(
                possible,
                "the request fits the device, but the message gives no free or reserved-but-unallocated \
                 bytes to tell fragmentation from capacity"
                    .into(),
                None,
            );
        }
    };
    let shortfall_range = f.requested.minus(available);
    let short = greater(f.requested, available);
    match (exceeds, short) {
        (Tri::No, Tri::No) => decided(Cause::Fragmentation, None),
        (Tri::No, Tri::Yes) => decided(Cause::Capacity, Some(shortfall_range)),
        (Tri::No, Tri::Maybe) => undecided(
            vec![Cause::Fragmentation, Cause::Capacity],
            format!(
                "rounding: the request ({}..={} bytes) and free + reserved-but-unallocated ({}..={} \
                 bytes) overlap",
                f.requested.min, f.requested.max, available.min, available.max
            ),
            Some(shortfall_range),
        ),
        (_, short) => {
            let mut possible = vec![Cause::ExceedsDevice];
            if short != Tri::Yes {
                possible.push(Cause::Fragmentation);
            }
            possible.push(Cause::Capacity);
            undecided(
                possible,
                format!(
                    "rounding: the request ({}..={} bytes) and the device ({}..={} bytes) overlap",
                    f.requested.min, f.requested.max, limit.min, limit.max
                ),
                (short != Tri::No).then_some(shortfall_range),
            )
        }
    }
}

fn decided(cause: Cause, shortfall: Option<Range>) -> Verdict {
    let shortfall = shortfall.map(|s| Range {
        // decided capacity: at least one byte short
        min: s.min.max(1),
        bytes: s.bytes.max(1),
        ..s
    });
    Verdict {
        cause: Some(cause),
        possible: vec![cause],
        shortfall,
        undecided: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vramsim_sim::oom_text::parse;

    fn verdict(text: &str) -> Verdict {
        decide(&Figures::of(&parse(text).unwrap(), None))
    }

    #[test]
    fn a_request_as_large_as_the_device_is_undecided_by_rounding() {
        // 8.00 GiB requested on an 8.00 GiB device: each stands for 8 GiB ± 5 MiB
        let v = verdict(
            "CUDA out of memory. Tried to allocate 8.00 GiB (GPU 0; 8.00 GiB total capacity; 0 bytes \
             already allocated; 7.50 GiB free; 0 bytes reserved in total by PyTorch)",
        );
        assert_eq!(v.cause, None);
        assert_eq!(v.possible, [Cause::ExceedsDevice, Cause::Capacity]);
    }

    #[test]
    fn a_memory_fraction_limits_what_a_new_segment_can_take() {
        // the 1.4–2.0 template with allowed_info: 12 GiB free on the device, but 10 GiB allowed with
        // 9.50 GiB reserved leaves 0.50 GiB for a new segment; + 0.50 GiB unallocated = 1 GiB < 2 GiB
        let v = verdict(
            "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.69 GiB total capacity; 9.00 GiB \
             already allocated; 12.00 GiB free; 10.00 GiB allowed; 9.50 GiB reserved in total by PyTorch)",
        );
        assert_eq!(v.cause, Some(Cause::Capacity));
        let short = v.shortfall.unwrap();
        assert_eq!(short.bytes, 1 << 30);
        // and a request above the limit exceeds it even though the device is larger
        let over = verdict(
            "CUDA out of memory. Tried to allocate 11.00 GiB (GPU 0; 23.69 GiB total capacity; 0 bytes \
             already allocated; 23.00 GiB free; 10.00 GiB allowed; 0 bytes reserved in total by PyTorch)",
        );
        assert_eq!(over.cause, Some(Cause::ExceedsDevice));
    }

    #[test]
    fn more_than_1eb_exceeds_every_device() {
        let v =
            verdict("RuntimeError: CUDA out of memory. Tried to allocate more than 1EB memory.");
        assert_eq!(v.cause, Some(Cause::ExceedsDevice));
    }
}
