//! What a trace's history says without replaying it: every allocation with its site and lifetime, the
//! iterations of the loop, and the bytes each iteration leaves behind.
//!
//! - **Iterations.** A phase name that starts more than once marks them (the earliest-starting such
//!   name: `forward` in a lowered training step). Without phases, the sequence of allocation sizes is
//!   searched for its shortest period `p` (at least 90 % of sizes equal to the size `p` allocations
//!   later, over at least two periods: the shortest repeating unit, a step or, for a model that
//!   repeats its layers, a layer); iterations start `p` allocations apart from the first allocation that
//!   recurs, at the offset of the first period where the fewest bytes are live (where a loop holds least).
//! - **Leaks.** An allocation made in iteration k and never freed in the trace. The first and last
//!   iterations are left out (the first builds one-time state, such as optimizer moments; the last still
//!   holds what the next iteration would free), so at least three iterations are needed. The growth per
//!   iteration is the median over the others of the bytes each leaves behind, and the leaks are those
//!   allocations grouped by site.

use std::collections::BTreeMap;

use vramsim_traces::{AllocId, Event};

/// One allocation of the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Index of its event in the trace.
    pub event: u64,
    /// Requested bytes.
    pub size: u64,
    /// Index of the event that frees it, if the trace frees it.
    pub freed: Option<u64>,
    /// Where it was made (a snapshot's stack frame, a trace's tag, or its category).
    pub site: String,
    /// Its category (`other` for a snapshot's).
    pub category: &'static str,
    /// Whether it was live before the history starts (a snapshot's state at recording start).
    pub before_recording: bool,
}

/// The allocations and phase starts of a trace.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Every allocation, in event order.
    pub allocations: Vec<Allocation>,
    /// Phase starts: (event index, name).
    pub phases: Vec<(u64, String)>,
    /// Events in the trace.
    pub events: u64,
}

/// Reads a trace's events; `site(event_index, tag, category)` names each allocation's site.
pub fn history(events: &[Event], site: &dyn Fn(usize, Option<&str>, &str) -> String) -> History {
    let mut h = History {
        events: events.len() as u64,
        ..History::default()
    };
    let mut live: BTreeMap<AllocId, usize> = BTreeMap::new();
    for (i, event) in events.iter().enumerate() {
        match event {
            Event::Segment(segment) => {
                for b in &segment.blocks {
                    live.insert(b.id.clone(), h.allocations.len());
                    h.allocations.push(Allocation {
                        event: i as u64,
                        size: b.requested,
                        freed: None,
                        site: "live before recording".to_string(),
                        category: b.category.name(),
                        before_recording: true,
                    });
                }
            }
            Event::Alloc {
                id,
                size,
                category,
                tag,
                ..
            } => {
                live.insert(id.clone(), h.allocations.len());
                h.allocations.push(Allocation {
                    event: i as u64,
                    size: *size,
                    freed: None,
                    site: site(i, tag.as_deref(), category.name()),
                    category: category.name(),
                    before_recording: false,
                });
            }
            Event::Free { id } => {
                if let Some(k) = live.remove(id) {
                    h.allocations[k].freed = Some(i as u64);
                }
            }
            Event::Phase { name } => h.phases.push((i as u64, name.to_string())),
            _ => {}
        }
    }
    h
}

/// The iterations found in a history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iterations {
    /// Event index where each iteration starts.
    pub starts: Vec<u64>,
    /// How they were found.
    pub detected_by: String,
}

/// Finds the iterations (see the module documentation); `None` when nothing repeats.
pub fn iterations(h: &History) -> Option<Iterations> {
    // the earliest-starting phase name that starts more than once
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, name) in &h.phases {
        *counts.entry(name.as_str()).or_default() += 1;
    }
    if let Some((_, name)) = h.phases.iter().find(|(_, n)| counts[n.as_str()] > 1) {
        return Some(Iterations {
            starts: h
                .phases
                .iter()
                .filter(|(_, n)| n == name)
                .map(|&(i, _)| i)
                .collect(),
            detected_by: format!("phase '{name}'"),
        });
    }
    let recorded: Vec<&Allocation> = h
        .allocations
        .iter()
        .filter(|a| !a.before_recording)
        .collect();
    let sizes: Vec<u64> = recorded.iter().map(|a| a.size).collect();
    let p = period(&sizes)?;
    // the pattern starts at the first allocation that recurs a period later (a prologue, such as the
    // parameters, precedes it); iterations start at its offset where the fewest bytes are live
    let first = (0..sizes.len() - p).find(|&i| sizes[i] == sizes[i + p])?;
    let live_before = |k: usize| -> u64 {
        let at = recorded[k].event;
        h.allocations
            .iter()
            .filter(|a| a.event < at && a.freed.is_none_or(|f| f >= at))
            .map(|a| a.size)
            .sum()
    };
    let offset = (first..first + p).min_by_key(|&k| (live_before(k), k))?;
    let starts: Vec<u64> = (offset..sizes.len())
        .step_by(p)
        .map(|k| recorded[k].event)
        .collect();
    Some(Iterations {
        starts,
        detected_by: format!("a repeating pattern of {p} allocations"),
    })
}

