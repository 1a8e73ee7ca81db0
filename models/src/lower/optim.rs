//! The optimizer step as `torch/optim` runs it, and GradScaler's unscale/update.
//!
//! * SGD (`_multi_tensor_sgd`): `_foreach_add_(params, grads, alpha=-lr)`; nothing allocated.
//! * SGD with momentum: at the first step `buf = torch.clone(grad).detach()` per parameter (the
//!   state), then in-place `_foreach_mul_`/`_foreach_add_`.
//! * Adam/AdamW (`_multi_tensor_adam`): state `exp_avg`, `exp_avg_sq` (`zeros_like`, per parameter in
//!   order, at the first step; `step` is a CPU tensor); each step allocates the list
//!   `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, updated in place and freed when the
//!   function returns (a list dies last element first). Adam with `weight_decay != 0` also allocates
//!   `torch._foreach_add(grads, params)`. Fused (`_fused_adam_`): no intermediates, `step` is a
//!   float32 scalar on the device. For-loop (`_single_tensor_adam`): per parameter
//!   `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`.
//! * Adafactor (`_multi_tensor_adafactor`): state `row_var` `[..., R, 1]` and `col_var`
//!   `[..., 1, C]` for matrices, `variance` for vectors; per step the lists `row_means`,
//!   `col_means`, `var_estimates = row_var @ col_var` (full size), `row_var_means` for matrices,
//!   `grads_squared` and `var_estimates` (clones) for vectors.

