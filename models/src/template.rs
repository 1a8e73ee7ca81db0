//! Lowering once per structure: a lowered step whose sizes are polynomials of the batch.
//!
//! A training step's allocations are tensors whose shapes carry the batch as one factor of their
//! leading dimension (inputs, activations, saved tensors, their gradients, the logits and the loss
//! temporaries) or not at all (parameters, gradients of parameters, optimizer state, library
//! workspaces): every requested size is `a + c · batch` as long as the step keeps its structure — the
//! same events in the same order, with the same ids, streams, categories and tags. Where PyTorch's or
//! a kernel's choice depends on the batch, the structure changes and so does the key: the lowering
//! writes other events, and two lowerings of one structure no longer agree on everything but sizes.
//!
//! [`BatchTemplate::fit`] takes two lowerings of one recipe at two batch sizes and, when they agree on
//! everything but allocation sizes and numbers in `meta` (its `batch`), keeps each size's polynomial of
//! degree one (Lagrange interpolation through the two points, refused unless the slope is a whole
//! number of bytes per sample); [`BatchTemplate::instantiate`] writes the step at another batch
//! without lowering. A caller checks the template against a third fresh lowering before trusting it
//! (the sweep lowers its largest batch afresh and compares, byte for byte), and the test
//! `batch_templates` proves instantiation equal to a fresh lowering for every zoo model over a range
//! of batch sizes and sequence lengths.

use serde_json::Value;
use vramsim_traces::Event;

use crate::compact::{sized_event, CompactTrace};
use crate::graph::Graph;
use crate::graph_template::GraphTemplate;

/// One step of a path into a JSON tree.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum PathStep {
    Key(String),
    Index(usize),
}

/// Where two lowerings of one structure part: the allocations whose sizes differ and the unsigned
/// numbers of `meta` that differ, everything else (events, ids, streams, categories, tags, repeats,
/// phases, the rest of `meta`) being equal.
#[derive(Clone, Debug, Default)]
pub(crate) struct Apart {
    /// (event index, requested bytes in the first, in the second), by index.
    pub(crate) sizes: Vec<(usize, u64, u64)>,
    /// (path into `meta`, the number in the first, in the second).
    pub(crate) meta: Vec<(Vec<PathStep>, u64, u64)>,
}

impl Apart {
    /// Where `a` and `b` part, or why they are not one structure.
    pub(crate) fn of(a: &CompactTrace, b: &CompactTrace) -> Result<Apart, String> {
        if a.repeats != b.repeats || a.events != b.events {
            return Err("other repeated micro-batches".into());
        }
        let (na, nb) = (a.lowered_events().len(), b.lowered_events().len());
        if a.lowered_phases() != b.lowered_phases() || na != nb {
            return Err(format!("other events ({na} and {nb})"));
        }
        let mut sizes = Vec::new();
        for (i, ((ea, sa), (eb, sb))) in a.sized_events().zip(b.sized_events()).enumerate() {
            match (ea, eb) {
                (
                    Event::Alloc {
                        id,
                        size,
                        stream,
                        category,
                        tag,
                    },
                    Event::Alloc {
                        id: id_b,
                        size: size_b,
                        stream: stream_b,
                        category: category_b,
                        tag: tag_b,
                    },
                ) => {
                    if id != id_b || stream != stream_b || category != category_b || tag != tag_b {
                        return Err(format!("event {i}: {ea:?} and {eb:?}"));
                    }
                    let (size, size_b) = (sa.unwrap_or(*size), sb.unwrap_or(*size_b));
                    if size != size_b {
                        sizes.push((i, size, size_b));
                    }
                }
                _ if ea == eb => {}
                _ => return Err(format!("event {i}: {ea:?} and {eb:?}")),
            }
        }
        let mut meta = Vec::new();
        let (ma, mb) = (Value::Object(a.meta.clone()), Value::Object(b.meta.clone()));
        if !numbers_apart(&ma, &mb, &mut Vec::new(), &mut |path, x, y| {
            meta.push((path, x, y));
            Some(())
        }) {
            return Err("other meta".into());
        }
        Ok(Apart { sizes, meta })
    }
}

/// A number in `meta` that varies with the batch: where it is and how much per sample.
#[derive(Clone, Debug)]
struct MetaSlope {
    path: Vec<PathStep>,
    base: u64,
    per_sample: i128,
}

/// A lowered step at one batch with the polynomial of every size that depends on the batch.
#[derive(Clone, Debug)]
pub struct BatchTemplate {
    base: CompactTrace,
    batch: u64,
    /// (event index, requested bytes at `batch`, requested bytes per sample) of every allocation whose
    /// size varies, by index.
    sizes: Vec<(usize, u64, i128)>,
    meta: Vec<MetaSlope>,
    /// The model graph's template, where the caller fitted and checked one
    /// ([`BatchTemplate::with_graph`]).
    graph: Option<GraphTemplate>,
}

