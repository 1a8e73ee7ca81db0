//! `vramsim explain` on real out-of-memory messages (`tests/data/oom/corpus.json`: each verbatim from a
//! public source, noted next to it). For every message the printed figures are read back to the byte
//! within their rounding — the expected intervals computed here from the printed text by PyTorch's
//! rule (`format_size`: two decimals, glibc's round-half-to-even of the exact quotient), not by the
//! program's bisection — and the cause is the one derived by hand from the message by the stated rule.
//! Also: a vramsim replay's own out-of-memory message read back gives the replay's figures, and nothing
//! panics on arbitrary or mutated text.

use proptest::prelude::*;
use serde_json::Value;
use vramsim_api::explain::{explain, ExplainArgs};
use vramsim_api::parse_args;

fn corpus() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/oom/corpus.json");
    let text = std::fs::read_to_string(path).expect("the corpus is committed");
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["messages"].as_array().unwrap().clone()
}

fn args() -> ExplainArgs {
    parse_args::<ExplainArgs>("explain", &[]).unwrap()
}

/// The byte counts PyTorch's `format_size` prints as `printed`, by hand: `v` with two decimals in unit
/// U stands for b with b/U within half a hundredth of v, `200·b ∈ [(2·v100 − 1)·U, (2·v100 + 1)·U]`; an
/// exact tie goes to the even hundredth; each unit covers (1024^k, 1024^(k+1)], bytes up to 1024.
fn interval(printed: &str) -> (u64, u64) {
    let (number, unit) = printed.split_once(' ').unwrap();
    if unit == "bytes" {
        let n: u64 = number.parse().unwrap();
        return (n, n);
    }
    let k = match unit {
        "KiB" => 1,
        "MiB" => 2,
        "GiB" => 3,
        _ => panic!("unit {unit}"),
    };
    let u: u128 = 1 << (10 * k);
    let (int, frac) = number.split_once('.').unwrap();
    assert_eq!(frac.len(), 2, "{printed}");
    let v100: u128 = format!("{int}{frac}").parse().unwrap();
    let lo_num = (2 * v100 - 1) * u;
    let hi_num = (2 * v100 + 1) * u;
    let mut lo = lo_num.div_ceil(200);
    let mut hi = hi_num / 200;
    let odd = v100 % 2 == 1;
    if lo_num.is_multiple_of(200) && odd {
        lo += 1;
    }
    if hi_num.is_multiple_of(200) && odd {
        hi -= 1;
    }
    let floor = u + 1; // above the previous unit's top, 1024^k
    lo = lo.max(floor);
    if k < 3 {
        hi = hi.min(u * 1024);
    }
    (lo as u64, hi as u64)
}

#[test]
fn the_hand_rule_matches_known_prints() {
    // fact sheet §6.3 worked values
    assert_eq!(interval("1.00 KiB").0, 1025);
    assert_eq!(interval("1024.00 MiB").1, 1 << 30);
    let (lo, hi) = interval("79.18 GiB");
    assert!(lo <= 85_017_755_648 && 85_017_755_648 <= hi);
    // 1152 bytes = 1.125 KiB prints 1.12 (tie to even)
    assert!(interval("1.12 KiB").1 >= 1152 && interval("1.13 KiB").0 > 1152);
}

fn check_field(doc: &Value, field: &str, printed: &str, name: &str) {
    let b = &doc["bounds"][field];
    assert_eq!(b["printed"], printed, "{name}: {field} printed");
    let (lo, hi) = interval(printed);
    assert_eq!(
        (b["min"].as_u64().unwrap(), b["max"].as_u64().unwrap()),
        (lo, hi),
        "{name}: {field} {printed}"
    );
}

