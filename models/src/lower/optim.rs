//! The optimizer step as `torch/optim` runs it, with what runs around it: GradScaler's
//! `unscale_`/`step`/`update` (`torch/amp/grad_scaler.py`) and gradient clipping
//! (`torch/nn/utils/clip_grad.py`), all in the `optimizer` phase.
//!
//! * SGD (`_multi_tensor_sgd`): `_foreach_add_(params, grads, alpha=-lr)`; nothing allocated.
//! * SGD with momentum: at the first step `buf = grad.detach().clone()` per parameter (the
//!   state), then in-place `_foreach_mul_`/`_foreach_add_`. Nesterov (`nesterov=True`): foreach adds
//!   the buffers into the gradients in place (`torch._foreach_add_(device_grads, bufs,
//!   alpha=momentum)`), fused does it in the kernel: nothing more; the for-loop
//!   (`_single_tensor_sgd`) makes `grad = grad.add(buf, alpha=momentum)` per parameter, freed when
//!   `grad` is rebound to the next parameter's gradient (the last one when `step` returns).
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
//! * HF Adafactor (`transformers.optimization.Adafactor.step`, a loop over the parameters): see
//!   [`Lowering::adafactor_hf_step`].
//! * HF AdamW (`transformers.optimization.AdamW.step`, a loop over the parameters): see
//!   [`Lowering::adamw_hf_step`].
//! * `clip_grad_norm_` (foreach, the default on CUDA): see [`Lowering::clip_grad_norm`].
//! * GradScaler: see [`Lowering::scaler_unscale`]; fused SGD/Adam/AdamW
//!   (`_step_supports_amp_scaling`) take `grad_scale`/`found_inf` instead of an unscale pass.

