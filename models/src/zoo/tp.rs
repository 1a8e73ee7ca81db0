//! Tensor and sequence parallelism in the zoo's transformers (`--tp`, `--sp`): the rank's
//! graph is the model with divided dimensions plus Megatron-LM's collectives
//! ([`crate::ops::TpComm`]), as `megatron/core/tensor_parallel/layers.py` splits a transformer
//! (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism):
//!
//! * column-parallel linears (`ColumnParallelLinear`, `gather_output=False`): weight
//!   `[out/t, in]` (GPT-2's `Conv1D` `[in, out/t]`) and bias `[out/t]`, input through
//!   `copy_to_tensor_model_parallel_region` (with `--sp`: the all-gather into the global buffer);
//! * row-parallel linears (`RowParallelLinear`, `input_is_parallel=True`): weight `[out, in/t]`,
//!   the product all-reduced in place (`reduce_from_tensor_model_parallel_region`; with `--sp`
//!   reduce-scattered into a new `s/t` shard), then `output_ + self.bias` (the bias whole);
//! * attention with heads/t (and KV heads/t), the MLP with its width/t, norms replicated (with
//!   `--sp` on `s/t` of the sequence, as are dropouts and residual adds);
//! * `VocabParallelEmbedding` (masked lookup, rows outside the rank's range zeroed, all-reduce)
//!   over the vocabulary padded as Megatron pads it, and the loss as
//!   `vocab_parallel_cross_entropy` on the rank's `[.., V/t]` logits.

use crate::dtype::DType;
use crate::graph::{DTypeSpec, GraphBuilder, T};
use crate::ops::{OpKind, TpComm};
use crate::recipe::Recipe;

/// Megatron's `--make-vocab-size-divisible-by` default (`megatron/training/models/gpt.py`
/// `make_vocab_size_divisible_by: int = 128`).
pub const MAKE_VOCAB_SIZE_DIVISIBLE_BY: u64 = 128;

/// How a zoo builder splits the model over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpPlan {
    /// Tensor-parallel ranks (1: the model whole, today's graph).
    pub t: u64,
    /// Sequence parallelism (`--sp`).
    pub sp: bool,
}

impl TpPlan {
    /// No tensor parallelism.
    pub const NONE: TpPlan = TpPlan { t: 1, sp: false };

    /// The plan of a recipe's layout.
    pub fn of(r: &Recipe) -> TpPlan {
        TpPlan {
            t: u64::from(r.parallel.tp.max(1)),
            sp: r.parallel.sp && r.parallel.tp > 1,
        }
    }

    /// Whether the model is split at all.
    pub fn on(self) -> bool {
        self.t > 1
    }

    /// The vocabulary Megatron's embedding and output layer hold over the group:
    /// `calculate_padded_vocab_size` (`megatron/training/vocab_utils.py`) rounds it up to a
    /// multiple of `make_vocab_size_divisible_by × tp` (the model's own size when not split).
    pub fn padded_vocab(self, vocab: u64) -> u64 {
        if !self.on() {
            return vocab;
        }
        let multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * self.t;
        vocab.div_ceil(multiple) * multiple
    }

    /// The rank's share of the (padded) vocabulary.
    pub fn local_vocab(self, vocab: u64) -> u64 {
        self.padded_vocab(vocab) / self.t
    }

    /// The sequence length the rank's norms, dropouts and residuals see.
    pub fn local_seq(self, seq: u64) -> u64 {
        if self.sp {
            seq / self.t
        } else {
            seq
        }
    }

    /// Checks that the rank's shards are whole: `megatron.core.utils.divide` asserts that the
    /// heads, KV heads and FFN width divide by the group size (`ColumnParallelLinear`,
    /// `RowParallelLinear`, attention's `num_attention_heads_per_partition`), and sequence
    /// parallelism splits the sequence (`_split_along_first_dim` asserts it divides). The error
    /// names the option (`tp` or `sp`) and says what does not divide.
    pub fn check(self, dims: &[(&str, u64)], seq: u64) -> Result<(), (&'static str, String)> {
        if !self.on() {
            return Ok(());
        }
        for &(what, n) in dims {
            if !n.is_multiple_of(self.t) {
                return Err((
                    "tp",
                    format!(
                        "{} does not divide {what} ({n}): each rank holds {what}/tp",
                        self.t
                    ),
                ));
            }
        }
        if self.sp && !seq.is_multiple_of(self.t) {
            return Err((
                "sp",
                format!(
                    "splits the sequence over the {} tensor-parallel ranks: seq {seq} does not divide by {}",
                    self.t, self.t
                ),
            ));
        }
        Ok(())
    }
}