#[test]
fn every_real_message_is_read_to_the_byte_with_the_verdict_by_the_rule() {
    let messages = corpus();
    assert!(messages.len() >= 20, "{} messages", messages.len());
    let mut formats = std::collections::BTreeSet::new();
    for m in &messages {
        let source = m["source"].as_str().unwrap();
        assert!(source.contains("github.com"), "{source}: a source");
        let text = m["text"].as_str().unwrap();
        let doc = explain(text, &args())
            .unwrap_or_else(|e| panic!("{source}: {e:#}"))
            .to_json();
        let e = &m["expect"];
        let format = m["format"].as_str().unwrap();
        formats.insert(format.to_string());
        let name = source;
        for (key, field) in [
            ("requested", "requested_bytes"),
            ("capacity", "capacity_bytes"),
            ("free", "free_bytes"),
            ("allowed", "allowed_bytes"),
            ("allocated", "pytorch_allocated_bytes"),
            ("reserved", "pytorch_reserved_bytes"),
            ("reserved_unallocated", "pytorch_reserved_unallocated_bytes"),
            ("this_process", "this_process_bytes"),
        ] {
            if let Some(printed) = e[key].as_str() {
                check_field(&doc, field, printed, name);
            }
        }
        // 1.4–2.0: reserved − allocated, by interval arithmetic on the hand intervals
        if let (Some(r), Some(a)) = (e["reserved"].as_str(), e["allocated"].as_str()) {
            let (rl, rh) = interval(r);
            let (al, ah) = interval(a);
            let b = &doc["bounds"]["pytorch_reserved_unallocated_bytes"];
            assert_eq!(b["min"].as_u64().unwrap(), rl.saturating_sub(ah), "{name}");
            assert_eq!(b["max"].as_u64().unwrap(), rh.saturating_sub(al), "{name}");
        }
        if let Some(p) = e["private_pools"].as_str() {
            let (lo, hi) = interval(p);
            assert!(doc["private_pool_bytes"].as_u64().unwrap() >= lo, "{name}");
            assert!(doc["private_pool_bytes"].as_u64().unwrap() <= hi, "{name}");
        }
        if let Some(active) = e["active"].as_str() {
            let (lo, hi) = interval(active);
            let got = doc["active_bytes"].as_u64().unwrap();
            assert!(lo <= got && got <= hi, "{name}");
        }
        if let Some(procs) = e["processes"].as_array() {
            let got = doc["processes"].as_array().unwrap();
            assert_eq!(got.len(), procs.len(), "{name}");
            for (g, p) in got.iter().zip(procs) {
                assert_eq!(g["pid"], p[0], "{name}");
                let (lo, hi) = interval(p[1].as_str().unwrap());
                assert_eq!(
                    (g["min"].as_u64().unwrap(), g["max"].as_u64().unwrap()),
                    (lo, hi)
                );
            }
        }
        if let Some(bytes) = e["tensor_bytes"].as_u64() {
            assert_eq!(doc["requested_bytes"], bytes, "{name}");
            assert_eq!(doc["tensor"]["dtype"], e["dtype"], "{name}");
            assert_eq!(doc["tensor"]["shape"], e["shape"], "{name}");
            if e["allocator"].is_string() {
                assert_eq!(doc["allocator"], e["allocator"], "{name}");
            }
        }
        if let Some(bytes) = e["requested_exact"].as_u64() {
            assert_eq!(doc["requested_bytes"], bytes, "{name}");
            assert_eq!(doc["bounds"]["requested_bytes"]["min"], bytes, "{name}");
            assert_eq!(doc["bounds"]["requested_bytes"]["max"], bytes, "{name}");
        }
        if e["capacty"].as_bool() == Some(true) {
            assert_eq!(doc["capacty_spelling"], true, "{name}");
        }
        assert_eq!(doc["cause"], m["cause"], "{name}: cause");
        if let Some(possible) = m["possible_causes"].as_array() {
            assert_eq!(
                doc["possible_causes"].as_array().unwrap(),
                possible,
                "{name}"
            );
        }
        // the shortfall, when the cause is capacity, is request − free − unallocated on the intervals
        if m["cause"] == "capacity" {
            let b = |f: &str, end: &str| doc["bounds"][f][end].as_u64().unwrap();
            let min = b("requested_bytes", "min")
                .saturating_sub(b("free_bytes", "max"))
                .saturating_sub(b("pytorch_reserved_unallocated_bytes", "max"))
                .max(1);
            let max = b("requested_bytes", "max")
                - b("free_bytes", "min")
                - b("pytorch_reserved_unallocated_bytes", "min");
            assert_eq!(b("shortfall_bytes", "min"), min, "{name}");
            assert_eq!(b("shortfall_bytes", "max"), max, "{name}");
        }
    }
    for f in [
        "pytorch<=1.3",
        "pytorch1.4-2.0",
        "ascend-npu",
        "pytorch>=2.1",
        "tensorflow",
        "xla",
    ] {
        assert!(formats.contains(f), "the corpus covers {f}");
    }
}

