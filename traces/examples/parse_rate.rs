//! How fast the JSON Lines reader decodes events: generates 2 million alloc/free lines in memory and
//! times [`JsonlReader`] over them, directly and through [`open_events_from`] (format detection and a
//! boxed reader, as `vramsim` reads files).
//!
//! It also counts heap allocations during the read: with integer ids there should be none per line
//! (the reader reuses one line buffer and decodes in place).
//!
//! `cargo run --release -p vramsim-traces --example parse_rate [LINES]`

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use vramsim_traces::{open_events_from, Event, JsonlReader};

/// The system allocator, counting calls.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lines: u64 = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 2_000_000,
    };
    let mut text = Vec::with_capacity(lines as usize * 64);
    writeln!(
        text,
        "{{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{{}}}}"
    )?;
    for i in 0..lines / 2 {
        let id = 100_000 + i;
        writeln!(
            text,
            "{{\"op\":\"alloc\",\"id\":{id},\"size\":1048576,\"stream\":0,\"category\":\"activation\"}}"
        )?;
        writeln!(text, "{{\"op\":\"free\",\"id\":{id}}}")?;
    }
    let mb = text.len() as f64 / 1e6;
    println!("{lines} lines, {mb:.1} MB");

    for round in 0..3 {
        let allocations = ALLOCATIONS.load(Ordering::Relaxed);
        let start = Instant::now();
        let mut bytes = 0u64;
        let mut n = 0u64;
        for event in JsonlReader::new(&text[..])? {
            if let Event::Alloc { size, .. } = event? {
                bytes += size;
            }
            n += 1;
        }
        let s = start.elapsed().as_secs_f64();
        let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations;
        println!(
            "round {round}: JsonlReader<&[u8]>: {n} events in {s:.3} s = {:.2} M events/s ({:.0} MB/s; {} GiB requested; {allocations} heap allocations)",
            n as f64 / s / 1e6,
            mb / s,
            bytes >> 30
        );
    }

    let start = Instant::now();
    let n = open_events_from(std::io::Cursor::new(text.clone()))?
        .try_fold(0u64, |n, e| e.map(|_| n + 1))?;
    let s = start.elapsed().as_secs_f64();
    println!(
        "open_events_from (detection, boxed reader): {n} events in {s:.3} s = {:.2} M events/s",
        n as f64 / s / 1e6
    );
    Ok(())
}
