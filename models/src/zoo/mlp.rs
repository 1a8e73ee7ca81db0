//! `mlp`: the capture tool's MLP, `nn.Sequential(Linear(1024, 4096), ReLU, Linear(4096, 4096), ReLU,
//! Linear(4096, 4096), ReLU, Linear(4096, 1000))` with biases, on `(batch, 1024)` inputs and a
//! 1000-class cross-entropy. Each Linear+ReLU pair is a checkpointable block.

use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind};

/// Layer widths of the zoo's `mlp` (input, three hidden layers, classes).
pub const MLP_DIMS: [u64; 5] = [1024, 4096, 4096, 4096, 1000];

/// The MLP of `dims` (input width, hidden widths..., classes) at `batch`.
pub fn mlp(dims: &[u64], batch: u64) -> Result<Graph, GraphError> {
    let mut b = GraphBuilder::new("mlp", batch, 0);
    b.meta(
        "reference",
        "torch.nn.Sequential of Linear/ReLU (traces/python/vramsim_capture.py MLP_DIMS)".into(),
    );
    let x = b.input("x", &[batch, dims[0]], DTypeSpec::Model);
    let labels = b.input("labels", &[batch], DTypeSpec::Fixed(DType::I64));
    let mut h = x;
    let n = dims.len() - 1;
    for i in 0..n {
        if i + 1 < n {
            // Block: Linear + ReLU (modules "2i" and "2i+1" of the Sequential).
            h = b.region(RegionKind::Block, "", |b| {
                let y = b.linear(&format!("{}", 2 * i), h, dims[i + 1], true);
                b.module(&format!("{}", 2 * i + 1), |b| b.relu(y))
            });
        } else {
            h = b.linear(&format!("{}", 2 * i), h, dims[i + 1], true);
        }
    }
    // `F.cross_entropy(model(x), y)`: the logits live until cross_entropy returns.
    b.keep_output(h);
    b.push_module("");
    b.hold(h);
    let loss = b.cross_entropy(h, labels);
    b.pop_module("");
    b.keep_output(loss);
    b.set_output(loss);
    b.finish()
}