/// The shortest period of a size sequence: at least 90 % of positions equal to the one `p` later, over
/// at least two whole periods.
fn period(sizes: &[u64]) -> Option<usize> {
    let n = sizes.len();
    (1..=n / 2).find(|&p| {
        let pairs = n - p;
        // a cheap look at 16 positions first, then every position
        let probe = (0..16).map(|j| j * pairs / 16);
        if probe.filter(|&i| sizes[i] == sizes[i + p]).count() < 14 {
            return false;
        }
        let equal = (0..pairs).filter(|&i| sizes[i] == sizes[i + p]).count();
        equal * 10 >= pairs * 9
    })
}

/// Bytes left behind by one site across the inner iterations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    /// The allocation site.
    pub site: String,
    /// Bytes never freed, over the inner iterations.
    pub bytes: u64,
    /// Allocations never freed.
    pub count: u64,
    /// Inner iterations in which the site leaked.
    pub iterations: u64,
    /// Event index of the first leaked allocation.
    pub first_event: u64,
}

/// What the iterations leave behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Growth {
    /// Bytes never freed, allocated in each iteration (all of them, first and last included).
    pub leaked_by_iteration: Vec<u64>,
    /// Live bytes (requested) when each iteration starts.
    pub live_at_start: Vec<u64>,
    /// The median of the inner iterations' leaked bytes; `None` with fewer than three iterations.
    pub bytes_per_iteration: Option<u64>,
    /// The inner iterations' leaked allocations by site, largest first.
    pub leaks: Vec<Leak>,
}

/// The growth of `h` over `it` (see the module documentation).
pub fn growth(h: &History, it: &Iterations) -> Growth {
    let m = it.starts.len();
    let end = |k: usize| it.starts.get(k + 1).copied().unwrap_or(h.events);
    let iteration_of = |event: u64| -> Option<usize> {
        let k = it.starts.partition_point(|&s| s <= event);
        (k > 0).then(|| k - 1)
    };
    let mut leaked_by_iteration = vec![0u64; m];
    let mut by_site: BTreeMap<&str, (Leak, Vec<bool>)> = BTreeMap::new();
    for a in h.allocations.iter().filter(|a| a.freed.is_none()) {
        let Some(k) = iteration_of(a.event) else {
            continue;
        };
        if a.event >= end(k) {
            continue;
        }
        leaked_by_iteration[k] += a.size;
        if k == 0 || k + 1 >= m {
            continue;
        }
        let entry = by_site.entry(a.site.as_str()).or_insert_with(|| {
            (
                Leak {
                    site: a.site.clone(),
                    bytes: 0,
                    count: 0,
                    iterations: 0,
                    first_event: a.event,
                },
                vec![false; m],
            )
        });
        entry.0.bytes += a.size;
        entry.0.count += 1;
        entry.1[k] = true;
    }
    let live_at_start = it
        .starts
        .iter()
        .map(|&s| {
            h.allocations
                .iter()
                .filter(|a| a.event < s && a.freed.is_none_or(|f| f >= s))
                .map(|a| a.size)
                .sum()
        })
        .collect();
    let bytes_per_iteration = (m >= 3).then(|| {
        let mut inner = leaked_by_iteration[1..m - 1].to_vec();
        inner.sort_unstable();
        inner[inner.len() / 2]
    });
    let mut leaks: Vec<Leak> = by_site
        .into_values()
        .map(|(mut leak, seen)| {
            leak.iterations = seen.iter().filter(|&&s| s).count() as u64;
            leak
        })
        .collect();
    leaks.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then(a.first_event.cmp(&b.first_event))
    });
    Growth {
        leaked_by_iteration,
        live_at_start,
        bytes_per_iteration,
        leaks,
    }
}

/// Live requested bytes by site just before event `at`, largest first.
pub fn live_by_site(h: &History, at: u64) -> Vec<(String, u64)> {
    live_by(h, at, |a| a.site.as_str())
}

/// Live requested bytes by category just before event `at`, largest first.
pub fn live_by_category(h: &History, at: u64) -> Vec<(String, u64)> {
    live_by(h, at, |a| a.category)
}

fn live_by<'a>(
    h: &'a History,
    at: u64,
    key: impl Fn(&'a Allocation) -> &'a str,
) -> Vec<(String, u64)> {
    let mut sites: BTreeMap<&str, u64> = BTreeMap::new();
    for a in &h.allocations {
        if a.event < at && a.freed.is_none_or(|f| f >= at) {
            *sites.entry(key(a)).or_default() += a.size;
        }
    }
    let mut v: Vec<(String, u64)> = sites.into_iter().map(|(s, b)| (s.to_string(), b)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shortest_period_is_found() {
        let base = [10u64, 20, 30, 20, 50];
        let sizes: Vec<u64> = base.iter().cycle().take(23).copied().collect();
        assert_eq!(period(&sizes), Some(5));
        assert_eq!(period(&[1, 2, 3, 4, 5, 6, 7]), None);
    }
}
