//! The snapshot model on hand-made inputs: the key sets of older and newer PyTorch versions, the
//! list-of-segments format, JSON, unknown actions and keys, and errors that name the offending path.

use std::io::Write;

use vramsim_traces::pickle::{self, Value};
use vramsim_traces::snapshot::{
    self, load_snapshot_file, write_snapshot_file, Action, BlockState, SegmentType, Snapshot,
    SnapshotError,
};

fn s(x: &str) -> Value {
    Value::str(x)
}

fn d(entries: Vec<(&str, Value)>) -> Value {
    Value::dict(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn int(n: i64) -> Value {
    Value::Int(n)
}

/// A segment as PyTorch 2.x writes it, two blocks.
fn segment() -> Value {
    d(vec![
        ("device", int(0)),
        ("address", int(1 << 40)),
        ("total_size", int(2 << 20)),
        ("allocated_size", int(512)),
        ("active_size", int(512)),
        ("requested_size", int(500)),
        ("stream", int(0)),
        ("segment_type", s("small")),
        ("segment_pool_id", Value::tuple(vec![int(0), int(0)])),
        ("is_expandable", Value::Bool(false)),
        ("frames", Value::list(vec![])),
        (
            "blocks",
            Value::list(vec![
                d(vec![
                    ("address", int(1 << 40)),
                    ("size", int(512)),
                    ("requested_size", int(500)),
                    ("state", s("active_allocated")),
                    ("frames", Value::list(vec![])),
                ]),
                d(vec![
                    ("address", int((1 << 40) + 512)),
                    ("size", int((2 << 20) - 512)),
                    ("requested_size", int(0)),
                    ("state", s("inactive")),
                    ("frames", Value::list(vec![])),
                ]),
            ]),
        ),
    ])
}

fn entry(action: &str, addr: i64, size: i64) -> Value {
    d(vec![
        ("action", s(action)),
        ("addr", int(addr)),
        ("size", int(size)),
        ("stream", int(0)),
        ("time_us", int(1_700_000_000_000_000)),
    ])
}

fn shape_error(v: &Value) -> (String, String) {
    match Snapshot::from_value(v) {
        Err(SnapshotError::Shape { at, message }) => (at, message),
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn a_full_snapshot_reads_into_the_typed_model() {
    let oom = d(vec![
        ("action", s("oom")),
        ("device_free", int(95 << 20)),
        ("size", int(5 << 30)),
        ("stream", int(0)),
        ("time_us", int(1)),
        ("compile_context", s("N/A")),
    ]);
    let v = d(vec![
        ("segments", Value::list(vec![segment()])),
        (
            "device_traces",
            Value::list(vec![
                Value::list(vec![
                    entry("segment_alloc", 1 << 40, 2 << 20),
                    entry("alloc", 1 << 40, 500),
                    oom,
                ]),
                Value::list(vec![]),
            ]),
        ),
        (
            "allocator_settings",
            d(vec![
                ("PYTORCH_CUDA_ALLOC_CONF", s("expandable_segments:True")),
                ("max_split_size", int(-1)),
                ("garbage_collection_threshold", Value::Float(0.0)),
                ("expandable_segments", Value::Bool(true)),
                (
                    "roundup_power2_divisions",
                    d(vec![("1", int(0)), ("2", int(4))]),
                ),
            ]),
        ),
        (
            "external_annotations",
            Value::list(vec![d(vec![
                ("stage", s("START")),
                ("name", s("step")),
                ("device", int(0)),
                ("time_us", int(5)),
            ])]),
        ),
    ]);
    let snap = Snapshot::from_value(&v).unwrap();
    let seg = &snap.segments[0];
    assert_eq!(
        (
            seg.address,
            seg.total_size,
            seg.segment_type,
            seg.segment_pool_id
        ),
        (1 << 40, 2 << 20, SegmentType::Small, (0, 0))
    );
    assert_eq!(seg.blocks[1].state, BlockState::Inactive);
    assert_eq!(snap.device_traces.len(), 2);
    let oom = &snap.device_traces[0][2];
    assert_eq!(
        (
            &oom.action,
            oom.addr,
            oom.size,
            oom.compile_context.as_deref()
        ),
        (&Action::Oom, 95 << 20, 5 << 30, Some("N/A"))
    );
    let settings = snap.allocator_settings.as_ref().unwrap();
    assert_eq!(settings.max_split_size, Some(-1));
    assert_eq!(
        settings.roundup_power2_divisions,
        Some(vec![(1, 0), (2, 4)])
    );
    assert_eq!(settings.graph_capture_record_stream_reuse, None);
    assert_eq!(snap.external_annotations.as_ref().map(Vec::len), Some(1));
    // the export writes `device_free` for the oom, `frames: []` everywhere, and reads back equal
    let exported = snap.to_value();
    let oom_out = &exported.get("device_traces").unwrap().as_list().unwrap()[0]
        .as_list()
        .unwrap()[2];
    assert_eq!(oom_out.get("device_free"), Some(&int(95 << 20)));
    assert_eq!(oom_out.get("addr"), None);
    assert_eq!(oom_out.get("frames"), Some(&Value::list(vec![])));
    assert_eq!(Snapshot::from_value(&exported).unwrap(), snap);
}

#[test]
fn keys_missing_in_older_pytorch_get_pytorchs_values() {
    // PyTorch 1.x/2.0 style: no requested_size/pool id/is_expandable, blocks without addresses,
    // requested size only in the block history, trace entries without time_us
    let v = d(vec![
        (
            "segments",
            Value::list(vec![d(vec![
                ("address", int(4096)),
                ("total_size", int(20 << 20)),
                (
                    "blocks",
                    Value::list(vec![
                        d(vec![
                            ("size", int(1 << 20)),
                            ("state", s("active_allocated")),
                            (
                                "history",
                                Value::list(vec![d(vec![
                                    ("addr", int(4096)),
                                    ("real_size", int(1000)),
                                    ("frames", Value::list(vec![])),
                                ])]),
                            ),
                        ]),
                        d(vec![
                            ("size", int(2 << 20)),
                            ("state", s("active_pending_free")),
                        ]),
                        d(vec![("size", int(17 << 20)), ("state", s("inactive"))]),
                    ]),
                ),
            ])]),
        ),
        (
            "device_traces",
            Value::list(vec![Value::list(vec![d(vec![
                ("action", s("alloc")),
                ("addr", int(4096)),
                ("size", int(1000)),
            ])])]),
        ),
    ]);
    let snap = Snapshot::from_value(&v).unwrap();
    let seg = &snap.segments[0];
    assert_eq!(
        (seg.device, seg.stream, seg.segment_type, seg.is_expandable),
        (0, 0, SegmentType::Large, false)
    );
    let addresses: Vec<u64> = seg.blocks.iter().map(|b| b.address).collect();
    assert_eq!(addresses, [4096, 4096 + (1 << 20), 4096 + (3 << 20)]);
    assert_eq!(seg.blocks[0].requested_size, 1000);
    assert_eq!(seg.blocks[1].requested_size, 2 << 20);
    assert_eq!(
        (seg.allocated_size, seg.active_size, seg.requested_size),
        (1 << 20, 3 << 20, 1000 + (2 << 20))
    );
    assert!(
        seg.blocks[0].extra.is_empty(),
        "history is dropped, not kept"
    );
    let e = &snap.device_traces[0][0];
    assert_eq!(
        (e.stream, e.time_us, e.compile_context.as_ref()),
        (0, None, None)
    );
    assert_eq!(snap.allocator_settings, None);
    assert_eq!(Snapshot::from_value(&snap.to_value()).unwrap(), snap);
}

#[test]
fn unknown_actions_and_keys_are_kept() {
    let mut annotate = entry("annotate", 0, 0);
    if let Value::Dict(entries) = &mut annotate {
        std::sync::Arc::make_mut(entries).push((s("pool_id"), Value::tuple(vec![int(1), int(2)])));
    }
    let v = d(vec![
        ("segments", Value::list(vec![])),
        (
            "device_traces",
            Value::list(vec![Value::list(vec![annotate])]),
        ),
        ("host_segments", Value::list(vec![])),
    ]);
    let snap = Snapshot::from_value(&v).unwrap();
    let e = &snap.device_traces[0][0];
    assert_eq!(e.action, Action::Other("annotate".into()));
    assert_eq!(
        e.extra,
        vec![("pool_id".to_string(), Value::tuple(vec![int(1), int(2)]))]
    );
    assert_eq!(
        snap.extra,
        vec![("host_segments".to_string(), Value::list(vec![]))]
    );
    let out = snap.to_value();
    assert_eq!(out.get("host_segments"), Some(&Value::list(vec![])));
    assert_eq!(Snapshot::from_value(&out).unwrap(), snap);
    for name in [
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "snapshot",
        "oom",
        "annotate",
    ] {
        assert_eq!(Action::from_name(name).as_str(), name);
    }
}

#[test]
fn the_list_of_segments_format_gives_empty_traces() {
    let list = Value::list(vec![segment(), segment()]);
    let snap = Snapshot::from_value(&list).unwrap();
    assert_eq!(snap.segments.len(), 2);
    assert!(snap.device_traces.is_empty() && snap.allocator_settings.is_none());
    // as a pickle, and as JSON (plain and gzipped) through the byte sniffing of `decode_bytes`
    assert_eq!(Snapshot::from_bytes(&pickle::to_vec(&list)).unwrap(), snap);
    let json = r#" [{"device": 0, "address": 1099511627776, "total_size": 2097152, "stream": 0,
        "segment_type": "small", "segment_pool_id": [0, 0], "blocks": [
        {"address": 1099511627776, "size": 512, "requested_size": 500, "state": "active_allocated"},
        {"size": 2096640, "requested_size": 0, "state": "inactive"}]}]"#;
    let from_json = Snapshot::from_bytes(json.as_bytes()).unwrap();
    assert_eq!(from_json.segments[0].blocks, snap.segments[0].blocks);
    assert_eq!(
        (
            from_json.segments[0].allocated_size,
            from_json.segments[0].requested_size
        ),
        (512, 500)
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(json.as_bytes()).unwrap();
    assert_eq!(
        Snapshot::from_bytes(&gz.finish().unwrap()).unwrap(),
        from_json
    );
}

#[test]
fn shape_errors_name_the_path() {
    let bad_size = d(vec![
        ("action", s("alloc")),
        ("addr", int(0)),
        ("size", s("12")),
        ("stream", int(0)),
    ]);
    let traces = |e: Value| Value::list(vec![Value::list(vec![entry("alloc", 1, 2), e])]);
    let cases: Vec<(Value, &str, &str)> = vec![
        (d(vec![("segments", Value::list(vec![])), ("device_traces", traces(bad_size))]), "device_traces[0][1].size", "expected int, got str"),
        (d(vec![("segments", Value::list(vec![])), ("device_traces", traces(d(vec![("action", s("alloc")), ("size", int(1))])))]), "device_traces[0][1]", "missing key 'addr'"),
        (d(vec![("segments", Value::list(vec![])), ("device_traces", traces(d(vec![("action", s("oom")), ("size", int(1))])))]), "device_traces[0][1]", "missing key 'device_free'"),
        (d(vec![("segments", Value::list(vec![])), ("device_traces", traces(entry("free_completed", -5, 1)))]), "device_traces[0][1].addr", "expected a non-negative int, got -5"),
        (d(vec![("device_traces", Value::list(vec![]))]), "(top level)", "missing key 'segments'"),
        (int(3), "(top level)", "expected a snapshot dict or a list of segments, got int"),
        (Value::list(vec![segment(), d(vec![("address", int(0)), ("blocks", Value::list(vec![]))])]), "[1]", "missing key 'total_size'"),
        (
            d(vec![("segments", Value::list(vec![d(vec![("address", int(0)), ("total_size", int(1)), ("blocks", Value::list(vec![d(vec![("size", int(1)), ("state", s("active_awaiting_free"))])]))])]))]),
            "segments[0].blocks[0].state",
            "expected 'active_allocated', 'active_pending_free' or 'inactive', got 'active_awaiting_free'",
        ),
        (
            d(vec![("segments", Value::list(vec![d(vec![("address", int(0)), ("total_size", int(1)), ("segment_pool_id", Value::tuple(vec![int(0)])), ("blocks", Value::list(vec![]))])]))]),
            "segments[0].segment_pool_id",
            "expected a pair of ints, got 1 items",
        ),
        (
            d(vec![("segments", Value::list(vec![])), ("allocator_settings", d(vec![("roundup_power2_divisions", d(vec![("1", int(0)), ("2", s("x"))]))]))]),
            "allocator_settings.roundup_power2_divisions.2",
            "expected int, got str",
        ),
        (d(vec![("segments", Value::list(vec![])), ("device_traces", Value::list(vec![Value::list(vec![Value::dict(vec![(int(1), int(2))])])]))]), "device_traces[0][0]", "expected str keys, found the int key 1"),
        (d(vec![("segments", Value::list(vec![d(vec![("address", Value::from(u64::MAX)), ("total_size", Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 1].into())), ("blocks", Value::list(vec![]))])]))]), "segments[0].total_size", "expected an int of at most 64 bits, got a larger int"),
    ];
    for (v, at, message) in &cases {
        let (got_at, got_message) = shape_error(v);
        assert_eq!((got_at.as_str(), got_message.as_str()), (*at, *message));
    }
    let err = Snapshot::from_value(&cases[0].0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "device_traces[0][1].size: expected int, got str"
    );
}

#[test]
fn files_round_trip_and_file_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("vramsim-snapshot-shapes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snap = Snapshot::from_value(&d(vec![
        ("segments", Value::list(vec![segment()])),
        (
            "device_traces",
            Value::list(vec![Value::list(vec![entry("alloc", 1 << 40, 500)])]),
        ),
    ]))
    .unwrap();
    for name in ["out.pickle", "out.pickle.gz"] {
        let path = dir.join(name);
        write_snapshot_file(&path, &snap).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            bytes.starts_with(&[0x1f, 0x8b]),
            name.ends_with(".gz"),
            "{name}"
        );
        assert_eq!(load_snapshot_file(&path).unwrap(), snap, "{name}");
    }
    let garbage = dir.join("garbage.pickle");
    std::fs::write(&garbage, b"\x80\x04\x8c\x05ab").unwrap();
    let err = load_snapshot_file(&garbage).unwrap_err().to_string();
    assert!(err.starts_with(&garbage.display().to_string()), "{err}");
    assert!(
        err.contains(
            "pickle error at byte 2: truncated stream: SHORT_BINUNICODE needs 5 more bytes, 2 left"
        ),
        "{err}"
    );
    let wrong_shape = dir.join("list.pickle");
    std::fs::write(&wrong_shape, pickle::to_vec(&Value::list(vec![int(1)]))).unwrap();
    let err = load_snapshot_file(&wrong_shape).unwrap_err().to_string();
    assert!(
        err.ends_with("list.pickle: [0]: expected dict, got int"),
        "{err}"
    );
    let missing = dir.join("missing.pickle");
    let err = snapshot::load_value_file(&missing).unwrap_err().to_string();
    assert!(err.starts_with(&missing.display().to_string()), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
