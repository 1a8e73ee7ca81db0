//! Lowering once per structure over the batch and the sequence length: a lowered step whose sizes
//! are polynomials of both.
//!
//! A transformer step's tensors carry the batch `B` as one factor of their leading dimension or not
//! at all ([`crate::template`]), and the sequence length `S` as one or two factors: activations and
//! their gradients `B·S·h`, the attention scores and probabilities of eager attention `B·H·S·S`, a
//! causal mask `S·S`, position ids `S`, parameters and optimizer state not at all. Every requested
//! size is so a polynomial `Σ c_ij · B^i · S^j` with `i ≤ 1` and `j ≤ 2`, as long as the step keeps its
//! structure. Kernels round some lengths: FlashAttention's backward pads `softmax_d` and `dq_accum` to
//! `round(S, 128)` (`mha_bwd`, the lowering's `lower/bwd.rs`), the memory-efficient forward's
//! logsumexp to `ceil(S, 32)` (`_efficient_attention_forward`, `lower/fwd.rs`). Both are `S` plus a
//! constant among the lengths of one residue modulo [`SEQ_CLASS`], so a family of lengths of one
//! residue keeps every size a polynomial of that degree; a caller keys its families by
//! [`seq_class`]. Choices that change the events (a kernel picked by length, such as cuDNN refusing
//! a key of length 1) change the structure, which [`SeqBatchTemplate::fit`] refuses and a
//! verification against one more fresh lowering catches.
//!
//! [`SeqBatchTemplate::fit`] takes six lowerings, at two batches × three lengths, that agree on
//! everything but allocation sizes and numbers in `meta`, and keeps each varying quantity's six
//! values: [`SeqBatchTemplate::instantiate`] evaluates the polynomial through them (Lagrange
//! interpolation, of degree one in the batch and two in the length, in exact rational arithmetic) and
//! refuses a point where a size is not a whole number of bytes. A caller trusts the template only once
//! it writes a seventh fresh lowering byte for byte (the sweep's `lower_seq_family`), and the test
//! `seq_templates` proves instances equal to fresh lowerings for every zoo model over a grid of batches
//! and lengths of several residues.

use rustc_hash::FxHashMap;

use crate::compact::CompactTrace;
use crate::graph::Graph;
use crate::graph_template::{changed_dims, one_structure, Dim};
use crate::template::{write_instance, Apart, PathStep, StepTemplate};
use crate::Recipe;

/// The modulus of the sequence lengths' residues that key a family: the largest rounding of a length
/// in the lowering (FlashAttention's backward, `round(S, 128)`), a multiple of every other (the
/// memory-efficient logsumexp's 32).
pub const SEQ_CLASS: u64 = 128;

/// The residue of `seq` that keys its family: lengths of one residue round alike.
pub fn seq_class(seq: u64) -> u64 {
    seq % SEQ_CLASS
}

/// A lowered step with the polynomial, in the batch and the sequence length, of every size and
/// number of `meta` that depends on them.
#[derive(Clone, Debug)]
pub struct SeqBatchTemplate {
    base: CompactTrace,
    batches: [u64; 2],
    seqs: [u64; 3],
    /// (event index, requested bytes at each (batch, length) of the fit: `[k * 3 + j]` at
    /// `batches[k]`, `seqs[j]`) of every allocation whose size varies, by index.
    sizes: Vec<(usize, [u64; 6])>,
    meta: Vec<(Vec<PathStep>, [u64; 6])>,
    /// The model graph's template, where the caller fitted and checked one
    /// ([`SeqBatchTemplate::with_graph`]).
    graph: Option<SeqGraphTemplate>,
}

