//! Lowers the recipe of a capture fixture and compares it with PyTorch's trace, event by event.
//!
//! `cargo run --release -p vramsim-models --example compare_fixture -- models/tests/fixtures/capture/gpt2__b2s128__fp32-sgd.json [--cuda] [--events N]`
//!
//! Prints the peaks (overall and per phase) of both traces and the first events where the two
//! sequences of allocation sizes differ.

use vramsim_models::{
    lower, zoo, Attention, Checkpointing, Fidelity, OptimizerKind, Precision, Recipe,
};
use vramsim_traces::{read_trace, Event};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = &args[0];
    let cuda = args.iter().any(|a| a == "--cuda");
    let show: usize = args
        .iter()
        .position(|a| a == "--events")
        .map(|i| args[i + 1].parse().unwrap())
        .unwrap_or(40);
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rc = &fx["recipe"];
    let mut r = Recipe::new(
        rc["batch"].as_u64().unwrap(),
        rc["seq"].as_u64().unwrap_or(0),
    );
    // fp32, bf16, amp-fp16, amp-bf16 (the AMP fixtures of tests/fixtures/amp/)
    r.precision = rc["dtype"].as_str().unwrap().parse::<Precision>().unwrap();
    // the AMP fixtures name the attention ("eager", "sdpa-flash", ...); the others ran eager
    r.attention = match rc.get("attention").and_then(|a| a.as_str()) {
        Some(a) => a.parse::<Attention>().unwrap(),
        None => Attention::Eager,
    };
    r.optimizer = rc["optimizer"]
        .as_str()
        .unwrap()
        .parse::<OptimizerKind>()
        .unwrap();
    // "none", "full", "selective" (the AMP fixtures' checkpointed SDPA calls)
    r.checkpointing = rc["checkpoint"]
        .as_str()
        .unwrap()
        .parse::<Checkpointing>()
        .unwrap();
    r.accum = rc["accum"].as_u64().unwrap() as u32;
    r.iterations = rc["iterations"].as_u64().unwrap() as u32;
    r.fidelity = if cuda {
        Fidelity::Cuda
    } else {
        Fidelity::MetaCapture
    };
    let model = fx["model"].as_str().unwrap();
    let g = zoo::build(model, &r).unwrap();
    let t = lower(&g, &r).unwrap();
    if let Some(i) = args.iter().position(|a| a == "--write") {
        vramsim_traces::write_trace(&args[i + 1], &t).unwrap();
    }
    let ours = vramsim_models::peak_requested(&t);
    let theirs = fx["peak_requested_bytes"].as_u64().unwrap();
    println!(
        "{model} {}: ours {ours} theirs {theirs} err {:+.4}%",
        r.name(),
        (ours as f64 - theirs as f64) / theirs as f64 * 100.0
    );
    let dir = std::path::Path::new(path).parent().unwrap();
    let Some(tr) = fx["trace"].as_str() else {
        return;
    };
    let real = read_trace(dir.join(tr)).unwrap();
    let phases = |ev: &[Event]| {
        let mut live = std::collections::HashMap::new();
        let (mut cur, mut out, mut ph) = (0u64, Vec::<(String, u64)>::new(), String::new());
        for e in ev {
            match e {
                Event::Phase { name } => {
                    ph = name.to_string();
                    out.push((ph.clone(), cur));
                }
                Event::Alloc { id, size, .. } => {
                    live.insert(id.clone(), *size);
                    cur += size;
                    if let Some(l) = out.last_mut() {
                        l.1 = l.1.max(cur);
                    }
                }
                Event::Free { id } => {
                    cur -= live.remove(id).unwrap_or(0);
                }
                _ => {}
            }
        }
        let _ = ph;
        out
    };
    let (a, b) = (phases(&t.events), phases(&real.events));
    for (x, y) in a.iter().zip(b.iter()) {
        println!(
            "  {:10} ours {:>14} theirs {:>14} {:+}",
            x.0,
            x.1,
            y.1,
            x.1 as i64 - y.1 as i64
        );
    }
    // First divergence in the sequence of (op, size).
    let key = |e: &Event, sizes: &std::collections::HashMap<String, u64>| -> Option<String> {
        match e {
            Event::Alloc { size, tag, .. } => {
                Some(format!("A {size} {}", tag.as_deref().unwrap_or("")))
            }
            Event::Free { id } => Some(format!(
                "F {}",
                sizes.get(&id.to_string()).copied().unwrap_or(0)
            )),
            Event::Phase { name } => Some(format!("P {name}")),
            _ => None,
        }
    };
    let seq = |ev: &[Event]| {
        let mut sizes = std::collections::HashMap::new();
        let mut out = Vec::new();
        for e in ev {
            if let Event::Alloc { id, size, .. } = e {
                sizes.insert(id.to_string(), *size);
            }
            if let Some(k) = key(e, &sizes) {
                out.push(k);
            }
        }
        out
    };
    let (sa, sb) = (seq(&t.events), seq(&real.events));
    let num = |s: &str| s.split(' ').take(2).collect::<Vec<_>>().join(" ");
    let skip: usize = args
        .iter()
        .position(|a| a == "--skip")
        .map(|i| args[i + 1].parse().unwrap())
        .unwrap_or(0);
    let first = sa
        .iter()
        .zip(sb.iter())
        .skip(skip)
        .position(|(x, y)| num(x) != num(y))
        .map(|i| i + skip);
    println!("events: ours {} theirs {}", sa.len(), sb.len());
    if let Some(i) = first {
        let lo = i.saturating_sub(8);
        println!("first difference at event {i}:");
        for j in lo..(i + show).min(sa.len().max(sb.len())) {
            println!(
                "{j:6} {:60} | {}",
                sa.get(j).map(|s| s.as_str()).unwrap_or(""),
                sb.get(j).map(|s| s.as_str()).unwrap_or("")
            );
        }
    } else {
        println!("sequences agree on the common prefix");
    }
}