#[test]
fn a_replays_own_message_gives_the_replays_figures() {
    use vramsim_sim::rounding::{get_allocation_size, round_size};
    // GPT-2 at batch 64 on a 4 GiB device: the replay raises PyTorch's message
    let predict_args: vramsim_api::predict::PredictArgs = parse_args(
        "predict",
        &["--model=gpt2", "--batch=64", "--seq=512", "--capacity=4GiB"].map(String::from),
    )
    .unwrap();
    let predicted = vramsim_api::predict::predict(&predict_args).unwrap();
    let report = &predicted.report;
    let oom = report
        .outcome
        .oom
        .as_ref()
        .expect("the step runs out of memory");
    let doc = explain(&oom.message, &args()).unwrap().to_json();
    let inside = |field: &str, value: u64| {
        let b = &doc["bounds"][field];
        let (lo, hi) = (b["min"].as_u64().unwrap(), b["max"].as_u64().unwrap());
        assert!(
            lo <= value && value <= hi,
            "{field}: {value} not in {lo}..={hi}"
        );
    };
    let config = vramsim_sim::config::AllocatorConfig::default();
    let alloc_size = get_allocation_size(round_size(oom.requested_bytes, &config), &config);
    let stats = &report.outcome.stats;
    let allocated = stats.allocated_bytes.all.current as u64;
    let reserved = stats.reserved_bytes.all.current as u64;
    let device = &report.device;
    inside("requested_bytes", alloc_size);
    inside("capacity_bytes", device.total_memory);
    inside("free_bytes", device.free_memory(reserved));
    inside("pytorch_allocated_bytes", allocated);
    inside("pytorch_reserved_unallocated_bytes", reserved - allocated);
    inside("this_process_bytes", reserved + device.context_bytes);
    assert_eq!(doc["framework"], "pytorch");
}

#[test]
fn bad_input_says_what_was_not_found() {
    let err = |t: &str| format!("{:#}", explain(t, &args()).err().expect(t));
    let none = err("Traceback: ValueError: shapes do not match");
    assert!(none.contains("no out-of-memory message found"), "{none}");
    let missing = err("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 3.69 MiB is free.");
    assert!(
        missing.contains("Of the allocated memory")
            && missing.contains("reserved by PyTorch but unallocated"),
        "{missing}"
    );
    let old = err("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total capacity; 9.76 GiB already allocated)");
    assert!(
        old.contains("\"free\"") && old.contains("reserved in total by PyTorch"),
        "{old}"
    );
    let raw = err("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported");
    assert!(raw.contains("carries no figures"), "{raw}");
    let bare = format!("{:#}", explain("out of memory. Tried to allocate 2.00 MiB (GPU 0; 1.00 GiB total capacity; 0 bytes already allocated; 1.00 MiB free; 0 bytes reserved in total by PyTorch)", &args()).map(|e| e.to_json()["cause"].clone()).unwrap());
    assert_eq!(bare, "\"capacity\"");
    let tf = err("OOM when allocating tensor with shape[2,3] and type string on /device:GPU:0");
    assert!(tf.contains("string"), "{tf}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics(text in any::<String>()) {
        let _ = explain(&text, &args());
    }

    #[test]
    fn mutated_real_messages_never_panic(
        index in 0usize..34,
        cuts in proptest::collection::vec((any::<usize>(), any::<usize>(), ".{0,8}"), 1..6),
    ) {
        let messages = corpus();
        let mut text: Vec<char> = messages[index % messages.len()]["text"].as_str().unwrap().chars().collect();
        for (at, len, insert) in cuts {
            if text.is_empty() { break; }
            let at = at % text.len();
            let end = (at + len % 12).min(text.len());
            text.splice(at..end, insert.chars());
        }
        let text: String = text.into_iter().collect();
        let _ = explain(&text, &args());
    }
}