impl SeqBatchTemplate {
    /// The template through `points[k][j]`, lowered at batch `batches[k]` and length `seqs[j]`, or
    /// why they are not one structure (different events, repeats or `meta` beyond sizes and
    /// numbers) or cannot fit one (a batch or a length twice, lengths of different residues).
    pub fn fit(
        points: [[&CompactTrace; 3]; 2],
        batches: [u64; 2],
        seqs: [u64; 3],
    ) -> Result<Self, String> {
        fit_points(batches, seqs)?;
        let base = points[0][0];
        let mut sizes: FxHashMap<usize, [Option<u64>; 6]> = FxHashMap::default();
        let mut meta: FxHashMap<Vec<PathStep>, [Option<u64>; 6]> = FxHashMap::default();
        for (p, point) in points.iter().flatten().enumerate().skip(1) {
            let apart = Apart::of(base, point)
                .map_err(|why| format!("batch {} × seq {}: {why}", batches[p / 3], seqs[p % 3]))?;
            for (i, at_base, here) in apart.sizes {
                let values = sizes.entry(i).or_default();
                values[0] = Some(at_base);
                values[p] = Some(here);
            }
            for (path, at_base, here) in apart.meta {
                let values = meta.entry(path).or_default();
                values[0] = Some(at_base);
                values[p] = Some(here);
            }
        }
        let mut sizes: Vec<(usize, [u64; 6])> =
            sizes.into_iter().map(|(i, v)| (i, filled(v))).collect();
        sizes.sort_unstable_by_key(|&(i, _)| i);
        let mut meta: Vec<(Vec<PathStep>, [u64; 6])> =
            meta.into_iter().map(|(p, v)| (p, filled(v))).collect();
        meta.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(SeqBatchTemplate {
            base: base.clone(),
            batches,
            seqs,
            sizes,
            meta,
            graph: None,
        })
    }

    /// The same template, writing the model graph too with `graph` (a [`SeqGraphTemplate`] of the
    /// same recipe that its caller checked, as it checked this one, against a graph built afresh).
    pub fn with_graph(self, graph: Option<SeqGraphTemplate>) -> Self {
        SeqBatchTemplate { graph, ..self }
    }

    /// The batches and sequence lengths the template was fitted at.
    pub fn fitted_at(&self) -> ([u64; 2], [u64; 3]) {
        (self.batches, self.seqs)
    }

    /// The step at `batch` and `seq`, as a lowering there writes it when the structure holds there;
    /// `None` when `seq` rounds otherwise than the fit's lengths (another residue), a size is not a
    /// whole number of bytes or leaves the range of bytes, or the arithmetic overflows.
    pub fn instantiate(&self, batch: u64, seq: u64) -> Option<CompactTrace> {
        if seq_class(seq) != seq_class(self.seqs[0]) {
            return None;
        }
        let weights = Weights::at(self.batches, self.seqs, batch, seq)?;
        write_instance(
            &self.base,
            self.sizes.iter().map(|(i, v)| (*i, weights.value(v))),
            self.meta
                .iter()
                .map(|(p, v)| (p.as_slice(), weights.value(v))),
        )
    }
}

impl StepTemplate for SeqBatchTemplate {
    fn instantiate_for(&self, recipe: &Recipe) -> Option<CompactTrace> {
        self.instantiate(recipe.batch, recipe.seq)
    }

    fn graph_for(&self, recipe: &Recipe) -> Option<Graph> {
        self.graph.as_ref()?.instantiate(recipe.batch, recipe.seq)
    }
}

/// A model graph at any batch and sequence length from six: each tensor dimension's six sizes at two
/// batches × three lengths of one residue, a polynomial of degree one in the batch and two in the
/// length through them (a dimension is `S`, `B·S`, `S·S`, ... where the zoo builds the same ops at
/// every point: [`crate::graph_template`]).
#[derive(Clone, Debug)]
pub struct SeqGraphTemplate {
    base: Graph,
    batches: [u64; 2],
    seqs: [u64; 3],
    /// The distinct series of sizes at the fit's points (as [`SeqBatchTemplate`] orders them) that
    /// the varying sizes take: a graph has thousands of those, and a few series (`S`, `B·S`, ...).
    series: Vec<[u64; 6]>,
    /// (where, its series) of every size that varies, in graph order.
    dims: Vec<(Dim, u32)>,
}

