//! A model graph at another batch without building it: the graph of one structure at two batches,
//! each tensor's sizes a polynomial of degree one in the batch.
//!
//! The zoo builds the same ops, parameters, modules, regions and holds at every batch of a recipe;
//! only the tensors' shapes change, each dimension that carries the batch as `a + c · batch`
//! (`[batch, seq, hidden]`, `[batch · seq, hidden]`, `[batch, heads, seq, seq]`). [`GraphTemplate::fit`]
//! takes two graphs of one recipe at two batches and, when they agree on everything but shapes (each
//! shape of the same rank, each changed dimension a whole number per sample), keeps each changed
//! dimension's line; [`GraphTemplate::instantiate`] writes the graph at another batch. A caller
//! checks the template against a third graph built afresh before trusting it (the sweep and
//! `max-batch` do, beside the step's [`crate::template::BatchTemplate`]), and the test
//! `graph_templates` proves instances equal to fresh builds for every zoo model over a range of
//! batches.

use crate::graph::Graph;

/// A model graph at one batch with the line of every tensor dimension that depends on the batch.
#[derive(Clone, Debug)]
pub struct GraphTemplate {
    base: Graph,
    /// (value index, dimension, size at the base batch, size per sample) of every dimension that
    /// varies, by value.
    dims: Vec<(u32, u32, u64, i64)>,
}

impl GraphTemplate {
    /// The template through `a` and `b` (graphs of one recipe at the batches they record), or
    /// `None` when they are not one structure: anything but the tensors' shapes differs, a shape's
    /// rank does, or a dimension changes by other than a whole number per sample.
    pub fn fit(a: &Graph, b: &Graph) -> Option<GraphTemplate> {
        let Graph {
            name,
            batch,
            seq,
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
        let apart = i64::try_from(b.batch).ok()? - i64::try_from(*batch).ok()?;
        if apart == 0
            || *name != b.name
            || *seq != b.seq
            || values.len() != b.values.len()
            || *ops != b.ops
            || *params != b.params
            || *buffers != b.buffers
            || *inputs != b.inputs
            || *output != b.output
            || *modules != b.modules
            || *regions != b.regions
            || *holds != b.holds
            || *meta != b.meta
            || *kept_outputs != b.kept_outputs
        {
            return None;
        }
        let mut dims = Vec::new();
        for (i, (va, vb)) in values.iter().zip(&b.values).enumerate() {
            if va.dtype != vb.dtype
                || va.source != vb.source
                || va.differentiable != vb.differentiable
                || va.shape.len() != vb.shape.len()
            {
                return None;
            }
            for (d, (&x, &y)) in va.shape.iter().zip(&vb.shape).enumerate() {
                if x != y {
                    let change = i64::try_from(y).ok()? - i64::try_from(x).ok()?;
                    if change % apart != 0 {
                        return None;
                    }
                    dims.push((
                        u32::try_from(i).ok()?,
                        u32::try_from(d).ok()?,
                        x,
                        change / apart,
                    ));
                }
            }
        }
        Some(GraphTemplate {
            base: a.clone(),
            dims,
        })
    }

    /// The graph at `batch`, or `None` where a dimension would leave the range of sizes.
    pub fn instantiate(&self, batch: u64) -> Option<Graph> {
        let from_base = i64::try_from(batch).ok()? - i64::try_from(self.base.batch).ok()?;
        let mut graph = self.base.clone();
        graph.batch = batch;
        for &(value, dim, at_base, per_sample) in &self.dims {
            let size = at_base.checked_add_signed(per_sample.checked_mul(from_base)?)?;
            graph.values[value as usize].shape[dim as usize] = size;
        }
        Some(graph)
    }
}