impl GraphBuilder {
    /// A [`TpComm`] on `x` giving a value of `shape` (its dtype).
    pub(crate) fn tp_comm(&mut self, c: TpComm, x: T, shape: Vec<u64>) -> T {
        let d = self.dtype(x);
        self.op1(OpKind::TpComm(c), &[x], shape, d)
    }

    /// `x` `[B, S, ..]` with its sequence dimension multiplied (`k > 1`) or divided.
    fn seq_scaled(&self, x: T, mul: u64, div: u64) -> Vec<u64> {
        let mut s = self.shape(x);
        if let Some(d) = s.get_mut(1) {
            *d = *d * mul / div;
        }
        s
    }

    /// The input of column-parallel linears: `copy_to_tensor_model_parallel_region` (identity,
    /// gradient all-reduced), or with `--sp` the all-gather of the sequence shard into the global
    /// buffer.
    pub fn tp_column_input(&mut self, plan: TpPlan, x: T) -> T {
        if plan.sp {
            let s = self.seq_scaled(x, plan.t, 1);
            self.tp_comm(TpComm::GatherToBuffer, x, s)
        } else {
            let s = self.shape(x);
            self.tp_comm(TpComm::Copy, x, s)
        }
    }

    /// The output of a row-parallel product: all-reduced in place, or with `--sp`
    /// reduce-scattered into a new sequence shard.
    pub fn tp_row_output(&mut self, plan: TpPlan, x: T) -> T {
        if plan.sp {
            let s = self.seq_scaled(x, 1, plan.t);
            self.tp_comm(TpComm::ReduceScatter, x, s)
        } else {
            let s = self.shape(x);
            self.tp_comm(TpComm::Reduce, x, s)
        }
    }

    /// The full sequence for a head replicated on every rank, under `--sp` (`x` itself without):
    /// `gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)`, as Megatron's
    /// `Pooler` gathers before its replicated dense (`megatron/legacy/model/language_model.py`):
    /// every rank computes the head on the whole sequence, so the gradient is split, not reduced.
    pub fn tp_gather_for_replicated(&mut self, plan: TpPlan, x: T) -> T {
        if !plan.sp {
            return x;
        }
        let s = self.seq_scaled(x, plan.t, 1);
        self.tp_comm(TpComm::SeqGatherReplicated, x, s)
    }

    /// `scatter_to_sequence_parallel_region` and the clone after it: the rank's sequence shard.
    pub fn tp_scatter(&mut self, plan: TpPlan, x: T) -> T {
        let s = self.seq_scaled(x, 1, plan.t);
        self.tp_comm(TpComm::Scatter, x, s)
    }