impl SeqGraphTemplate {
    /// The template through `points[k][j]`, the graph at batch `batches[k]` and length `seqs[j]`
    /// (as their own batch and length say), or `None` when they are not one structure or cannot fit
    /// one (a batch or a length twice, lengths of different residues).
    pub fn fit(points: [[&Graph; 3]; 2], batches: [u64; 2], seqs: [u64; 3]) -> Option<Self> {
        fit_points(batches, seqs).ok()?;
        let base = points[0][0];
        let at_points = points.iter().enumerate().all(|(k, row)| {
            row.iter()
                .enumerate()
                .all(|(j, g)| g.batch == batches[k] && g.seq == seqs[j] && one_structure(base, g))
        });
        if !at_points {
            return None;
        }
        let mut dims: FxHashMap<Dim, [Option<u64>; 6]> = FxHashMap::default();
        for (p, point) in points.iter().flatten().enumerate().skip(1) {
            for (at, at_base, here) in changed_dims(base, point) {
                let sizes = dims.entry(at).or_default();
                sizes[0] = Some(at_base);
                sizes[p] = Some(here);
            }
        }
        let mut listed: Vec<(Dim, [u64; 6])> =
            dims.into_iter().map(|(at, v)| (at, filled(v))).collect();
        listed.sort_unstable_by_key(|&(at, _)| at);
        let mut series: Vec<[u64; 6]> = Vec::new();
        let mut index: FxHashMap<[u64; 6], u32> = FxHashMap::default();
        let dims = listed
            .into_iter()
            .map(|(at, sizes)| {
                let i = *index.entry(sizes).or_insert_with(|| {
                    series.push(sizes);
                    (series.len() - 1) as u32
                });
                (at, i)
            })
            .collect();
        Some(SeqGraphTemplate {
            base: base.clone(),
            batches,
            seqs,
            series,
            dims,
        })
    }

    /// Whether the template writes `graph` (of its structure, built afresh at another batch and
    /// length) exactly: the check a caller makes before trusting it.
    pub fn writes(&self, graph: &Graph) -> bool {
        self.instantiate(graph.batch, graph.seq)
            .is_some_and(|made| made == *graph)
    }

    /// The graph at `batch` and `seq`, or `None` where `seq` rounds otherwise than the fit's lengths
    /// or a dimension is not a whole number (or leaves the range of sizes).
    pub fn instantiate(&self, batch: u64, seq: u64) -> Option<Graph> {
        if seq_class(seq) != seq_class(self.seqs[0]) {
            return None;
        }
        let weights = Weights::at(self.batches, self.seqs, batch, seq)?;
        let mut graph = self.base.clone();
        graph.batch = batch;
        graph.seq = seq;
        let sizes: Vec<u64> = self
            .series
            .iter()
            .map(|s| weights.value(s))
            .collect::<Option<_>>()?;
        for &(at, series) in &self.dims {
            at.set(&mut graph, sizes[series as usize]);
        }
        Some(graph)
    }
}

/// Why two batches × three lengths cannot fit a template, if they cannot: a batch or a length twice,
/// or lengths of different residues (which kernels round otherwise).
fn fit_points(batches: [u64; 2], seqs: [u64; 3]) -> Result<(), String> {
    if batches[0] == batches[1] {
        return Err("one batch twice".into());
    }
    if seqs[0] == seqs[1] || seqs[0] == seqs[2] || seqs[1] == seqs[2] {
        return Err("one sequence length twice".into());
    }
    if seqs.iter().any(|&s| seq_class(s) != seq_class(seqs[0])) {
        return Err(format!(
            "sequence lengths {seqs:?} round differently (residues modulo {SEQ_CLASS})"
        ));
    }
    Ok(())
}