use super::{Kind, Lowering, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::Layout;
use crate::recipe::{OptimizerImpl, OptimizerKind};

/// `kChunkSize` of `aten/src/ATen/native/cuda/MultiTensorApply.cuh`: elements per chunk of a foreach
/// kernel.
const FOREACH_CHUNK: u64 = 65536;

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

    /// The `optimizer` phase: `scaler.unscale_(optimizer)` and `clip_grad_norm_` when asked for,
    /// `scaler.step(optimizer)` (or `optimizer.step()`), then `scaler.update()`.
    pub(super) fn optimizer_step(&mut self) {
        self.kind_now = Kind::Temporary;
        let scaler = self.r.uses_grad_scaler() && !self.scaler.is_empty();
        // `_step_supports_amp_scaling`: fused SGD and Adam/AdamW unscale inside their kernel.
        let fused_scaling = scaler
            && self.r.optimizer_impl == OptimizerImpl::Fused
            && matches!(
                self.r.optimizer,
                OptimizerKind::Sgd
                    | OptimizerKind::SgdMomentum
                    | OptimizerKind::SgdNesterov
                    | OptimizerKind::Adam
                    | OptimizerKind::AdamW
            );
        // HF Trainer / nanoGPT: `scaler.unscale_(optimizer)` before clipping; otherwise
        // `scaler.step` unscales (non-fused optimizers only).
        let unscaled = scaler && (self.r.clip_grad_norm.is_some() || !fused_scaling);
        let mut found_inf_per_device = if unscaled {
            Some(self.scaler_unscale(false))
        } else {
            None
        };
        if self.r.clip_grad_norm.is_some() {
            self.clip_grad_norm();
        }
        let mut fused_args = Vec::new();
        if fused_scaling {
            if !unscaled {
                // GradScaler._check_inf_per_device: the same pass with a dummy inv_scale of 1.
                found_inf_per_device = Some(self.scaler_unscale(true));
            }
            // found_inf = sum([t.to(scaler.device) ...]): `0 + t`, a new scalar.
            fused_args.push(self.temp(&[], DType::F32, "aten.add"));
            if !unscaled {
                // optimizer.grad_scale = scaler * getattr(optimizer, "grad_scale", 1).
                fused_args.push(self.temp(&[], DType::F32, "aten.mul"));
            }
        }
        self.step_optimizer();
        // `del optimizer.grad_scale` (the product), then `found_inf` when `scaler.step` returns.
        for t in fused_args.into_iter().rev() {
            self.drop_rt(t);
        }
        // GradScaler.update: `_amp_update_scale_` in place; `_per_optimizer_states` is reset, and the
        // found_inf copy goes with the method's locals.
        if let Some(t) = found_inf_per_device {
            self.drop_rt(t);
        }
    }

    /// `GradScaler.unscale_` (or, with `dummy`, `_check_inf_per_device`): returns the found_inf copy
    /// that `_unscale_grads_` leaves in `found_inf_per_device` until `update()`.
    ///
    /// `inv_scale = self._scale.double().reciprocal().float()` (each temporary dies as the next call
    /// returns), `found_inf = torch.full((), 0.0)`; `_unscale_grads_` takes per-device copies through
    /// `_MultiDeviceReplicator.get` (`.to(device, copy=True)`): found_inf's first, then inv_scale's,
    /// the latter dying with the replicator when `_unscale_grads_` returns; then `inv_scale` and
    /// `found_inf` go with `unscale_`'s locals. `_amp_foreach_non_finite_check_and_unscale_` works in
    /// place. `_check_inf_per_device` makes `dummy_inv_scale = torch.full((), 1.0)` instead.
    fn scaler_unscale(&mut self, dummy: bool) -> Rt {
        let inv_scale = if dummy {
            self.temp(&[], DType::F32, "aten.full")
        } else {
            let d = self.temp(&[], DType::F64, "aten._to_copy");
            let r = self.temp(&[], DType::F64, "aten.reciprocal");
            self.drop_rt(d);
            let f = self.temp(&[], DType::F32, "aten._to_copy");
            self.drop_rt(r);
            f
        };
        let found_inf = self.temp(&[], DType::F32, "aten.full");
        let found_inf_copy = self.temp(&[], DType::F32, "aten._to_copy");
        let inv_scale_copy = self.temp(&[], DType::F32, "aten._to_copy");
        self.drop_rt(inv_scale_copy);
        self.drop_rt(inv_scale);
        self.drop_rt(found_inf);
        found_inf_copy
    }

    /// `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` with its default foreach path
    /// on CUDA (`torch/nn/utils/clip_grad.py`), the returned total norm discarded (nanoGPT).
    ///
    /// `_get_total_norm`: per (device, dtype) group of the gradients, `torch._foreach_norm(grads,
    /// 2.0)`, whose CUDA kernel (`_foreach_tensor_norm_cuda_impl`, `ForeachReduceOp.cu`) allocates
    /// `output_per_tensor = zeros(n × max_chunks)` in the op-math dtype (float32 for 16-bit; chunks of
    /// `kChunkSize` = 65,536 elements) and one 0-d result per tensor in the gradient's dtype, and
    /// frees the former on return; `torch.stack` of the norms (`[n]`), `torch.linalg.vector_norm` of
    /// it (0-d), the stack freed, then the list of norms (last first) when the function returns.
    /// `_clip_grads_with_norm_`: `clip_coef = max_norm / (total_norm + 1e-6)` (`add`, then
    /// `Tensor.__rtruediv__` = `reciprocal() * max_norm`), `torch.clamp(clip_coef, max=1.0)`,
    /// `_foreach_mul_` in place; `clip_coef` and the clamped copy go with the locals.
    fn clip_grad_norm(&mut self) {
        let ps: Vec<usize> = (0..self.param_grads.len())
            .filter(|&p| self.param_grads[p].is_some())
            .collect();
        if ps.is_empty() {
            return;
        }
        // Groups by dtype, in order of first appearance (`_group_tensors_by_device_and_dtype`).
        let mut groups: Vec<(DType, Vec<usize>)> = Vec::new();
        for &p in &ps {
            let d = self.param_grads[p].as_ref().map_or(DType::F32, |g| g.dtype);
            match groups.iter_mut().find(|(gd, _)| *gd == d) {
                Some((_, v)) => v.push(p),
                None => groups.push((d, vec![p])),
            }
        }
        let mut norms = Vec::new();
        let mut norm_dtype: Option<DType> = None;
        for (d, group) in &groups {
            let max_chunks = group
                .iter()
                .map(|&p| self.params[p].layout.numel().div_ceil(FOREACH_CHUNK))
                .max()
                .unwrap_or(0);
            let opmath = if *d == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let per_tensor = self.temp(
                &[group.len() as u64 * max_chunks],
                opmath,
                "aten._foreach_norm",
            );
            for _ in group {
                norms.push(self.temp(&[], *d, "aten._foreach_norm"));
            }
            self.drop_rt(per_tensor);
            // torch.stack promotes mixed dtypes (float32 over the 16-bit ones).
            norm_dtype = Some(match norm_dtype {
                None => *d,
                Some(x) if x == *d => x,
                Some(x) if x == DType::F64 || *d == DType::F64 => DType::F64,
                Some(_) => DType::F32,
            });
        }
        let d = norm_dtype.unwrap_or(DType::F32);
        let stacked = self.temp(&[norms.len() as u64], d, "aten.stack");
        let total = self.temp(&[], d, "aten.linalg_vector_norm");
        self.drop_rt(stacked);
        self.drop_list(norms);
        let plus_eps = self.temp(&[], d, "aten.add");
        let recip = self.temp(&[], d, "aten.reciprocal");
        let clip_coef = self.temp(&[], d, "aten.mul");
        self.drop_rt(recip);
        self.drop_rt(plus_eps);
        let clamped = self.temp(&[], d, "aten.clamp");
        self.drop_rt(clip_coef);
        self.drop_rt(clamped);
        self.drop_rt(total);
    }

    /// `optimizer.step()`.
    fn step_optimizer(&mut self) {
        // Parameters that have a gradient, in order.
        let ps: Vec<usize> = (0..self.param_grads.len())
            .filter(|&p| self.param_grads[p].is_some() && self.steps_param(p))
            .collect();
        let first = self.optim_steps == 0;
        self.optim_steps += 1;
        let shape = |l: &Self, p: usize| l.params[p].layout.shape.clone();
        let dt = |l: &Self, p: usize| l.params[p].dtype;
        match (self.r.optimizer, self.r.optimizer_impl) {
            (OptimizerKind::Sgd, _) => {}
            (OptimizerKind::SgdNesterov, OptimizerImpl::ForLoop) => {
                // _single_tensor_sgd: per parameter `grad = grads[i]` (the previous `grad.add(buf)`
                // dies), `buf = grad.detach().clone()` at the first step, `grad = grad.add(buf,
                // alpha=momentum)`.
                let mut prev: Option<Rt> = None;
                for &p in &ps {
                    if let Some(t) = prev.take() {
                        self.drop_rt(t);
                    }
                    let (s, d) = (shape(self, p), dt(self, p));
                    if first {
                        let t = self.state_alloc(p, &s, d, "momentum_buffer");
                        self.optim_state[p].push(t);
                    }
                    prev = Some(self.temp(&s, d, "aten.add"));
                }
                if let Some(t) = prev {
                    self.drop_rt(t);
                }
            }
            (OptimizerKind::SgdMomentum | OptimizerKind::SgdNesterov, _) => {
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
            (OptimizerKind::AdafactorHf, _) => self.adafactor_hf_step(&ps, first),
            (OptimizerKind::AdamWHf, _) => self.adamw_hf_step(&ps, first),
            (OptimizerKind::AdamW8bit, _) if first => self.bnb_adam_init(&ps, 8, false),
            (OptimizerKind::PagedAdamW, _) if first => self.bnb_adam_init(&ps, 32, true),
            (OptimizerKind::PagedAdamW8bit, _) if first => self.bnb_adam_init(&ps, 8, true),
            (
                OptimizerKind::AdamW8bit
                | OptimizerKind::PagedAdamW
                | OptimizerKind::PagedAdamW8bit,
                _,
            ) => {}
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
    }

    /// HF `transformers.optimization.Adafactor.step` (transformers 5.23) with HF Trainer's
    /// `optim="adafactor"` arguments (`scale_parameter=False, relative_step=False`; `beta1=None`: no
    /// `exp_avg`; `weight_decay=0`), a Python loop over the parameters in order. Per parameter:
    ///
    /// * `grad = p.grad` (the previous parameter's float32 copy dies), `grad = grad.float()` for 16-bit
    ///   gradients;
    /// * at the first step the state: `exp_avg_sq_row` `[..., R]` and `exp_avg_sq_col` `[..., C]`
    ///   (`torch.zeros(shape).to(grad)`: float32) for 2 or more dimensions, else `exp_avg_sq`
    ///   (`zeros_like(grad)`);
    /// * `p_data_fp32 = p` (the previous copy dies), `p.float()` for 16-bit parameters;
    /// * `state["RMS"] = _rms(p_data_fp32)`: `norm(2)` then `/ sqrt(numel)` (0-d float32, replacing
    ///   the previous step's);
    /// * `update = grad**2 + eps` (the `pow` dies after the `add`; the previous parameter's `update`
    ///   dies when rebound);
    /// * factored: `update.mean(dim=-1)` and `update.mean(dim=-2)` (each dies after its in-place
    ///   `add_`), `_approx_sq_grad`: `row / row.mean(-1, keepdim=True)` (`rsqrt_` in place),
    ///   `col.unsqueeze(-2).rsqrt()`, `torch.mul(r_factor, c_factor)` (full size), the two factors
    ///   dying when it returns; else `exp_avg_sq.rsqrt()` (full size); `mul_(grad)` in place;
    /// * `update.div_((_rms(update) / clip_threshold).clamp_(min=1.0))`: three 0-d temporaries;
    /// * `p_data_fp32.add_(-update)`: the full-size `neg` dies after the statement; `p.copy_` for
    ///   16-bit parameters.
    ///
    /// When `step` returns, its locals `grad`, `p_data_fp32` and `update` go, in that order.
    fn adafactor_hf_step(&mut self, ps: &[usize], first: bool) {
        let f32 = DType::F32;
        let mut grad32: Option<Rt> = None;
        let mut p32: Option<Rt> = None;
        let mut update: Option<Rt> = None;
        for &p in ps {
            let s = self.params[p].layout.shape.clone();
            let pd = self.params[p].dtype;
            let gd = self.param_grads[p].as_ref().map_or(pd, |g| g.dtype);
            let n = s.len();
            let factored = n >= 2;
            if let Some(t) = grad32.take() {
                self.drop_rt(t);
            }
            if matches!(gd, DType::F16 | DType::BF16) {
                grad32 = Some(self.temp(&s, f32, "aten._to_copy"));
            }
            if first {
                if factored {
                    let row = s[..n - 1].to_vec();
                    let mut col = s[..n - 2].to_vec();
                    col.push(s[n - 1]);
                    let r = self.state_alloc(p, &row, f32, "exp_avg_sq_row");
                    let c = self.state_alloc(p, &col, f32, "exp_avg_sq_col");
                    self.optim_state[p].push(r);
                    self.optim_state[p].push(c);
                } else {
                    let v = self.state_alloc(p, &s, f32, "exp_avg_sq");
                    self.optim_state[p].push(v);
                }
            }
            if let Some(t) = p32.take() {
                self.drop_rt(t);
            }
            if matches!(pd, DType::F16 | DType::BF16) {
                p32 = Some(self.temp(&s, f32, "aten._to_copy"));
            }
            // state["RMS"] = self._rms(p_data_fp32)
            let norm = self.temp(&[], f32, "aten.linalg_vector_norm");
            let rms = self.temp(&[], f32, "aten.div");
            let pname = self.g.params[p].name.clone();
            self.retag(&rms, format!("RMS:{pname}"));
            self.mark_state(&rms);
            self.drop_rt(norm);
            if !first {
                // The previous step's RMS, stored last.
                if let Some(old) = self.optim_state[p].pop() {
                    self.drop_rt(old);
                }
            }
            self.optim_state[p].push(rms);
            // update = (grad**2) + eps[0]
            let sq = self.temp(&s, f32, "aten.pow");
            let u = self.temp(&s, f32, "aten.add");
            self.drop_rt(sq);
            if let Some(old) = update.take() {
                self.drop_rt(old);
            }
            let u = if factored {
                let row = s[..n - 1].to_vec();
                let mut col = s[..n - 2].to_vec();
                col.push(s[n - 1]);
                let m = self.temp(&row, f32, "aten.mean");
                self.drop_rt(m);
                let m = self.temp(&col, f32, "aten.mean");
                self.drop_rt(m);
                // _approx_sq_grad
                let mut row_mean = s[..n - 2].to_vec();
                row_mean.push(1);
                let rm = self.temp(&row_mean, f32, "aten.mean");
                let r_factor = self.temp(&row, f32, "aten.div");
                self.drop_rt(rm);
                let mut c_shape = s[..n - 2].to_vec();
                c_shape.push(1);
                c_shape.push(s[n - 1]);
                let c_factor = self.temp(&c_shape, f32, "aten.rsqrt");
                let out = self.temp(&s, f32, "aten.mul");
                self.drop_rt(r_factor);
                self.drop_rt(c_factor);
                self.drop_rt(u);
                out
            } else {
                let out = self.temp(&s, f32, "aten.rsqrt");
                self.drop_rt(u);
                out
            };
            update = Some(u);
            // update.div_((self._rms(update) / clip_threshold).clamp_(min=1.0))
            let norm = self.temp(&[], f32, "aten.linalg_vector_norm");
            let r = self.temp(&[], f32, "aten.div");
            self.drop_rt(norm);
            let r2 = self.temp(&[], f32, "aten.div");
            self.drop_rt(r);
            self.drop_rt(r2);
            // p_data_fp32.add_(-update)
            let neg = self.temp(&s, f32, "aten.neg");
            self.drop_rt(neg);
        }
        for t in [grad32, p32, update].into_iter().flatten() {
            self.drop_rt(t);
        }
    }

    /// transformers' own `AdamW.step` (`transformers/optimization.py`, 4.16), per parameter in order:
    ///
    /// ```text
    /// if len(state) == 0:
    ///     state["exp_avg"] = torch.zeros_like(p.data); state["exp_avg_sq"] = torch.zeros_like(p.data)
    /// exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)              # in place
    /// exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)  # in place
    /// denom = exp_avg_sq.sqrt().add_(group["eps"])                    # one new tensor, p's size
    /// p.data.addcdiv_(exp_avg, denom, value=-step_size)               # in place
    /// if group["weight_decay"] > 0.0: p.data.add_(p.data, alpha=...)  # in place
    /// ```
    ///
    /// So the state of each parameter is created when the loop reaches it (between the previous
    /// parameters' temporaries, not all before the loop as `torch.optim`'s `_init_group` does), and
    /// the previous parameter's `denom` dies when the name is rebound, after the new one exists; the
    /// last `denom` goes when `step` returns. `step_size` is a Python float: nothing on the device.
    fn adamw_hf_step(&mut self, ps: &[usize], first: bool) {
        let mut denom: Option<Rt> = None;
        for &p in ps {
            let s = self.params[p].layout.shape.clone();
            let d = self.params[p].dtype;
            if first {
                let a = self.state_alloc(p, &s, d, "exp_avg");
                let b = self.state_alloc(p, &s, d, "exp_avg_sq");
                self.optim_state[p].push(a);
                self.optim_state[p].push(b);
            }
            let sq = self.temp(&s, d, "aten.sqrt");
            if let Some(old) = denom.replace(sq) {
                self.drop_rt(old);
            }
        }
        if let Some(t) = denom {
            self.drop_rt(t);
        }
    }

    /// Adam's `weight_decay` (PyTorch's default 0; AdamW's decay is decoupled and allocates nothing).
    pub(super) fn adam_weight_decay(&self) -> f64 {
        0.0
    }

    /// The first step of bitsandbytes `Optimizer2State.step` (`optim/optimizer.py`), AdamW with
    /// `optim_bits` 8 or 32: per parameter with a gradient, in order, `init_state`, then one fused
    /// update kernel (no PyTorch temporaries, so later steps allocate nothing). `init_state`: parameters under `min_8bit_size`
    /// (4096) elements, or 32-bit optimizers, get float32 `state1`/`state2`; otherwise uint8
    /// `state1`/`state2` and float32 `absmax1`/`absmax2` of ceil(n / 256) blocks (block-wise
    /// quantization, blocksize 256 in `optimizer_update_8bit_blockwise`), and the first such
    /// parameter moves the two 256-entry quantization maps (`dynamic`, `udynamic`) to the device.
    ///
    /// Paged (`is_paged`): `get_state_buffer` takes `state1`/`state2` of parameters of 1e5
    /// elements or more from `cudaMallocManaged` (`F.get_paged`), outside the caching allocator;
    /// the absmax vectors and smaller buffers are ordinary tensors. vramsim's rule: managed pages
    /// do not count against device memory: the driver migrates them to the GPU before each update
    /// (`prefetch_tensor`) and evicts them when device memory is short (CUDA unified memory
    /// oversubscription), so they never make the caching allocator run out; their bytes are
    /// reported as the trace's `paged_optimizer_bytes`.
    fn bnb_adam_init(&mut self, ps: &[usize], bits: u32, paged: bool) {
        const MIN_8BIT_SIZE: u64 = 4096;
        const BLOCK: u64 = 256;
        const PAGED_MIN: u64 = 100_000;
        for &p in ps {
            let s = self.params[p].layout.shape.clone();
            let n = self.params[p].layout.numel();
            let eight = bits == 8 && n >= MIN_8BIT_SIZE;
            let dtype = if eight { DType::U8 } else { DType::F32 };
            if eight && !self.bnb_qmaps {
                // name2qmap["dynamic"] / ["udynamic"].to(p.device): 256 float32 entries each.
                for name in ["qmap1", "qmap2"] {
                    let t = self.state_alloc(p, &[256], DType::F32, name);
                    self.optim_state[p].push(t);
                }
                self.bnb_qmaps = true;
            }
            for name in ["state1", "state2"] {
                if paged && n >= PAGED_MIN {
                    self.paged_bytes += n * dtype.size();
                } else {
                    let t = self.state_alloc(p, &s, dtype, name);
                    self.optim_state[p].push(t);
                }
            }
            if eight {
                for name in ["absmax1", "absmax2"] {
                    let t = self.state_alloc(p, &[n.div_ceil(BLOCK)], DType::F32, name);
                    self.optim_state[p].push(t);
                }
            }
        }
    }
}
