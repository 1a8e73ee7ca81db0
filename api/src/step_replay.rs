//! Replaying a lowered step on a machine: the allocator built with the device memory the step's
//! libraries hold outside it, the compact trace's pieces replayed as views of its shared events (its
//! repeated micro-batches to their steady state), and the report with what `predict` adds to it
//! ([`replay_step`]); several accumulation counts of one lowering replayed together
//! ([`replay_step_variants`]).

use std::time::Instant;

use anyhow::Result;
use vramsim_models::compact::ReplayPiece;
use vramsim_models::peak_breakdown_until;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::device::Device;
use vramsim_sim::engine::{Flow, Repeat, Replay, ReplayOptions, ReplayOutcome};
use vramsim_sim::report::Report;
use vramsim_traces::{Event, Trace};

use crate::machine::{Machine, MachineArgs};
use crate::nccl::NcclMemory;
use crate::predict::{Lowered, Prediction};

/// Replays a lowered step on the machine `machine` describes (keeping a timeline of
/// `timeline_points` points for plots) and, with `breakdown`, breaks it down at its peak, or at the
/// out-of-memory error (without, the breakdown is empty: searches that only ask whether a step fits).
pub fn replay_step(
    lowered: &Lowered,
    machine: &MachineArgs,
    timeline_points: usize,
    breakdown: bool,
) -> Result<(Report, Prediction)> {
    let (machine, nccl, built) = step_machine(lowered, machine)?;
    let t1 = Instant::now();
    let options = ReplayOptions { timeline_points };
    let mut replay = Replay::new(built.allocator, &options);
    replay_pieces(&mut replay, lowered, lowered.pieces())?;
    let step = StepMachine {
        machine: &machine,
        nccl,
        alloc_conf: &built.alloc_conf,
        memory_fraction: built.memory_fraction,
    };
    Ok(step.report(lowered, replay, breakdown, t1))
}