impl BatchTemplate {
    /// The template through `a` (lowered at batch `batch_a`) and `b` (at `batch_b`), or `None` when
    /// they are not one structure: different events, repeats or `meta` beyond sizes and numbers, or
    /// a size whose change is not a whole number of bytes per sample.
    pub fn fit(a: &CompactTrace, batch_a: u64, b: &CompactTrace, batch_b: u64) -> Option<Self> {
        Self::fit_or_why(a, batch_a, b, batch_b).ok()
    }

    /// [`BatchTemplate::fit`], or where the two lowerings part.
    pub fn fit_or_why(
        a: &CompactTrace,
        batch_a: u64,
        b: &CompactTrace,
        batch_b: u64,
    ) -> Result<Self, String> {
        if batch_a == batch_b {
            return Err("one batch twice".into());
        }
        let apart = Apart::of(a, b)?;
        let run = i128::from(batch_b) - i128::from(batch_a);
        let slope = |sa: u64, sb: u64| -> Option<i128> {
            let rise = i128::from(sb) - i128::from(sa);
            (rise % run == 0).then_some(rise / run)
        };
        let mut sizes = Vec::with_capacity(apart.sizes.len());
        for (i, size, size_b) in apart.sizes {
            let per_sample = slope(size, size_b).ok_or_else(|| {
                format!(
                    "event {i}: {size} and {size_b} bytes, not a whole number of bytes per sample"
                )
            })?;
            sizes.push((i, size, per_sample));
        }
        let mut meta = Vec::with_capacity(apart.meta.len());
        for (path, x, y) in apart.meta {
            let per_sample = slope(x, y).ok_or("other meta")?;
            meta.push(MetaSlope {
                path,
                base: x,
                per_sample,
            });
        }
        Ok(BatchTemplate {
            base: a.clone(),
            batch: batch_a,
            sizes,
            meta,
            graph: None,
        })
    }

    /// The same template, writing the model graph too with `graph` (a [`GraphTemplate`] of the same
    /// recipe that its caller checked, as it checked this one, against a graph built afresh).
    pub fn with_graph(self, graph: Option<GraphTemplate>) -> Self {
        BatchTemplate { graph, ..self }
    }

    /// The batch the template's own events were lowered at.
    pub fn batch(&self) -> u64 {
        self.batch
    }

    /// The step at `batch`, as a lowering at `batch` writes it when the structure holds there;
    /// `None` when a size would leave the range of bytes (negative, or 2^64 or more).
    pub fn instantiate(&self, batch: u64) -> Option<CompactTrace> {
        let delta = i128::from(batch) - i128::from(self.batch);
        let at = |base: u64, per_sample: i128| -> Option<u64> {
            u64::try_from(i128::from(base).checked_add(per_sample.checked_mul(delta)?)?).ok()
        };
        write_instance(
            &self.base,
            self.sizes
                .iter()
                .map(|&(i, base, per_sample)| (i, at(base, per_sample))),
            self.meta
                .iter()
                .map(|m| (m.path.as_slice(), at(m.base, m.per_sample))),
        )
    }
}

/// The step a template writes: `base` with the allocations of `varying` ((event index, its size
/// there), by index) resized beside the base's own sizes that do not vary, and the numbers of its
/// `meta` at the paths of `numbers` replaced; `None` when a size or number is `None` (out of reach).
pub(crate) fn write_instance<'p>(
    base: &CompactTrace,
    varying: impl ExactSizeIterator<Item = (usize, Option<u64>)>,
    numbers: impl Iterator<Item = (&'p [PathStep], Option<u64>)>,
) -> Option<CompactTrace> {
    let mut sizes = Vec::with_capacity(varying.len() + base.sizes().len());
    let mut fixed = base.sizes().iter().peekable();
    for (i, bytes_here) in varying {
        while let Some(&&(j, bytes)) = fixed.peek() {
            if j > i {
                break;
            }
            if j < i {
                sizes.push((j, bytes));
            }
            fixed.next();
        }
        sizes.push((i, bytes_here?));
    }
    sizes.extend(fixed.copied());
    let mut meta = Value::Object(base.meta.clone());
    for (path, number) in numbers {
        *slot(&mut meta, path)? = Value::from(number?);
    }
    let Value::Object(meta) = meta else {
        unreachable!("an object stays one")
    };
    Some(base.with_sizes(sizes, meta))
}

/// A lowered step that writes the step of another recipe of its structure without lowering:
/// [`BatchTemplate`] (another batch), [`crate::seq_template::SeqBatchTemplate`] (another batch and
/// sequence length).
pub trait StepTemplate: Sync {
    /// The step of `recipe` (of the template's structure), or `None` when a size would leave the
    /// range of bytes or the template does not reach it.
    fn instantiate_for(&self, recipe: &crate::Recipe) -> Option<CompactTrace>;

