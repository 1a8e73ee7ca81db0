//! PyTorch's `CUDA out of memory` message, every version people paste, read back.
//!
//! The templates, from `DeviceCachingAllocator::malloc` in `c10/cuda/CUDACachingAllocator.cpp`:
//! - ≤ 1.3: `"CUDA out of memory. Tried to allocate ", format_size(alloc_size), " (GPU ", device, "; ",
//!   format_size(device_total), " total capacity; ", format_size(stats.amount_allocated), " already
//!   allocated; ", format_size(device_free), " free; ", format_size(stats.amount_cached -
//!   stats.amount_allocated), " cached)"` — `cached` is reserved minus allocated (the text PR #13751
//!   introduced, github.com/pytorch/pytorch/pull/13751).
//! - 1.4–2.0: `... " free; ", allowed_info, format_size(reserved_bytes), " reserved in total by
//!   PyTorch)"` then the `max_split_size_mb` hint, where `allowed_info = format_size(allowed) + "
//!   allowed; "` only when a memory fraction is set.
//! - Ascend `torch_npu` (`NPUCachingAllocator.cpp`): `"NPU out of memory. Tried to allocate ", ..., " (NPU
//!   ", device, "; ", ..., " total capacity; ", ..., " already allocated; ", format_size(active_bytes),
//!   " current active; ", ..., " free; ", allowed_info, ..., " reserved in total by PyTorch)"`.
//! - 2.1 (`total capacty`, the misspelling) and ≥ 2.2 (`total capacity`): `"CUDA out of memory. Tried to
//!   allocate ", format_size(alloc_size), ". GPU ", device, " has a total capacity of ",
//!   format_size(device_total), " of which ", format_size(device_free), " is free. ", proc_info,
//!   allowed_info, "Of the allocated memory ", format_size(allocated + private), " is allocated by
//!   PyTorch, ", private_pool_msg, "and ", format_size(reserved - allocated - private), " is reserved by
//!   PyTorch but unallocated."` (2.1 and 2.2 printed no `allowed_info`; the private-pool sentence came
//!   with PR #124673, ≈ 2.4). `proc_info` is NVML's list: `"Process P has B memory in use. "` for other
//!   processes and `"Including non-PyTorch memory, this process has B memory in use. "` for this one
//!   (in a container whose PID namespace hides it, this process is listed as `Process P` too).
//! - requests of 2^60 bytes or more: `"CUDA out of memory. Tried to allocate more than 1EB memory."`
//!
//! ROCm builds print `HIP` for `CUDA`; other backends built from this file (`MUSA`, `XPU`) their name.

use super::scan::{after, at, int_after, size_after, size_before};
use super::sizes::{Printer, Size};
use super::{Format, ParseError, ParsedOom, Process};

/// The anchor every PyTorch template shares.
const ANCHOR: &str = "out of memory. Tried to allocate ";

/// Where the first PyTorch message starts (its anchor), if any.
pub fn locate(line: &str) -> Option<usize> {
    line.find(ANCHOR)
}

/// The backend word before the anchor (`CUDA`, `HIP`, `NPU`).
fn backend(line: &str, anchor: usize) -> String {
    let head = line[..anchor].trim_end();
    let start = super::scan::after_last(head, |c| !c.is_ascii_alphanumeric());
    let word = &head[start..];
    if word.is_empty() {
        "CUDA".to_string()
    } else {
        word.to_string()
    }
}

/// Reads the message whose anchor is at `anchor`.
pub fn read(line: &str, anchor: usize) -> Result<ParsedOom, ParseError> {
    let backend = backend(line, anchor);
    let start = anchor + ANCHOR.len();
    // the message ends where the next one begins
    let end = at(line, start, ANCHOR).unwrap_or(line.len());
    let msg = &line[..end];
    if msg[start..].starts_with("more than 1EB memory") {
        // §3: raised before the allocator is involved; 2^60 bytes or more.
        let size = Size {
            printed: "more than 1EB".into(),
            bytes: 1 << 60,
            min: 1 << 60,
            max: u64::MAX,
            exact: true,
        };
        return Ok(ParsedOom::new(Format::PyTorchMoreThan1Eb, &backend, size));
    }
    let Some((requested, after_request)) = size_after(msg, start, Printer::PyTorch) else {
        return Err(ParseError::Bad {
            format: "PyTorch",
            what: format!(
                "the size after \"Tried to allocate\" cannot be read: {:?}",
                snippet(&msg[start..])
            ),
        });
    };
    let rest = msg[after_request..].trim_start();
    if rest.starts_with('(') {
        let open = after_request + (msg[after_request..].len() - rest.len());
        parenthesized(msg, open, backend, requested)
    } else {
        capacity_of(msg, after_request, backend, requested)
    }
}