    /// `RowParallelLinear` over HF's `Conv1D` named `name` (GPT-2): weight `[nx/t, nf]` (the
    /// rank's rows), `mm` of the flattened input, the all-reduce (or reduce-scatter), then the
    /// whole bias added (`output_ + self.bias`).
    pub fn row_parallel_conv1d(&mut self, plan: TpPlan, name: &str, x: T, nf: u64) -> T {
        let s = self.shape(x);
        let nx = *s.last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[nx, nf]);
            let bias = b.param("bias", &[nf]);
            let flat = b.view(x, &[-1, nx as i64]);
            let out = b.mm(flat, w);
            let mut shape: Vec<i64> = s[..s.len() - 1].iter().map(|&d| d as i64).collect();
            shape.push(nf as i64);
            let out = b.view(out, &shape);
            // `output_parallel` (and `output_`) are locals of RowParallelLinear.forward until it
            // returns, after the bias is added: under --sp the full product outlives the
            // reduce-scatter.
            b.hold(out);
            let out = b.tp_row_output(plan, out);
            b.hold(out);
            b.add(out, bias)
        })
    }

    /// `RowParallelLinear` over an `nn.Linear` named `name`: weight `[out, in/t]`, the product
    /// without bias, the all-reduce (or reduce-scatter), then `output_ + self.bias`.
    pub fn row_parallel_linear(
        &mut self,
        plan: TpPlan,
        name: &str,
        x: T,
        out: u64,
        bias: bool,
    ) -> T {
        let k = *self.shape(x).last().unwrap_or(&0);
        self.module(name, |b| {
            let w = b.param("weight", &[out, k]);
            let bb = bias.then(|| b.param("bias", &[out]));
            let o = b.linear_op(x, w, None);
            // `output_parallel` and `output_` live until RowParallelLinear.forward returns.
            b.hold(o);
            let o = b.tp_row_output(plan, o);
            b.hold(o);
            match bb {
                Some(bias) => b.add(o, bias),
                None => o,
            }
        })
    }

    /// `VocabParallelEmbedding.forward` (`megatron/core/tensor_parallel/layers.py`) with the
    /// rank's `[V/t, h]` rows `w`: `input_mask = (input_ < start) | (input_ >= end)`,
    /// `masked_input = input_.clone() - start` (masked in place), `F.embedding(masked_input, w)`,
    /// `output_parallel[input_mask, :] = 0.0` (`masked_fill_`), then the all-reduce in place — or, with
    /// `reduce_scatter`, `output_parallel.transpose(0, 1).contiguous()` and the reduce-scatter into
    /// the sequence shard.
    pub fn vocab_parallel_embedding(
        &mut self,
        plan: TpPlan,
        w: T,
        ids: T,
        reduce_scatter: bool,
    ) -> T {
        let s = self.shape(ids);
        let bool_t = DTypeSpec::Fixed(DType::Bool);
        let i64_t = DTypeSpec::Fixed(DType::I64);
        // `input_mask = (input_ < start) | (input_ >= end)`: the two comparisons die after the or.
        let lt = self.factory("aten.lt", &[ids], &s, bool_t, vec![]);
        let ge = self.factory("aten.ge", &[ids], &s, bool_t, vec![]);
        let mask = self.factory("aten.bitwise_or", &[lt, ge], &s, bool_t, vec![]);
        // `masked_input = input_.clone() - start` (the clone dies after the subtraction), then
        // `masked_input[input_mask] = 0` (`masked_fill_`, in place).
        let c = self.factory("aten.clone", &[ids], &s, i64_t, vec![]);
        let masked = self.factory("aten.sub", &[c], &s, i64_t, vec![]);
        let e = self.embedding_op(w, masked);
        let es = self.shape(e);
        let d = self.dtype(e);
        let e = self.op1(OpKind::MaskedFillInplace, &[e, mask], es, d);
        if reduce_scatter {
            // `[b, s, h] -> [s, b, h]` copy, kept batch-first here: the same bytes.
            let c = self.clone_t(e);
            self.tp_row_output(plan, c)
        } else {
            let es = self.shape(e);
            self.tp_comm(TpComm::Reduce, e, es)
        }
    }

    /// `vocab_parallel_cross_entropy(logits, target)` on `[N, V/t]` logits and `[N]` targets
    /// (float32 inside: a float copy of 16-bit logits), the per-token losses averaged.
    pub fn vocab_parallel_loss(&mut self, logits: T, target: T) -> T {
        let n = self.shape(target).first().copied().unwrap_or(0);
        let losses = self.op1(
            OpKind::VocabParallelCrossEntropy,
            &[logits, target],
            vec![n],
            DTypeSpec::Fixed(DType::F32),
        );
        self.mean_dim(losses, 0, false)
    }

    /// The causal-LM head and loss on one rank: `lm_head` as a column-parallel linear over the
    /// rank's `[V/t, h]` rows (tied: the embedding's), then HF's `ForCausalLMLoss` steps
    /// (`logits.float()`, labels padded and shifted) with Megatron's
    /// `vocab_parallel_cross_entropy` in place of `cross_entropy`, averaged over the tokens.
    /// Returns (logits, loss).
    pub fn tp_causal_lm_head(
        &mut self,
        plan: TpPlan,
        hidden: T,
        labels: T,
        tied: Option<T>,
        local_vocab: u64,
    ) -> (T, T) {
        let h = *self.shape(hidden).last().unwrap_or(&0);
        let logits = self.module("lm_head", |b| {
            let w = match tied {
                Some(w) => w,
                None => b.param("weight", &[local_vocab, h]),
            };
            let x = b.tp_column_input(plan, hidden);
            b.linear_op(x, w, None)
        });
        self.hold(logits);
        // the vocabulary-parallel loss saves only its own masked copy of the targets, so
        // `shift_labels` lives until ForCausalLMLoss returns
        let loss = self.causal_lm_loss_with(logits, labels, true, |b, flat, tgt| {
            b.vocab_parallel_loss(flat, tgt)
        });
        (logits, loss)
    }
}
