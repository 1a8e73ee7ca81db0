//! `--cp N` (context parallelism, `vramsim_models::context_parallel`), rank by rank. Every
//! context-parallel rank holds `seq/cp` tokens and runs the load-balanced ring attention, whose
//! steps differ by rank (rank `c` attends `c` steps with the first half of the received K/V and
//! `cp − 1 − c` with the second half of its queries, merging those into float32 halves), so each
//! cp rank is its own role: lowered and replayed once (through `pipeline.rs`'s rank-by-rank
//! machinery), the layout fitting only if every rank fits. The data- and tensor-parallel ranks of
//! a cp rank hold equal shards (one role with it).

use std::fmt::Write as _;

use serde_json::{json, Value};
use vramsim_models::Recipe;

use crate::ranks::RankRole;

/// Whether `recipe` shards the sequence over two or more context-parallel ranks.
pub fn is_context_parallel(recipe: &Recipe) -> bool {
    recipe.parallel.cp > 1
}

/// The global ranks that play context-parallel rank `rank`'s role: torchtitan's mesh order
/// `["pp", "dp_replicate", "dp_shard", "cp", "tp"]` (`ParallelDims`, `parallel_dims.py`), so
/// data-parallel rank `d`, cp rank `c` and tensor-parallel rank `t` are global rank
/// `(d·cp + c)·tp + t`.
pub fn cp_ranks(recipe: &Recipe, rank: u32) -> Vec<u32> {
    let p = &recipe.parallel;
    let (dp, cp, tp) = (p.dp.max(1), p.cp.max(1), p.tp.max(1));
    (0..dp)
        .flat_map(|d| (0..tp).map(move |t| (d * cp + rank) * tp + t))
        .collect()
}

/// What context-parallel rank `rank` holds, in words.
pub fn role_name(recipe: &Recipe, rank: u32) -> String {
    let p = &recipe.parallel;
    let chunk = recipe.seq / (2 * u64::from(p.cp.max(1)));
    let tp = if p.tp > 1 {
        format!(" × {}", crate::ranks::tp_role(p))
    } else {
        String::new()
    };
    format!(
        "context-parallel rank {rank} (tokens of chunks {rank} and {} of {} × {chunk}; ring: {} full-query step{}, {} half-query step{}; FSDP2 shard over dp × cp = {}){tp}",
        2 * p.cp - 1 - rank,
        2 * p.cp,
        rank + 1,
        if rank == 0 { "" } else { "s" },
        p.cp - 1 - rank,
        if p.cp - 1 - rank == 1 { "" } else { "s" },
        p.fsdp_world()
    )
}

/// `predict`'s lines for a context-parallel layout: the split, then one line per rank.
pub fn to_table(recipe: &Recipe, roles: &[RankRole]) -> String {
    let p = &recipe.parallel;
    let mut out = String::new();
    let tp = if p.tp > 1 {
        format!(" × tp {}{}", p.tp, if p.sp { " --sp" } else { "" })
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "layout     cp {} × dp {} --shard {}{tp} ({} ranks): {} tokens of {} per rank (head-tail load balanced), ring attention (all-gathered K/V); each cp rank replayed; fits only if every rank fits",
        p.cp,
        p.dp,
        p.shard,
        p.world_size(),
        p.local_seq(recipe.seq),
        recipe.seq
    );
    out.push_str(&crate::ranks::to_table_lines(roles));
    out.push_str(&crate::ranks::decides_line(roles));
    out
}

/// The `context_parallel` object of `predict --json`.
pub fn to_json(recipe: &Recipe, roles: &[RankRole]) -> Value {
    let p = &recipe.parallel;
    json!({
        "cp": p.cp,
        "seq": recipe.seq,
        "seq_per_rank": p.local_seq(recipe.seq),
        "load_balancer": "head-tail",
        "rotate_method": "allgather",
        "fsdp_shards": p.fsdp_world(),
        "fits": roles.iter().all(|r| r.fits),
        "deciding_ranks": crate::ranks::worst_ranks(roles),
    })
}