use super::{Kind, Lowering, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::recipe::{OptimizerImpl, OptimizerKind, Precision};

impl<'g> Lowering<'g> {
    fn state_alloc(&mut self, p: usize, shape: &[u64], dtype: DType, name: &str) -> Rt {
        self.kind_now = Kind::OptimState;
        let t = self.alloc(
            Layout::contiguous(shape),
            dtype,
            ModuleId(0),
            "aten.zeros_like",
        );
        let pname = self.g.params[p].name.clone();
        self.retag(&t, format!("{name}:{pname}"));
        self.mark_state(&t);
        self.kind_now = Kind::Temporary;
        t
    }

    fn temp(&mut self, shape: &[u64], dtype: DType, op: &str) -> Rt {
        self.alloc(Layout::contiguous(shape), dtype, ModuleId(0), op)
    }

    fn drop_list(&mut self, list: Vec<Rt>) {
        for t in list.into_iter().rev() {
            self.drop_rt(t);
        }
    }

    /// `optimizer.step()` (with `scaler.step`/`scaler.update` around it for float16 autocast).
    pub(super) fn optimizer_step(&mut self) {
        self.kind_now = Kind::Temporary;
        let mut scaler_tmp = Vec::new();
        if self.r.precision == Precision::AmpFp16 && !self.scaler.is_empty() {
            // GradScaler.unscale_: inv_scale = scale.double().reciprocal().float(); found_inf.
            let d = self.temp(&[], DType::F64, "aten._to_copy");
            let r = self.temp(&[], DType::F64, "aten.reciprocal");
            let f = self.temp(&[], DType::F32, "aten._to_copy");
            self.drop_rt(r);
            self.drop_rt(d);
            let fi = self.temp(&[], DType::F32, "aten.full");
            scaler_tmp = vec![f, fi];
        }
        // Parameters that have a gradient, in order.
        let ps: Vec<usize> = (0..self.param_grads.len())
            .filter(|&p| self.param_grads[p].is_some())
            .collect();
        let first = self.optim_steps == 0;
        self.optim_steps += 1;
        let shape = |l: &Self, p: usize| l.params[p].layout.shape.clone();
        let dt = |l: &Self, p: usize| l.params[p].dtype;
        match (self.r.optimizer, self.r.optimizer_impl) {
            (OptimizerKind::Sgd, _) => {}
            (OptimizerKind::SgdMomentum, _) => {
                if first {
                    for &p in &ps {
                        // torch.clone(grad).detach() (foreach and for-loop); empty_like (fused).
                        let s = shape(self, p);
                        let d = dt(self, p);
                        let name = "momentum_buffer";
                        let t = self.state_alloc(p, &s, d, name);
                        self.optim_state[p].push(t);
                    }
                }
            }
            (OptimizerKind::Adam | OptimizerKind::AdamW, imp) => {
                if first {
                    for &p in &ps {
                        let s = shape(self, p);
                        let d = dt(self, p);
                        if imp == OptimizerImpl::Fused {
                            let st = self.state_alloc(p, &[], DType::F32, "step");
                            self.optim_state[p].push(st);
                        }
                        let a = self.state_alloc(p, &s, d, "exp_avg");
                        let b = self.state_alloc(p, &s, d, "exp_avg_sq");
                        self.optim_state[p].push(a);
                        self.optim_state[p].push(b);
                    }
                }
                let adam_wd =
                    self.r.optimizer == OptimizerKind::Adam && self.adam_weight_decay() != 0.0;
                match imp {
                    OptimizerImpl::Fused => {}
                    OptimizerImpl::Foreach => {
                        let mut grads_wd = Vec::new();
                        if adam_wd {
                            for &p in &ps {
                                let (s, d) = (shape(self, p), dt(self, p));
                                grads_wd.push(self.temp(&s, d, "aten._foreach_add"));
                            }
                            self.drop_list(grads_wd);
                        }
                        let mut sqrt = Vec::new();
                        for &p in &ps {
                            let (s, d) = (shape(self, p), dt(self, p));
                            sqrt.push(self.temp(&s, d, "aten._foreach_sqrt"));
                        }
                        self.drop_list(sqrt);
                    }
                    OptimizerImpl::ForLoop => {
                        let mut denom: Option<Rt> = None;
                        for &p in &ps {
                            let (s, d) = (shape(self, p), dt(self, p));
                            let g2 = if adam_wd {
                                Some(self.temp(&s, d, "aten.add"))
                            } else {
                                None
                            };
                            let sq = self.temp(&s, d, "aten.sqrt");
                            let dv = self.temp(&s, d, "aten.div");
                            self.drop_rt(sq);
                            if let Some(old) = denom.replace(dv) {
                                self.drop_rt(old);
                            }
                            if let Some(g2) = g2 {
                                self.drop_rt(g2);
                            }
                        }
                        if let Some(d) = denom {
                            self.drop_rt(d);
                        }
                    }
                }
            }
            (OptimizerKind::Adafactor, _) => {
                let multi: Vec<usize> = ps
                    .iter()
                    .copied()
                    .filter(|&p| self.params[p].layout.dim() >= 2)
                    .collect();
                let vecs: Vec<usize> = ps
                    .iter()
                    .copied()
                    .filter(|&p| self.params[p].layout.dim() < 2)
                    .collect();
                if first {
                    for &p in &ps {
                        let (s, d) = (shape(self, p), dt(self, p));
                        if s.len() >= 2 {
                            let mut row = s.clone();
                            *row.last_mut().unwrap() = 1;
                            let mut col = s.clone();
                            let n = col.len();
                            col[n - 2] = 1;
                            let r = self.state_alloc(p, &row, d, "row_var");
                            let c = self.state_alloc(p, &col, d, "col_var");
                            self.optim_state[p].push(r);
                            self.optim_state[p].push(c);
                        } else {
                            let v = self.state_alloc(p, &s, d, "variance");
                            self.optim_state[p].push(v);
                        }
                    }
                }
                // Groups in order of first appearance.
                let multi_first = ps
                    .first()
                    .map(|&p| self.params[p].layout.dim() >= 2)
                    .unwrap_or(true);
                let groups = if multi_first {
                    [(true, multi), (false, vecs)]
                } else {
                    [(false, vecs), (true, multi)]
                };
                let mut prev: Vec<Rt> = Vec::new();
                for (is_multi, group) in groups {
                    if group.is_empty() {
                        continue;
                    }
                    let mut est = Vec::new();
                    if is_multi {
                        let mut rows = Vec::new();
                        for &p in &group {
                            let (mut s, d) = (shape(self, p), dt(self, p));
                            *s.last_mut().unwrap() = 1;
                            rows.push(self.temp(&s, d, "aten.linalg_vector_norm"));
                        }
                        self.drop_list(rows);
                        let mut cols = Vec::new();
                        for &p in &group {
                            let (mut s, d) = (shape(self, p), dt(self, p));
                            let n = s.len();
                            s[n - 2] = 1;
                            cols.push(self.temp(&s, d, "aten.linalg_vector_norm"));
                        }
                        self.drop_list(cols);
                        for &p in &group {
                            let (s, d) = (shape(self, p), dt(self, p));
                            est.push(self.temp(&s, d, "aten.mm"));
                        }
                        let mut means = Vec::new();
                        for &p in &group {
                            let (mut s, d) = (shape(self, p), dt(self, p));
                            let n = s.len();
                            s[n - 1] = 1;
                            s[n - 2] = 1;
                            means.push(self.temp(&s, d, "aten.mean"));
                        }
                        self.drop_list(means);
                    } else {
                        let mut sq = Vec::new();
                        for &p in &group {
                            let (s, d) = (shape(self, p), dt(self, p));
                            sq.push(self.temp(&s, d, "aten._foreach_mul"));
                        }
                        self.drop_list(sq);
                        for &p in &group {
                            let (s, d) = (shape(self, p), dt(self, p));
                            est.push(self.temp(&s, d, "aten.clone"));
                        }
                    }
                    let old = std::mem::replace(&mut prev, est);
                    self.drop_list(old);
                }
                self.drop_list(prev);
            }
        }
        // GradScaler.update: the per-step found_inf and inv_scale go.
        for t in scaler_tmp.into_iter().rev() {
            self.drop_rt(t);
        }
    }

    /// Adam's `weight_decay` (PyTorch's default 0; AdamW's decay is decoupled and allocates nothing).
    fn adam_weight_decay(&self) -> f64 {
        0.0
    }
}
