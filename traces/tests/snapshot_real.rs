//! The 17 real snapshots in `testdata/snapshots/` (recorded on GPUs by other people), checked against
//! `index.json`, the independent summary Python derived from the same files; against the sums of §8.4;
//! and through export and re-import. A missing file fails the test.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use vramsim_traces::pickle;
use vramsim_traces::snapshot::{load_snapshot_file, Action, Snapshot, TraceEntry};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/snapshots");

/// `index.json`'s entries (the test fails if the file is missing).
fn index() -> Vec<serde_json::Value> {
    let path = Path::new(DIR).join("index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{} is missing ({e}): the test data is not there",
            path.display()
        )
    });
    let entries: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    assert_eq!(entries.len(), 17, "index.json lists the 17 snapshots");
    entries
}

fn file_of(entry: &serde_json::Value) -> PathBuf {
    Path::new(DIR).join(entry["file"].as_str().unwrap())
}

/// Every snapshot, loaded, with its index entry.
fn all() -> Vec<(serde_json::Value, Snapshot)> {
    index()
        .into_iter()
        .map(|e| {
            let snap = load_snapshot_file(file_of(&e)).unwrap_or_else(|err| panic!("{err}"));
            (e, snap)
        })
        .collect()
}

/// The keys a trace entry had in the file, `frames` left out (what `index.json`'s `event_keys` lists
/// for each file's first entry).
fn keys_of(e: &TraceEntry) -> Vec<String> {
    let mut keys = vec![
        "action",
        if e.action == Action::Oom {
            "device_free"
        } else {
            "addr"
        },
        "size",
        "stream",
    ];
    if e.time_us.is_some() {
        keys.push("time_us");
    }
    if e.compile_context.is_some() {
        keys.push("compile_context");
    }
    if e.user_metadata.is_some() {
        keys.push("user_metadata");
    }
    let mut keys: Vec<String> = keys.into_iter().map(String::from).collect();
    keys.extend(e.extra.iter().map(|(k, _)| k.clone()));
    keys.sort();
    keys
}

#[test]
fn every_snapshot_matches_its_index_entry() {
    let all = all();
    for (entry, snap) in &all {
        let name = entry["file"].as_str().unwrap();
        let want = |key: &str| &entry[key];
        assert_eq!(want("format"), "dict", "{name}");
        assert_eq!(
            snap.segments.len() as u64,
            want("n_segments").as_u64().unwrap(),
            "{name}: segments"
        );

        let mut devices: Vec<u64> = snap.segments.iter().map(|s| u64::from(s.device)).collect();
        devices.sort();
        devices.dedup();
        let want_devices: Vec<u64> = want("devices")
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(devices, want_devices, "{name}: devices");

        let events: Vec<&TraceEntry> = snap.device_traces.iter().flatten().collect();
        assert_eq!(
            events.len() as u64,
            want("trace_events").as_u64().unwrap(),
            "{name}: trace events"
        );
        let mut actions: BTreeMap<String, u64> = BTreeMap::new();
        for e in &events {
            *actions.entry(e.action.as_str().to_string()).or_default() += 1;
        }
        let want_actions: BTreeMap<String, u64> = want("actions")
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        assert_eq!(actions, want_actions, "{name}: events per action");

        let want_keys: Vec<String> = want("event_keys")
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            keys_of(events[0]),
            want_keys,
            "{name}: keys of the first trace entry"
        );

        let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
        let reserved: u64 = snap.segments.iter().map(|s| s.total_size).sum();
        let allocated: u64 = snap.segments.iter().map(|s| s.allocated_size).sum();
        assert!(
            (mib(reserved) - want("reserved_MiB").as_f64().unwrap()).abs() <= 0.05 + 1e-9,
            "{name}: reserved"
        );
        assert!(
            (mib(allocated) - want("allocated_MiB").as_f64().unwrap()).abs() <= 0.05 + 1e-9,
            "{name}: allocated"
        );

        let settings = snap.allocator_settings.as_ref();
        assert_eq!(
            settings.is_some(),
            want("has_allocator_settings").as_bool().unwrap(),
            "{name}: settings"
        );
        assert_eq!(
            settings.and_then(|s| s.expandable_segments),
            want("expandable").as_bool(),
            "{name}: expandable"
        );
        assert_eq!(
            settings.and_then(|s| s.pytorch_cuda_alloc_conf.as_deref()),
            want("alloc_conf").as_str(),
            "{name}: PYTORCH_CUDA_ALLOC_CONF"
        );
    }
}

#[test]
fn uncompressed_pickles_have_the_recorded_length() {
    let entries = index();
    for entry in &entries {
        let gz = std::fs::read(file_of(entry)).unwrap();
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut plain)
            .unwrap();
        assert_eq!(
            plain.len() as u64,
            entry["bytes"].as_u64().unwrap(),
            "{}",
            entry["file"]
        );
    }
}

/// §8.4 and §10.2: a segment's sizes are sums over its blocks; blocks tile the segment in address
/// order; segments are sorted by address within a device.
#[test]
fn segment_sizes_are_sums_over_their_blocks() {
    let all = all();
    for (entry, snap) in &all {
        let name = entry["file"].as_str().unwrap();
        for (i, seg) in snap.segments.iter().enumerate() {
            let sums = seg.sums_from_blocks();
            assert_eq!(
                sums.allocated_size, seg.allocated_size,
                "{name} segments[{i}].allocated_size"
            );
            assert_eq!(
                sums.active_size, seg.active_size,
                "{name} segments[{i}].active_size"
            );
            assert_eq!(
                sums.requested_size, seg.requested_size,
                "{name} segments[{i}].requested_size"
            );
            assert_eq!(
                sums.total_size, seg.total_size,
                "{name} segments[{i}].total_size"
            );
            let mut addr = seg.address;
            for (j, b) in seg.blocks.iter().enumerate() {
                assert_eq!(b.address, addr, "{name} segments[{i}].blocks[{j}].address");
                addr += b.size;
            }
        }
        for pair in snap.segments.windows(2) {
            if pair[0].device == pair[1].device {
                assert!(
                    pair[0].address < pair[1].address,
                    "{name}: segments sorted by address"
                );
            }
        }
    }
}