    /// The model graph of `recipe`, where the template writes it (else it is built).
    fn graph_for(&self, _recipe: &crate::Recipe) -> Option<Graph> {
        None
    }
}

impl StepTemplate for BatchTemplate {
    fn instantiate_for(&self, recipe: &crate::Recipe) -> Option<CompactTrace> {
        self.instantiate(recipe.batch)
    }

    fn graph_for(&self, recipe: &crate::Recipe) -> Option<Graph> {
        self.graph.as_ref()?.instantiate(recipe.batch)
    }
}

impl BatchTemplate {
    /// The largest batch whose step never holds more than `bytes` requested bytes live at once, or
    /// `None` when every batch does (sizes that do not grow). The step's live requested bytes after
    /// each event are `a + c · batch` (sums of the live sizes' polynomials), so their peak is the
    /// largest of these lines; a batch above the answer holds more than `bytes` at some event, and no
    /// allocator can serve that in `bytes` of memory (it hands out at least what is requested). A
    /// compact step's repeated micro-batch leaves the live set as it found it (it frees what it
    /// allocates, the check of [`crate::compact`]), so its repetitions add no new peak.
    pub fn largest_batch_within(&self, bytes: u64) -> Option<u64> {
        // `sizes` is in event order: walk it beside the events
        let mut slopes = self.sizes.iter().peekable();
        let mut live: rustc_hash::FxHashMap<&vramsim_traces::AllocId, (i128, i128)> =
            rustc_hash::FxHashMap::default();
        let (mut base, mut slope) = (0i128, 0i128);
        let mut best: Option<u64> = None;
        let b0 = i128::from(self.batch);
        let limit = i128::from(bytes);
        for (i, (e, sized)) in self.base.sized_events().enumerate() {
            match e {
                Event::Alloc { id, size, .. } => {
                    let c = match slopes.peek() {
                        Some(&&(at, _, c)) if at == i => {
                            slopes.next();
                            c
                        }
                        _ => 0,
                    };
                    // the size's polynomial as a + c · batch
                    let a = i128::from(sized.unwrap_or(*size)) - c * b0;
                    base += a;
                    slope += c;
                    live.insert(id, (a, c));
                }
                Event::Free { id } => {
                    if let Some((a, c)) = live.remove(id) {
                        base -= a;
                        slope -= c;
                    }
                    continue;
                }
                _ => continue,
            }
            // a + c · batch ≤ bytes: a bound from above where the line grows; a line that does not
            // grow bounds nothing, unless it is above `bytes` already (then no batch is within)
            if slope > 0 {
                let within = (limit - base).div_euclid(slope).max(0);
                let within = u64::try_from(within).unwrap_or(u64::MAX);
                best = Some(best.map_or(within, |b| b.min(within)));
            } else if slope == 0 && base > limit {
                return Some(0);
            }
        }
        best
    }
}

impl CompactTrace {
    /// Whether `self` is `other` to the byte: every event (with its size in the step), repeat and
    /// `meta` field.
    pub fn same_as(&self, other: &CompactTrace) -> bool {
        self.repeats == other.repeats
            && self.events == other.events
            && self.lowered_phases() == other.lowered_phases()
            && self.meta == other.meta
            && self.lowered_events().len() == other.lowered_events().len()
            && self
                .sized_events()
                .map(sized_event)
                .eq(other.sized_events().map(sized_event))
    }
}

/// Walks `a` and `b` together: `true` when they are equal but for unsigned integers, each such pair
/// handed to `apart` with its path (which may refuse it).
fn numbers_apart(
    a: &Value,
    b: &Value,
    path: &mut Vec<PathStep>,
    apart: &mut dyn FnMut(Vec<PathStep>, u64, u64) -> Option<()>,
) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter().all(|(k, v)| {
                    let Some(w) = y.get(k) else { return false };
                    path.push(PathStep::Key(k.clone()));
                    let same = numbers_apart(v, w, path, apart);
                    path.pop();
                    same
                })
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len()
                && x.iter().zip(y).enumerate().all(|(i, (v, w))| {
                    path.push(PathStep::Index(i));
                    let same = numbers_apart(v, w, path, apart);
                    path.pop();
                    same
                })
        }
        _ if a == b => true,
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(x), Some(y)) => apart(path.clone(), x, y).is_some(),
            _ => false,
        },
        _ => false,
    }
}

fn slot<'a>(value: &'a mut Value, path: &[PathStep]) -> Option<&'a mut Value> {
    path.iter().try_fold(value, |v, step| match step {
        PathStep::Key(k) => v.get_mut(k.as_str()),
        PathStep::Index(i) => v.get_mut(*i),
    })
}