/// [`replay_step`] for one step at several accumulation counts that one compact lowering serves
/// (`variants`: [`Lowered::with_accum`] of one lowering, or the lowering itself), without a timeline:
/// what comes before the repeated micro-batch is replayed once, and so are the repetitions the counts
/// share, the replay copied where they part (`Replay::apply_repeated_each`: where a count's
/// repetitions end, and at the steady state). The counts that reached the steady state are one run
/// with more or fewer repetitions: the smallest replays its rest, and tells the larger ones' outcomes
/// (`Replay::outcome_with_more`, where every later repeat reaches its steady state too), and a
/// smaller one's where it ended one repetition before the steady state showed and that repetition
/// raised no statistic's peak; the others replay their own rest. The same reports as a
/// [`replay_step`] of each (test `compact_replay`). Replays each alone where the variants do not share their lowering or the allocator model cannot
/// be copied.
pub fn replay_step_variants(
    variants: &[&Lowered],
    machine: &MachineArgs,
    breakdown: bool,
) -> Result<Vec<(Report, Prediction)>> {
    let each_alone = || {
        variants
            .iter()
            .map(|l| replay_step(l, machine, 0, breakdown))
            .collect()
    };
    let Some((first, others)) = variants.split_first() else {
        return Ok(Vec::new());
    };
    let shared = others.iter().all(|l| {
        l.compact.same_lowering(&first.compact) && l.recipe.parallel == first.recipe.parallel
    });
    let pieces = first.pieces();
    // the pieces before the first repetition (events, then the repeated micro-batch)
    if !shared || pieces.len() < 3 || pieces[1].repeat.is_none() {
        return each_alone();
    }
    let (machine, nccl, built) = step_machine(first, machine)?;
    if built.allocator.fork().is_none() {
        return each_alone();
    }
    let t1 = Instant::now();
    let mut replay = Replay::new(built.allocator, &ReplayOptions::default());
    // to tell the counts that end before the steady state shows
    replay.keep_stretch_peaks();
    let step = StepMachine {
        machine: &machine,
        nccl,
        alloc_conf: &built.alloc_conf,
        memory_fraction: built.memory_fraction,
    };
    if replay_pieces(&mut replay, first, &pieces[..1])? == Flow::Stopped {
        // out of memory before the repetitions: every count stops there
        return Ok(step.reports(replay, variants, breakdown, t1));
    }
    let repeat_of = |l: &Lowered| l.pieces()[1].repeat.expect("a repeat").times;
    let mut counts: Vec<u64> = variants.iter().map(|l| repeat_of(l)).collect();
    counts.sort_unstable();
    counts.dedup();
    let r = pieces[1].repeat.expect("checked");
    let repeat = Repeat {
        view: first.compact.piece_view(&pieces[1]),
        times: r.times,
        renamed_from: r.renamed_from,
        shift: r.shift,
    };
    let mut forks: Vec<Option<(StepReplay, Flow)>> = replay
        .apply_repeated_each(&repeat, &counts, |a| a.fork().expect("checked"))?
        .into_iter()
        .map(Some)
        .collect();
    // The counts whose replays carried the repeat's steady state are one run with more or fewer
    // repetitions: the smallest replays its rest, and tells the others' outcomes
    // (`Replay::outcome_with_more`, exact where every later repeat is carried too), and those of the
    // counts that ended one repetition before the steady state showed where that repetition raised
    // no statistic's peak; the other counts replay their own rest.
    let carried: Vec<usize> = (0..counts.len())
        .filter(|&slot| {
            forks[slot]
                .as_ref()
                .is_some_and(|(r, flow)| *flow == Flow::Continue && r.carried_repeats() == 1)
        })
        .collect();
    let mut shared: Option<(u64, StepReplay)> = None;
    if !carried.is_empty() {
        let slot = carried[0];
        let count = counts[slot];
        let l = variants
            .iter()
            .find(|l| repeat_of(l) == count)
            .expect("a variant has it");
        let (mut r, _) = forks[slot].take().expect("not taken yet");
        replay_pieces(&mut r, l, &l.pieces()[2..])?;
        shared = Some((count, r));
    }
    let repeats = first.compact.repeats.len();
    let mut out: Vec<Option<(Report, Prediction)>> = variants.iter().map(|_| None).collect();
    for (i, l) in variants.iter().enumerate() {
        let count = repeat_of(l);
        if let Some((from, r)) = &shared {
            if count == *from {
                continue;
            }
            // fewer repetitions too, where the steady state held from the last one replayed
            let more = count as i64 - *from as i64;
            if let Some(outcome) = r.outcome_with_more(more, repeats) {
                let device = r.allocator().device().clone();
                out[i] = Some(step.report_outcome(l, outcome, device, breakdown, t1));
                continue;
            }
        }
        let slot = counts.binary_search(&count).expect("every count");
        // a count two variants share (the same step twice) gets a copy for all but its last
        let last_of_count = variants[i + 1..].iter().all(|m| repeat_of(m) != count);
        let (mut r, flow) = match (last_of_count, forks[slot].take()) {
            (true, Some(fork)) => fork,
            (false, Some((r, flow))) => {
                let copy = (copy_of(&r), flow);
                forks[slot] = Some((r, flow));
                copy
            }
            (_, None) => unreachable!("each count's replay is taken once, by its last variant"),
        };
        if flow == Flow::Continue {
            replay_pieces(&mut r, l, &l.pieces()[2..])?;
        }
        out[i] = Some(step.report(l, r, breakdown, t1));
    }
    // the shared replay is the smallest carried count's own
    if let Some((from, r)) = shared {
        let mine: Vec<usize> = (0..variants.len())
            .filter(|&i| repeat_of(variants[i]) == from)
            .collect();
        let lowered: Vec<&Lowered> = mine.iter().map(|&i| variants[i]).collect();
        for (i, report) in mine
            .into_iter()
            .zip(step.reports(r, &lowered, breakdown, t1))
        {
            out[i] = Some(report);
        }
    }
    Ok(out
        .into_iter()
        .map(|o| o.expect("every variant is reported"))
        .collect())
}

/// The machine a lowered step replays on: `machine` with the device memory the step's libraries
/// hold outside the allocator (cuBLAS's own pools, NCCL's buffers, the kernels loaded at first use),
/// and its allocator built.
fn step_machine(
    lowered: &Lowered,
    machine: &MachineArgs,
) -> Result<(MachineArgs, NcclMemory, Machine)> {
    // cuBLAS's own workspace pools (PyTorch 1.10) are device memory outside the allocator.
    let mut machine = machine.clone();
    machine.library_bytes = lowered
        .compact
        .meta
        .get("cublas_own_bytes")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    // NCCL's buffers are device memory outside the allocator too.
    let nccl = machine.nccl(&lowered.recipe.parallel)?;
    machine.library_bytes = machine.library_bytes.saturating_add(nccl.bytes);
    // So are the kernels the step loads at their first call (lazy module loading).
    if let Some(modules) = machine.step_modules_choice() {
        machine.library_bytes = machine.library_bytes.saturating_add(modules.bytes);
    }
    let built = machine.build()?;
    Ok((machine, nccl, built))
}

