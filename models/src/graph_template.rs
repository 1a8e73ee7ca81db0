//! A model graph at another batch without building it: the graph of one structure at two batches,
//! each tensor's sizes a polynomial of degree one in the batch.
//!
//! The zoo builds the same ops, parameters, modules, regions and holds at every batch of a recipe;
//! only the tensors' shapes change (and those of the temporaries a factory op such as a mask or
//! position-id builder makes), each dimension that carries the batch as `a + c · batch`
//! (`[batch, seq, hidden]`, `[batch · seq, hidden]`, `[batch, heads, seq, seq]`). [`GraphTemplate::fit`]
//! takes two graphs of one recipe at two batches and, when they agree on everything but shapes (each
//! shape of the same rank, each changed dimension a whole number per sample), keeps each changed
//! dimension's line; [`GraphTemplate::instantiate`] writes the graph at another batch. A caller
//! checks the template against a third graph built afresh before trusting it (the sweep and
//! `max-batch` do, beside the step's [`crate::template::BatchTemplate`]), and the test
//! `graph_templates` proves instances equal to fresh builds for every zoo model over a range of
//! batches.

use crate::graph::{Graph, Op};
use crate::ops::OpKind;

/// Where a size of a graph is: a tensor's dimension (value index, dimension), or one of a factory
/// op's temporaries' (op index, temporary, dimension).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Dim {
    Value(u32, u32),
    Temp(u32, u32, u32),
}

impl Dim {
    /// Sets this size of `graph` to `size`.
    pub(crate) fn set(self, graph: &mut Graph, size: u64) {
        match self {
            Dim::Value(value, dim) => graph.values[value as usize].shape[dim as usize] = size,
            Dim::Temp(op, temp, dim) => {
                if let OpKind::Factory { temps, .. } = &mut graph.ops[op as usize].kind {
                    temps[temp as usize].0[dim as usize] = size;
                }
            }
        }
    }
}

/// A model graph at one batch with the line of every tensor dimension that depends on the batch.
#[derive(Clone, Debug)]
pub struct GraphTemplate {
    base: Graph,
    /// (where, size at the base batch, size per sample) of every size that varies, in graph order.
    dims: Vec<(Dim, u64, i64)>,
}

impl GraphTemplate {
    /// The template through `a` and `b` (graphs of one recipe at the batches they record), or
    /// `None` when they are not one structure: anything but the tensors' shapes differs, a shape's
    /// rank does, or a dimension changes by other than a whole number per sample.
    pub fn fit(a: &Graph, b: &Graph) -> Option<GraphTemplate> {
        let apart = i64::try_from(b.batch).ok()? - i64::try_from(a.batch).ok()?;
        if apart == 0 || a.seq != b.seq || !one_structure(a, b) {
            return None;
        }
        let mut dims = Vec::new();
        for (at, x, y) in changed_dims(a, b) {
            let change = i64::try_from(y).ok()? - i64::try_from(x).ok()?;
            if change % apart != 0 {
                return None;
            }
            dims.push((at, x, change / apart));
        }
        Some(GraphTemplate {
            base: a.clone(),
            dims,
        })
    }

    /// Whether the template writes `graph` (of its structure, built afresh at another batch) exactly:
    /// the check a caller makes before trusting it.
    pub fn writes(&self, graph: &Graph) -> bool {
        self.instantiate(graph.batch)
            .is_some_and(|made| made == *graph)
    }

    /// The graph at `batch`, or `None` where a dimension would leave the range of sizes.
    pub fn instantiate(&self, batch: u64) -> Option<Graph> {
        let from_base = i64::try_from(batch).ok()? - i64::try_from(self.base.batch).ok()?;
        let mut graph = self.base.clone();
        graph.batch = batch;
        for &(at, at_base, per_sample) in &self.dims {
            at.set(
                &mut graph,
                at_base.checked_add_signed(per_sample.checked_mul(from_base)?)?,
            );
        }
        Some(graph)
    }
}

/// Whether `a` and `b` are graphs of one structure: equal in everything but their batch, sequence
/// length and sizes (tensors' and factory temporaries'), each tensor and temporary of the same rank
/// and type in both.
pub(crate) fn one_structure(a: &Graph, b: &Graph) -> bool {
    let Graph {
        name,
        batch: _,
        seq: _,
        values,
        ops,
        params,
        buffers,
        inputs,
        output,
        modules,
        regions,
        holds,
        meta,
        kept_outputs,
    } = a;
    *name == b.name
        && values.len() == b.values.len()
        && ops.len() == b.ops.len()
        && ops.iter().zip(&b.ops).all(|(x, y)| one_op(x, y))
        && *params == b.params
        && *buffers == b.buffers
        && *inputs == b.inputs
        && *output == b.output
        && *modules == b.modules
        && *regions == b.regions
        && *holds == b.holds
        && *meta == b.meta
        && *kept_outputs == b.kept_outputs
        && values.iter().zip(&b.values).all(|(va, vb)| {
            va.dtype == vb.dtype
                && va.source == vb.source
                && va.differentiable == vb.differentiable
                && va.shape.len() == vb.shape.len()
        })
}

/// Whether two ops are one but for their factory temporaries' sizes.
fn one_op(x: &Op, y: &Op) -> bool {
    match (&x.kind, &y.kind) {
        (
            OpKind::Factory { name, temps },
            OpKind::Factory {
                name: name_y,
                temps: temps_y,
            },
        ) => {
            name == name_y
                && temps.len() == temps_y.len()
                && temps
                    .iter()
                    .zip(temps_y)
                    .all(|((s, d), (s_y, d_y))| d == d_y && s.len() == s_y.len())
                && x.inputs == y.inputs
                && x.outputs == y.outputs
                && x.module == y.module
                && x.autocast == y.autocast
        }
        _ => x == y,
    }
}

/// (where, size in `a`, size in `b`) of every size that differs between two graphs of one
/// structure ([`one_structure`]): tensors' dimensions, then factory temporaries'.
pub(crate) fn changed_dims<'g>(
    a: &'g Graph,
    b: &'g Graph,
) -> impl Iterator<Item = (Dim, u64, u64)> + 'g {
    let changed = |x: &'g [u64], y: &'g [u64]| {
        x.iter()
            .zip(y)
            .enumerate()
            .filter(|(_, (x, y))| x != y)
            .map(|(d, (&x, &y))| (d as u32, x, y))
    };
    let values = a
        .values
        .iter()
        .zip(&b.values)
        .enumerate()
        .flat_map(move |(i, (va, vb))| {
            changed(&va.shape, &vb.shape).map(move |(d, x, y)| (Dim::Value(i as u32, d), x, y))
        });
    let temps = a
        .ops
        .iter()
        .zip(&b.ops)
        .enumerate()
        .flat_map(move |(o, (x, y))| {
            let (mine, theirs): (&'g [_], &'g [_]) = match (&x.kind, &y.kind) {
                (OpKind::Factory { temps: mine, .. }, OpKind::Factory { temps: theirs, .. }) => {
                    (mine, theirs)
                }
                _ => (&[], &[]),
            };
            mine.iter()
                .zip(theirs)
                .enumerate()
                .flat_map(move |(t, ((sx, _), (sy, _)))| {
                    changed(sx, sy).map(move |(d, x, y)| (Dim::Temp(o as u32, t as u32, d), x, y))
                })
        });
    values.chain(temps)
}