/// The first characters of `s`, for error messages.
fn snippet(s: &str) -> String {
    s.chars().take(40).collect()
}

/// ≤ 2.0 and Ascend: `(GPU N; C total capacity; ...)`.
fn parenthesized(
    msg: &str,
    open: usize,
    backend: String,
    requested: Size,
) -> Result<ParsedOom, ParseError> {
    // the group ends at ')' (a paste may have lost it: then at the hint, or the end)
    let body_start = open + 1;
    let close = at(msg, body_start, ")")
        .or_else(|| at(msg, body_start, " If reserved"))
        .unwrap_or(msg.len());
    let body = &msg[body_start..close];
    let mut segments = body.split(';').map(str::trim);
    let device = segments.next().unwrap_or("").to_string();
    let mut found: Vec<(&'static str, Size)> = Vec::new();
    for segment in segments {
        for phrase in [
            "total capacity",
            "already allocated",
            "current active",
            "free",
            "allowed",
            "reserved in total by PyTorch",
            "cached",
        ] {
            if let Some(pos) = segment.rfind(phrase) {
                if let Some(size) = size_before(segment, pos, Printer::PyTorch) {
                    found.push((phrase, size));
                    break;
                }
            }
        }
    }
    let take = |phrase: &str| {
        found
            .iter()
            .find(|(p, _)| *p == phrase)
            .map(|(_, s)| s.clone())
    };
    let format = if take("cached").is_some() {
        Format::PyTorchCached
    } else if take("current active").is_some() || backend == "NPU" {
        Format::AscendNpu
    } else {
        Format::PyTorchReserved
    };
    let mut oom = ParsedOom::new(format, &backend, requested);
    oom.device = (!device.is_empty()).then_some(device);
    oom.capacity = take("total capacity");
    oom.allocated = take("already allocated");
    oom.free = take("free");
    oom.allowed = take("allowed");
    oom.active = take("current active");
    let mut needed = vec![
        ("\"total capacity\"", oom.capacity.is_some()),
        ("\"already allocated\"", oom.allocated.is_some()),
        ("\"free\"", oom.free.is_some()),
    ];
    match format {
        Format::PyTorchCached => {
            oom.reserved_unallocated = take("cached");
        }
        _ => {
            oom.reserved = take("reserved in total by PyTorch");
            needed.push(("\"reserved in total by PyTorch\"", oom.reserved.is_some()));
        }
    }
    missing(format, &needed)?;
    Ok(oom)
}

/// `Err(Missing)` naming every figure not found.
fn missing(format: Format, needed: &[(&str, bool)]) -> Result<(), ParseError> {
    let absent: Vec<String> = needed
        .iter()
        .filter(|(_, found)| !found)
        .map(|(what, _)| what.to_string())
        .collect();
    if absent.is_empty() {
        Ok(())
    } else {
        Err(ParseError::Missing {
            format: format.name(),
            missing: absent,
        })
    }
}

/// ≥ 2.1: `. GPU N has a total capacity of C of which F is free. ...`.
fn capacity_of(
    msg: &str,
    from: usize,
    backend: String,
    requested: Size,
) -> Result<ParsedOom, ParseError> {
    let format = Format::PyTorchCapacityOf;
    let mut oom = ParsedOom::new(format, &backend, requested);
    // the message's own sentences end at the hint
    let end = at(msg, from, " If reserved").unwrap_or(msg.len());
    let m = &msg[..end];
    let has = at(m, from, " has a total capac");
    if let Some(has) = has {
        let device = m[from..has].trim().trim_start_matches('.').trim();
        oom.device = (!device.is_empty()).then(|| device.to_string());
        oom.capacty_spelling = m[has..].starts_with(" has a total capacty");
        let of = after(m, has, " of ").filter(|&p| p < has + 40);
        if let Some((capacity, next)) = of.and_then(|p| size_after(m, p, Printer::PyTorch)) {
            oom.capacity = Some(capacity);
            if let Some(p) = after(m, next, " of which ") {
                if let Some((free, q)) = size_after(m, p, Printer::PyTorch) {
                    if m[q..].trim_start().starts_with("is free") {
                        oom.free = Some(free);
                    }
                }
            }
        }
    }
    // proc_info: other processes and this one
    let mut pos = from;
    while let Some(p) = after(m, pos, "Process ") {
        pos = p;
        let Some((pid, q)) = int_after(m, p) else {
            continue;
        };
        let Some(h) = after(m, q, " has ").filter(|&h| h == q + 5) else {
            continue;
        };
        if let Some((bytes, r)) = size_after(m, h, Printer::PyTorch) {
            if m[r..].trim_start().starts_with("memory in use") {
                oom.processes.push(Process { pid, bytes });
                pos = r;
            }
        }
    }
    if let Some(p) = after(m, from, "this process has ") {
        oom.this_process = size_after(m, p, Printer::PyTorch).map(|(s, _)| s);
    }
    if let Some(p) = at(m, from, " allowed;") {
        oom.allowed = size_before(m, p, Printer::PyTorch);
    }
    if let Some(p) = after(m, from, "Of the allocated memory ") {
        if let Some((allocated, q)) = size_after(m, p, Printer::PyTorch) {
            if m[q..].trim_start().starts_with("is allocated by PyTorch") {
                oom.allocated = Some(allocated);
            }
        }
    }
    if let Some(p) = at(m, from, " allocated in private pools") {
        oom.private_pools = size_before(m, p, Printer::PyTorch);
    }
    if let Some(p) = at(m, from, " is reserved by PyTorch but unallocated") {
        oom.reserved_unallocated = size_before(m, p, Printer::PyTorch);
    }
    missing(
        format,
        &[
            (
                "\"has a total capacity of\" (the device's capacity)",
                oom.capacity.is_some(),
            ),
            ("\"of which ... is free\" (free bytes)", oom.free.is_some()),
            (
                "\"Of the allocated memory ... is allocated by PyTorch\"",
                oom.allocated.is_some(),
            ),
            (
                "\"... is reserved by PyTorch but unallocated\"",
                oom.reserved_unallocated.is_some(),
            ),
        ],
    )?;
    Ok(oom)
}

#[cfg(test)]
mod tests {
    use crate::device::{Device, OtherProcess};
    use crate::oom::{out_of_memory_message_with, OomContext, OomFacts};
    use crate::oom_text::{parse, Format};

    #[test]
    fn vramsims_own_message_reads_back_with_every_optional_sentence() {
        let mut device = Device::with_capacity(85_017_755_648);
        device.context_bytes = 500 << 20;
        device.other_processes = vec![OtherProcess {
            pid: 4321,
            bytes: 3 << 30,
        }];
        let facts = OomFacts {
            device: &device,
            alloc_size: 20 << 20,
            device_free: 3_870_000,
            allowed: Some(70 << 30),
            allocated_bytes: 60 << 30,
            reserved_bytes: (62 << 30) + 12345,
        };
        let context = OomContext {
            allocated_in_private_pools: 17 << 20,
            this_process_position: 1,
            nvml_available: true,
        };
        let message = out_of_memory_message_with(&facts, &context);
        let oom = parse(&message).unwrap();
        assert_eq!(oom.format, Format::PyTorchCapacityOf);
        let inside = |s: &Option<crate::oom_text::Size>, v: u64| {
            let s = s.as_ref().unwrap();
            assert!(s.min <= v && v <= s.max, "{} for {v}", s.printed);
        };
        assert!(oom.requested.min <= 20 << 20 && 20 << 20 <= oom.requested.max);
        inside(&oom.capacity, device.total_memory);
        inside(&oom.free, facts.device_free);
        inside(&oom.allowed, 70 << 30);
        inside(&oom.allocated, facts.allocated_bytes + (17 << 20));
        inside(&oom.private_pools, 17 << 20);
        inside(
            &oom.reserved_unallocated,
            facts.reserved_bytes - facts.allocated_bytes - (17 << 20),
        );
        inside(
            &oom.this_process,
            facts.reserved_bytes + device.context_bytes,
        );
        assert_eq!(oom.processes.len(), 1);
        assert_eq!(oom.processes[0].pid, 4321);
        assert_eq!(oom.device.as_deref(), Some("GPU 0"));
    }
}