/// Replays `pieces` of `lowered` in order, until they end or an allocation fails. Repeated
/// micro-batches replay until their steady state, then are carried (`Replay::apply_repeated`): the
/// same report as every event replayed.
fn replay_pieces(
    replay: &mut StepReplay,
    lowered: &Lowered,
    pieces: &[ReplayPiece],
) -> Result<Flow> {
    for piece in pieces {
        // borrowed: no event (nor its tag) is copied
        let view = lowered.compact.piece_view(piece);
        let flow = match &piece.repeat {
            None => replay.apply_view(&view)?,
            Some(r) => replay.apply_repeated(&Repeat {
                view,
                times: r.times,
                renamed_from: r.renamed_from,
                shift: r.shift,
            })?,
        };
        if flow == Flow::Stopped {
            return Ok(Flow::Stopped);
        }
    }
    Ok(Flow::Continue)
}

/// A step's replay on its machine's allocator.
type StepReplay = Replay<Box<dyn Allocator>>;

/// A copy of `replay` with a copy of its allocator (one that can be copied: checked before).
fn copy_of(replay: &StepReplay) -> StepReplay {
    replay.fork_with(replay.allocator().fork().expect("checked"))
}

/// What a step's report takes from its machine.
struct StepMachine<'a> {
    machine: &'a MachineArgs,
    nccl: NcclMemory,
    alloc_conf: &'a str,
    memory_fraction: Option<f64>,
}

impl StepMachine<'_> {
    /// The reports of `lowered` (not empty), each finishing the same `replay`: copies of it for all
    /// but the last, which takes it.
    fn reports(
        &self,
        replay: StepReplay,
        lowered: &[&Lowered],
        breakdown: bool,
        t1: Instant,
    ) -> Vec<(Report, Prediction)> {
        let (last, others) = lowered.split_last().expect("not empty");
        let mut out: Vec<(Report, Prediction)> = others
            .iter()
            .map(|l| self.report(l, copy_of(&replay), breakdown, t1))
            .collect();
        out.push(self.report(last, replay, breakdown, t1));
        out
    }

    /// The report and prediction of `lowered`'s finished `replay` (started at `t1`), broken down at
    /// its peak or out-of-memory error with `breakdown`.
    fn report(
        &self,
        lowered: &Lowered,
        replay: StepReplay,
        breakdown: bool,
        t1: Instant,
    ) -> (Report, Prediction) {
        let device = replay.allocator().device().clone();
        self.report_outcome(lowered, replay.finish(), device, breakdown, t1)
    }

    /// [`StepMachine::report`] from a replay's outcome on `device`.
    fn report_outcome(
        &self,
        lowered: &Lowered,
        outcome: ReplayOutcome,
        device: Device,
        breakdown: bool,
        t1: Instant,
    ) -> (Report, Prediction) {
        let oom_at = outcome.oom.as_ref().map(|o| o.event_index as usize);
        // What is live at the step's peak, or, when it runs out of memory, when the error is raised.
        let (breakdown, oom_tag) = match oom_at {
            _ if !breakdown => (peak_breakdown_until(&Trace::default(), 0), None),
            None => (
                lowered
                    .peak
                    .get_or_init(|| lowered.compact.peak_breakdown())
                    .clone(),
                None,
            ),
            Some(i) => (
                lowered.compact.peak_breakdown_until(i + 1),
                match lowered.compact.lowered_event_at(i) {
                    Some(Event::Alloc { tag, .. }) => tag.as_deref().map(String::from),
                    _ => None,
                },
            ),
        };
        let replay_ms = t1.elapsed().as_secs_f64() * 1e3;
        let report = Report {
            source: format!("{} (lowered by vramsim-models)", lowered.arch.name()),
            allocator: self.machine.allocator.name().to_string(),
            alloc_conf: self.alloc_conf.to_string(),
            memory_fraction: self.memory_fraction,
            device,
            outcome,
        };
        let prediction = Prediction {
            arch: lowered.arch.clone(),
            reference: lowered.reference.clone(),
            params: lowered.graph.total_param_count(),
            trainable_params: lowered.graph.param_count(),
            recipe: lowered.recipe.clone(),
            seq_given: lowered.seq_given,
            events: lowered.compact.events,
            lower_ms: lowered.lower_ms,
            from_template: lowered.from_template,
            replay_ms,
            breakdown,
            oom_tag,
            warnings: lowered.warnings.clone(),
            context: self.machine.context_choice(),
            attention: lowered.attention.clone(),
            nccl: self.nccl.clone(),
            step_modules: self.machine.step_modules_choice(),
        };
        (report, prediction)
    }
}