#[test]
fn export_then_reimport_is_identity() {
    let all = all();
    for (entry, snap) in &all {
        let name = entry["file"].as_str().unwrap();
        assert_eq!(
            &Snapshot::from_value(&snap.to_value()).unwrap(),
            snap,
            "{name}: through Value"
        );
        let bytes = snap.to_pickle();
        let back = Snapshot::from_value(&pickle::from_slice(&bytes).unwrap()).unwrap();
        assert_eq!(&back, snap, "{name}: through the pickle");
    }
}

/// CPython loads every export and finds the original snapshot, stacks aside (we write `frames: []`);
/// the export uses only opcodes `MemoryViz.js`'s unpickler knows; and it has the keys
/// `_memory_viz.py` and `MemoryViz.js` read.
#[test]
fn exports_load_in_cpython_as_the_original_without_stacks() {
    let all = all();
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipping: python3 is not available");
        return;
    }
    let dir = std::env::temp_dir().join(format!("vramsim-snapshot-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut pairs = Vec::new();
    for (entry, snap) in &all {
        let out = dir.join(format!("{}.pickle", pairs.len()));
        std::fs::write(&out, snap.to_pickle()).unwrap();
        pairs.push(serde_json::json!([file_of(entry), out]));
    }
    let script = r#"
import gzip, json, pickle, pickletools, sys
MEMORYVIZ_OPS = {'PROTO', 'APPEND', 'APPENDS', 'LIST', 'TUPLE', 'NEWFALSE', 'NEWTRUE', 'NONE', 'BINGET',
    'BININT', 'BININT1', 'BININT2', 'EMPTY_DICT', 'EMPTY_LIST', 'FRAME', 'LONG1', 'LONG_BINGET', 'MARK',
    'MEMOIZE', 'BINPUT', 'LONG_BINPUT', 'SETITEMS', 'SETITEM', 'DICT', 'SHORT_BINUNICODE', 'BINUNICODE',
    'STOP', 'EMPTY_TUPLE', 'TUPLE1', 'TUPLE2', 'TUPLE3', 'BINFLOAT'}
def strip(o):
    if isinstance(o, dict): return {k: strip(v) for k, v in o.items() if k != 'frames'}
    if isinstance(o, list): return [strip(x) for x in o]
    if isinstance(o, tuple): return tuple(strip(x) for x in o)
    return o
for original, ours in json.load(sys.stdin):
    data = open(ours, 'rb').read()
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert ops <= MEMORYVIZ_OPS, (ours, ops - MEMORYVIZ_OPS)
    mine = pickle.loads(data)
    theirs = pickle.load(gzip.open(original))
    assert strip(mine) == strip(theirs), original
    for seg in mine['segments']:
        assert seg['frames'] == []
        for b in seg['blocks']:
            assert b['frames'] == [] and 'requested_size' in b and 'address' in b
    for trace in mine['device_traces']:
        for e in trace:
            assert e['frames'] == [] and ('device_free' in e if e['action'] == 'oom' else 'addr' in e)
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        &mut child.stdin.take().unwrap(),
        serde_json::to_string(&pairs).unwrap().as_bytes(),
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Not an assertion: how long a full load of the largest snapshot takes, best of 5 (run with
/// `--release --nocapture` for numbers worth quoting).
#[test]
fn time_to_load_the_largest_snapshot() {
    let entries = index();
    let largest = entries
        .iter()
        .max_by_key(|e| e["bytes"].as_u64().unwrap())
        .unwrap();
    let path = file_of(largest);
    let best = |f: &mut dyn FnMut()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::MAX, f64::min)
    };
    let gz = std::fs::read(&path).unwrap();
    let mut plain = Vec::new();
    let t_gunzip = best(&mut || {
        plain.clear();
        flate2::read::MultiGzDecoder::new(&gz[..])
            .read_to_end(&mut plain)
            .unwrap();
    });
    let t_unpickle = best(&mut || drop(pickle::from_slice(&plain).unwrap()));
    let value = pickle::from_slice(&plain).unwrap();
    let t_model = best(&mut || drop(Snapshot::from_value(&value).unwrap()));
    let snap = Snapshot::from_value(&value).unwrap();
    drop(value);
    let t_total = best(&mut || drop(load_snapshot_file(&path).unwrap()));
    let mut exported = Vec::new();
    let t_export = best(&mut || exported = snap.to_pickle());
    let mode = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    println!(
        "{} ({:.2} MB of pickle, {} trace entries), {mode} build, best of 5: load_snapshot_file \
         {t_total:.1} ms (gunzip {t_gunzip:.1} ms, unpickle incl. drop {t_unpickle:.1} ms, typed \
         model {t_model:.1} ms); export {t_export:.1} ms to a {:.2} MB pickle",
        largest["file"].as_str().unwrap(),
        plain.len() as f64 / 1e6,
        snap.device_traces.iter().map(Vec::len).sum::<usize>(),
        exported.len() as f64 / 1e6,
    );
}
