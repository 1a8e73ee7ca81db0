//! XLA's out-of-memory errors (JAX raises them as `XlaRuntimeError: RESOURCE_EXHAUSTED: ...`), read back.
//!
//! - `TfAllocatorAdapter::Allocate` (`xla/stream_executor/integrations/tf_allocator_adapter.cc`, formerly
//!   `tensorflow/stream_executor/tf_allocator_adapter.cc`): `ResourceExhausted("Out of memory while trying
//!   to allocate ", size, " bytes.")` — the exact byte count.
//! - Runtimes that print the size with `HumanReadableNumBytes` (`Out of memory while trying to allocate
//!   16.00GiB.`): the interval `HumanReadableNumBytes` maps to that text (see [`super::sizes`]).
//! - `Out of memory allocating N bytes.` and the BFC allocator's `Failed to allocate request for 2.99GiB
//!   (3206250496B) on device ordinal 0`, whose byte count in parentheses is exact.
//!
//! None of them says how large the device is or what else it holds: only the request is known.

use super::scan::{after, int_after, size_after};
use super::sizes::{Printer, Size};
use super::{Format, ParseError, ParsedOom};

const ANCHORS: [&str; 3] = [
    "Out of memory while trying to allocate ",
    "Out of memory allocating ",
    "Failed to allocate request for ",
];

/// Where the first XLA message starts, if any.
pub fn locate(line: &str) -> Option<usize> {
    ANCHORS.iter().filter_map(|a| line.find(a)).min()
}

/// Reads the message whose anchor is at `anchor`.
pub fn read(line: &str, anchor: usize) -> Result<ParsedOom, ParseError> {
    let format = Format::Xla;
    let anchor_text = ANCHORS
        .iter()
        .find(|a| line[anchor..].starts_with(**a))
        .copied()
        .unwrap_or(ANCHORS[0]);
    let start = anchor + anchor_text.len();
    let requested = if anchor_text == ANCHORS[2] {
        // "2.99GiB (3206250496B)": the parenthesized count is exact
        after(line, start, "(")
            .filter(|&p| p < start + 16)
            .and_then(|p| int_after(line, p))
            .map(|(n, _)| Size::exact(n, format!("{n} bytes")))
            .or_else(|| size_after(line, start, Printer::HumanReadable).map(|(s, _)| s))
    } else {
        match int_after(line, start) {
            Some((n, end)) if line[end..].starts_with(" bytes") => {
                Some(Size::exact(n, format!("{n} bytes")))
            }
            _ => size_after(line, start, Printer::HumanReadable).map(|(s, _)| s),
        }
    };
    let Some(requested) = requested else {
        return Err(ParseError::Bad {
            format: format.name(),
            what: format!(
                "the size after {:?} cannot be read: {:?}",
                anchor_text.trim(),
                line[start..].chars().take(30).collect::<String>()
            ),
        });
    };
    let mut oom = ParsedOom::new(format, "XLA", requested);
    if let Some(p) = after(line, start, "on device ordinal ") {
        if let Some((n, _)) = int_after(line, p) {
            oom.device = Some(format!("device ordinal {n}"));
        }
    }
    Ok(oom)
}