/// A quantity's values at the fit's six points, from those listed where it differs from the base's
/// (the first, always listed): one not listed at a point is the base's there.
fn filled(values: [Option<u64>; 6]) -> [u64; 6] {
    values.map(|x| x.or(values[0]).expect("the base's is listed"))
}

/// The Lagrange basis of the fit's six points evaluated at one (batch, length), over one common
/// denominator: a quantity there is `Σ values[p] · numerators[p] / denominator`.
struct Weights {
    numerators: [i128; 6],
    denominator: i128,
}

impl Weights {
    fn at(batches: [u64; 2], seqs: [u64; 3], batch: u64, seq: u64) -> Option<Weights> {
        let (b, s) = (i128::from(batch), i128::from(seq));
        let [b0, b1] = batches.map(i128::from);
        let ss = seqs.map(i128::from);
        // degree one in the batch: (b1 - B) / (b1 - b0) and (B - b0) / (b1 - b0)
        let run = b1 - b0;
        let lb = [b1 - b, b - b0];
        // degree two in the length: Π_{m≠j} (S - s_m) / Π_{m≠j} (s_j - s_m), each over the lcm of
        // the denominators' magnitudes
        let others = |j: usize| (0..3).filter(move |&m| m != j);
        let num: [i128; 3] = std::array::from_fn(|j| others(j).map(|m| s - ss[m]).product());
        let den: [i128; 3] = std::array::from_fn(|j| others(j).map(|m| ss[j] - ss[m]).product());
        let lcm = den
            .iter()
            .try_fold(1i128, |l, &d| lcm(l, d.checked_abs()?))?;
        let mut numerators = [0i128; 6];
        for k in 0..2 {
            for j in 0..3 {
                numerators[k * 3 + j] = lb[k].checked_mul(num[j])?.checked_mul(lcm / den[j])?;
            }
        }
        Some(Weights {
            numerators,
            denominator: run.checked_mul(lcm)?,
        })
    }

    /// The quantity through `values`, when it is a whole number from 0 to 2^64 - 1.
    fn value(&self, values: &[u64; 6]) -> Option<u64> {
        let mut sum = 0i128;
        for (&v, &n) in values.iter().zip(&self.numerators) {
            sum = sum.checked_add(i128::from(v).checked_mul(n)?)?;
        }
        if sum % self.denominator != 0 {
            return None;
        }
        u64::try_from(sum / self.denominator).ok()
    }
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 {
        a.abs()
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: i128, b: i128) -> Option<i128> {
    if a == 0 || b == 0 {
        return Some(0);
    }
    (a / gcd(a, b)).checked_mul(b).map(i128::abs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_basis_reproduces_quadratics_in_the_length_and_lines_in_the_batch() {
        // 3 + 5·B + 7·S + 11·B·S + 13·S² + 17·B·S², by hand at each point
        let f = |b: u64, s: u64| 3 + 5 * b + 7 * s + 11 * b * s + 13 * s * s + 17 * b * s * s;
        let (batches, seqs) = ([2, 3], [128, 256, 512]);
        let values: [u64; 6] = std::array::from_fn(|p| f(batches[p / 3], seqs[p % 3]));
        for (b, s) in [(2, 128), (4, 1024), (9, 640), (1, 384), (13, 4096)] {
            let w = Weights::at(batches, seqs, b, s).unwrap();
            assert_eq!(w.value(&values), Some(f(b, s)), "{b} {s}");
        }
        // a size that is no whole number of bytes there is refused, not rounded
        let w = Weights::at([2, 4], seqs, 3, 128).unwrap();
        assert_eq!(w.value(&[1, 0, 0, 2, 0, 0]), None);
    }

    #[test]
    fn lengths_of_another_residue_are_another_family() {
        assert_eq!(seq_class(1000), seq_class(1128));
        assert_ne!(seq_class(1000), seq_class(1024));
    }
}
