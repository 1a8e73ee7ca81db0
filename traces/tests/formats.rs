//! Reading and writing both formats: fixtures, format detection, gzip, and round trips of random traces.

use std::io::{Cursor, Read, Write};
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use serde_json::{json, Value};
use vramsim_traces::{
    open_events, open_events_from, parse_json, read_json, read_jsonl, read_trace, read_trace_from,
    write_json, write_jsonl, write_trace, AllocId, Category, Event, Format, JsonlReader,
    JsonlWriter, Meta, Trace, TraceError,
};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A scratch directory for one test, emptied first.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("vramsim-traces-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn alloc(id: impl Into<AllocId>, size: u64, stream: u64, category: Category) -> Event {
    Event::Alloc {
        id: id.into(),
        size,
        stream,
        category,
        tag: None,
    }
}

fn free(id: impl Into<AllocId>) -> Event {
    Event::Free { id: id.into() }
}

/// The events of every `small.*` fixture.
fn small_events() -> Vec<Event> {
    vec![
        Event::Phase {
            name: "forward".into(),
        },
        Event::Alloc {
            id: AllocId::Int(1),
            size: 4096,
            stream: 0,
            category: Category::Parameter,
            tag: Some("fc1.weight".into()),
        },
        alloc("fc1.out", 1 << 20, 0, Category::Activation),
        Event::RecordStream {
            id: "fc1.out".into(),
            stream: 7,
        },
        Event::Compute {
            stream: 7,
            us: 12.5,
        },
        Event::Sync { stream: Some(7) },
        Event::Phase {
            name: "backward".into(),
        },
        free("fc1.out"),
        // 2^60 bytes: legal input, PyTorch answers it with "more than 1EB".
        alloc(2, 1 << 60, 0, Category::Temporary),
        free(2),
        Event::Compute { stream: 0, us: 3.0 },
        Event::Sync { stream: None },
        Event::EmptyCache,
        free(1),
    ]
}

fn small_meta() -> Meta {
    match json!({"model": "tiny-mlp", "batch": 8, "recorded_by": "hand"}) {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

#[test]
fn every_fixture_reads_as_the_same_trace() {
    let with_meta = Trace {
        meta: small_meta(),
        events: small_events(),
    };
    for (name, format, compressed) in [
        ("small.jsonl", Format::JsonLines, false),
        ("small.json", Format::Json, false),
        ("small.jsonl.gz", Format::JsonLines, true),
        ("small.json.gz", Format::Json, true),
        ("gzip_without_gz_extension.trace", Format::JsonLines, true),
        ("two_members.jsonl.gz", Format::JsonLines, true),
    ] {
        let trace = read_trace(data(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(trace, with_meta, "{name}");
        let stream = open_events(data(name)).unwrap();
        assert_eq!(stream.format(), format, "{name}");
        assert_eq!(stream.is_compressed(), compressed, "{name}");
        assert_eq!(stream.meta(), &small_meta(), "{name}");
    }
    // The header is optional.
    assert_eq!(
        read_trace(data("no_header.jsonl")).unwrap(),
        Trace::from_events(small_events())
    );
}

#[test]
fn open_events_streams_json_lines_and_gives_meta_first() {
    let mut events = open_events(data("small.jsonl")).unwrap();
    assert_eq!(events.meta()["model"], "tiny-mlp");
    assert_eq!(events.format(), Format::JsonLines);
    assert_eq!(
        events.next().unwrap().unwrap(),
        Event::Phase {
            name: "forward".into()
        }
    );
    assert_eq!(events.count(), small_events().len() - 1);
}

#[test]
fn header_optional_blank_lines_crlf_and_bom() {
    let expected = vec![alloc(1, 10, 0, Category::Other), free(1)];
    for text in [
        "{\"op\":\"alloc\",\"id\":1,\"size\":10}\n{\"op\":\"free\",\"id\":1}\n",
        "{\"op\":\"alloc\",\"id\":1,\"size\":10}\n{\"op\":\"free\",\"id\":1}",
        "\n\n  \n{\"op\":\"alloc\",\"id\":1,\"size\":10}\n\n\t\n{\"op\":\"free\",\"id\":1}\n\n",
        "{\"op\":\"alloc\",\"id\":1,\"size\":10}\r\n\r\n{\"op\":\"free\",\"id\":1}\r\n",
        "\u{feff}{\"op\":\"alloc\",\"id\":1,\"size\":10}\n{\"op\":\"free\",\"id\":1}\n",
        "\u{feff}{\"format\":\"vramsim-trace\",\"version\":1}\n{\"op\":\"alloc\",\"id\":1,\"size\":10}\n{\"op\":\"free\",\"id\":1}\n",
        "  {\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{}}  \n  {\"op\":\"alloc\" , \"id\" : 1 , \"size\":10 }\n{\"op\":\"free\",\"id\":1}",
    ] {
        let trace = read_jsonl(text.as_bytes()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(trace.events, expected, "{text:?}");
        assert!(trace.meta.is_empty());
        let detected = read_trace_from(Cursor::new(text.as_bytes().to_vec())).unwrap();
        assert_eq!(detected.events, expected, "{text:?}");
    }
}

#[test]
fn a_header_with_no_events_is_an_empty_trace() {
    let text = "{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{\"a\":1}}\n";
    let reader = JsonlReader::new(text.as_bytes()).unwrap();
    assert!(reader.has_header());
    assert_eq!(reader.meta()["a"], 1);
    assert_eq!(reader.count(), 0);
    let doc = "{\"format\":\"vramsim-trace\",\"version\":1,\"events\":[]}";
    assert_eq!(parse_json(doc.as_bytes()).unwrap(), Trace::default());
}

#[test]
fn defaults_and_nulls() {
    let text = r#"
{"op":"alloc","id":1,"size":0}
{"op":"alloc","id":2,"size":5,"stream":null,"category":null,"tag":null}
{"op":"compute","us":0.25}
{"op":"sync","stream":null}
{"op":"sync","stream":0}
"#;
    let trace = read_jsonl(text.as_bytes()).unwrap();
    assert_eq!(
        trace.events,
        vec![
            alloc(1, 0, 0, Category::Other),
            alloc(2, 5, 0, Category::Other),
            Event::Compute {
                stream: 0,
                us: 0.25
            },
            Event::Sync { stream: None },
            Event::Sync { stream: Some(0) },
        ]
    );
}

#[test]
fn keys_in_any_order() {
    let pairs = [
        r#""op":"alloc""#,
        r#""id":"x""#,
        r#""size":12"#,
        r#""stream":3"#,
        r#""category":"workspace""#,
        r#""tag":"t""#,
    ];
    let expected = Event::Alloc {
        id: "x".into(),
        size: 12,
        stream: 3,
        category: Category::Workspace,
        tag: Some("t".into()),
    };
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    let mut count = 0;
    // Every permutation (Heap's algorithm, iteratively).
    let mut c = vec![0; order.len()];
    let mut check = |order: &[usize]| {
        let line = format!(
            "{{{}}}",
            order
                .iter()
                .map(|&i| pairs[i])
                .collect::<Vec<_>>()
                .join(",")
        );
        let event: Vec<Event> = JsonlReader::new(line.as_bytes())
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(event, vec![expected.clone()], "{line}");
        count += 1;
    };
    check(&order);
    let mut i = 0;
    while i < order.len() {
        if c[i] < i {
            if i % 2 == 0 {
                order.swap(0, i);
            } else {
                order.swap(c[i], i);
            }
            check(&order);
            c[i] += 1;
            i = 0;
        } else {
            c[i] = 0;
            i += 1;
        }
    }
    assert_eq!(count, 720);
}

#[test]
fn string_and_integer_ids_are_distinct() {
    let text = "{\"op\":\"alloc\",\"id\":7,\"size\":1}\n{\"op\":\"alloc\",\"id\":\"7\",\"size\":1}\n{\"op\":\"free\",\"id\":18446744073709551615}\n{\"op\":\"free\",\"id\":\"caf\\u00e9 \\\"q\\\"\"}\n";
    let trace = read_jsonl(text.as_bytes()).unwrap();
    assert_eq!(
        trace.events,
        vec![
            alloc(7, 1, 0, Category::Other),
            alloc("7", 1, 0, Category::Other),
            free(u64::MAX),
            free("café \"q\""),
        ]
    );
}

#[test]
fn every_category_name_reads_back() {
    for category in Category::ALL {
        let line = format!(
            "{{\"op\":\"alloc\",\"id\":1,\"size\":1,\"category\":\"{}\"}}",
            category.name()
        );
        let trace = read_jsonl(line.as_bytes()).unwrap();
        assert_eq!(trace.events, vec![alloc(1, 1, 0, category)]);
    }
}

#[test]
fn writers_produce_the_documented_text() {
    let trace = Trace {
        meta: small_meta(),
        events: vec![
            Event::Alloc {
                id: 1.into(),
                size: 4096,
                stream: 0,
                category: Category::Activation,
                tag: Some("x".into()),
            },
            Event::Sync { stream: None },
            Event::Compute { stream: 1, us: 2.0 },
            free(1),
        ],
    };
    let mut lines = Vec::new();
    write_jsonl(&mut lines, &trace).unwrap();
    assert_eq!(
        String::from_utf8(lines).unwrap(),
        r#"{"format":"vramsim-trace","version":1,"meta":{"batch":8,"model":"tiny-mlp","recorded_by":"hand"}}
{"op":"alloc","id":1,"size":4096,"stream":0,"category":"activation","tag":"x"}
{"op":"sync"}
{"op":"compute","stream":1,"us":2.0}
{"op":"free","id":1}
"#
    );
    let mut doc = Vec::new();
    write_json(&mut doc, &trace).unwrap();
    assert_eq!(
        String::from_utf8(doc).unwrap(),
        r#"{"format":"vramsim-trace","version":1,"meta":{"batch":8,"model":"tiny-mlp","recorded_by":"hand"},"events":[
{"op":"alloc","id":1,"size":4096,"stream":0,"category":"activation","tag":"x"},
{"op":"sync"},
{"op":"compute","stream":1,"us":2.0},
{"op":"free","id":1}
]}
"#
    );
    let mut empty = Vec::new();
    write_json(&mut empty, &Trace::default()).unwrap();
    assert_eq!(
        String::from_utf8(empty.clone()).unwrap(),
        "{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{},\"events\":[\n]}\n"
    );
    assert_eq!(read_json(&empty[..]).unwrap(), Trace::default());
}

#[test]
fn jsonl_writer_with_and_without_header() {
    let mut w = JsonlWriter::without_header(Vec::new());
    w.write_event(&free("a")).unwrap();
    assert_eq!(w.finish().unwrap(), b"{\"op\":\"free\",\"id\":\"a\"}\n");
}

#[test]
fn write_trace_picks_format_and_compression_from_the_name() {
    let dir = scratch("write_trace");
    let trace = Trace {
        meta: small_meta(),
        events: small_events(),
    };
    for (name, format, gzip) in [
        ("t.json", Format::Json, false),
        ("t.jsonl", Format::JsonLines, false),
        ("t.ndjson", Format::JsonLines, false),
        ("t.JSONL.GZ", Format::JsonLines, true),
        ("t.json.gz", Format::Json, true),
        ("t.trace", Format::Json, false),
    ] {
        let path = dir.join(name);
        assert_eq!(Format::for_path(&path), format, "{name}");
        write_trace(&path, &trace).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.starts_with(&[0x1f, 0x8b]), gzip, "{name}");
        let stream = open_events(&path).unwrap();
        assert_eq!(stream.format(), format, "{name}");
        assert_eq!(stream.is_compressed(), gzip, "{name}");
        assert_eq!(stream.into_trace().unwrap(), trace, "{name}");
    }
}

#[test]
fn events_serialize_with_serde() {
    for event in small_events() {
        let text = serde_json::to_string(&event).unwrap();
        assert_eq!(serde_json::from_str::<Event>(&text).unwrap(), event);
    }
    let err = serde_json::from_str::<Event>(r#"{"op":"alloc","id":1,"size":-1}"#).unwrap_err();
    assert!(err.to_string().contains("`size` is negative"), "{err}");
    assert_eq!(
        serde_json::to_string(&Category::OptimizerState).unwrap(),
        "\"optimizer_state\""
    );
    assert_eq!(
        serde_json::from_str::<AllocId>("\"x\"").unwrap(),
        AllocId::from("x")
    );
}

#[test]
fn gzip_read_from_a_reader() {
    let mut gz = Vec::new();
    std::fs::File::open(data("small.jsonl.gz"))
        .unwrap()
        .read_to_end(&mut gz)
        .unwrap();
    let stream = open_events_from(Cursor::new(gz)).unwrap();
    assert!(stream.is_compressed());
    assert_eq!(stream.into_trace().unwrap().events, small_events());
}

#[test]
fn one_line_json_document_is_detected() {
    let text = r#"{"events":[{"op":"sync"}],"format":"vramsim-trace","version":1}"#;
    let stream = open_events_from(Cursor::new(text.as_bytes().to_vec())).unwrap();
    assert_eq!(stream.format(), Format::Json);
    assert_eq!(
        stream.into_trace().unwrap().events,
        vec![Event::Sync { stream: None }]
    );
}

#[test]
fn one_byte_and_tiny_inputs() {
    // Shorter than the gzip magic.
    assert!(matches!(
        read_trace_from(Cursor::new(b"{".to_vec())),
        Err(TraceError::Truncated { .. })
    ));
    assert!(matches!(
        read_trace_from(Cursor::new(b"\x1f".to_vec())),
        Err(TraceError::Syntax { .. })
    ));
    assert!(matches!(
        read_trace_from(Cursor::new(b"\x1f\x8b".to_vec())),
        Err(TraceError::TruncatedGzip { .. }) | Err(TraceError::Empty { .. })
    ));
}

#[test]
fn a_reader_that_returns_one_byte_at_a_time() {
    struct Dribble(Vec<u8>, usize);
    impl Read for Dribble {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.1 >= self.0.len() || buf.is_empty() {
                return Ok(0);
            }
            buf[0] = self.0[self.1];
            self.1 += 1;
            Ok(1)
        }
    }
    for name in ["small.jsonl.gz", "small.json", "small.jsonl"] {
        let bytes = std::fs::read(data(name)).unwrap();
        let trace = read_trace_from(Dribble(bytes, 0)).unwrap();
        assert_eq!(trace.events, small_events(), "{name}");
    }
}

// ---------------------------------------------------------------------------------------------------
// Random round trips.

fn arb_id() -> impl Strategy<Value = AllocId> {
    prop_oneof![
        any::<u64>().prop_map(AllocId::Int),
        (0u64..1000).prop_map(AllocId::Int),
        any::<String>().prop_map(|s| AllocId::Str(s.into())),
        "[a-z.0-9]{1,12}".prop_map(|s| AllocId::Str(s.into())),
    ]
}

fn arb_stream() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 0u64..8, any::<u64>()]
}

fn arb_us() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        0.0f64..1e6,
        any::<f64>()
            .prop_map(f64::abs)
            .prop_filter("finite", |x| x.is_finite()),
    ]
}

fn arb_event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (
            arb_id(),
            prop_oneof![any::<u64>(), 0u64..(1 << 32)],
            arb_stream(),
            prop::sample::select(Category::ALL.to_vec()),
            prop::option::of(any::<String>()),
        )
            .prop_map(|(id, size, stream, category, tag)| Event::Alloc {
                id,
                size,
                stream,
                category,
                tag: tag.map(Into::into),
            }),
        arb_id().prop_map(|id| Event::Free { id }),
        (arb_id(), arb_stream()).prop_map(|(id, stream)| Event::RecordStream { id, stream }),
        Just(Event::EmptyCache),
        (arb_stream(), arb_us()).prop_map(|(stream, us)| Event::Compute { stream, us }),
        prop::option::of(arb_stream()).prop_map(|stream| Event::Sync { stream }),
        any::<String>().prop_map(|name| Event::Phase { name: name.into() }),
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |x| x.is_finite())
            .prop_map(Value::from),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arb_trace() -> impl Strategy<Value = Trace> {
    (
        prop::collection::btree_map("[a-z_]{1,8}", arb_json(), 0..4),
        prop::collection::vec(arb_event(), 0..40),
    )
        .prop_map(|(meta, events)| Trace {
            meta: meta.into_iter().collect(),
            events,
        })
}

proptest! {
    #[test]
    fn json_round_trip(trace in arb_trace()) {
        let mut bytes = Vec::new();
        write_json(&mut bytes, &trace).unwrap();
        prop_assert_eq!(&parse_json(&bytes).unwrap(), &trace);
        prop_assert_eq!(&read_trace_from(Cursor::new(bytes)).unwrap(), &trace);
    }

    #[test]
    fn jsonl_round_trip(trace in arb_trace()) {
        let mut bytes = Vec::new();
        write_jsonl(&mut bytes, &trace).unwrap();
        prop_assert_eq!(&read_jsonl(&bytes[..]).unwrap(), &trace);
        let stream = open_events_from(Cursor::new(bytes)).unwrap();
        prop_assert_eq!(stream.format(), Format::JsonLines);
        prop_assert_eq!(&stream.into_trace().unwrap(), &trace);
    }

    #[test]
    fn gzip_round_trip(trace in arb_trace(), lines in any::<bool>()) {
        let mut text = Vec::new();
        if lines {
            write_jsonl(&mut text, &trace).unwrap();
        } else {
            write_json(&mut text, &trace).unwrap();
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&text).unwrap();
        let gz = gz.finish().unwrap();
        prop_assert_eq!(&read_trace_from(Cursor::new(gz)).unwrap(), &trace);
    }

    #[test]
    fn events_without_a_header_round_trip(events in prop::collection::vec(arb_event(), 1..40)) {
        let mut w = JsonlWriter::without_header(Vec::new());
        for e in &events {
            w.write_event(e).unwrap();
        }
        let bytes = w.finish().unwrap();
        let reader = JsonlReader::new(&bytes[..]).unwrap();
        prop_assert!(!reader.has_header());
        let read: Vec<Event> = reader.collect::<Result<_, _>>().unwrap();
        prop_assert_eq!(read, events);
    }
}

/// The two examples in `docs/trace-format.md` parse, as the encodings they claim to be, to the same
/// trace; and the writers produce the documented JSON Lines text for it.
#[test]
fn the_documented_examples_agree() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/trace-format.md"),
    )
    .unwrap();
    let examples = doc.split("## Examples").nth(1).unwrap();
    let block = |fence: &str| {
        let start = examples.find(fence).unwrap() + fence.len();
        let len = examples[start..].find("```").unwrap();
        examples[start..start + len].to_owned()
    };
    let json = block("```json\n");
    let lines = block("```text\n");
    let from_json = open_events_from(Cursor::new(json.into_bytes())).unwrap();
    assert_eq!(from_json.format(), Format::Json);
    let from_lines = open_events_from(Cursor::new(lines.clone().into_bytes())).unwrap();
    assert_eq!(from_lines.format(), Format::JsonLines);
    let trace = from_json.into_trace().unwrap();
    assert_eq!(trace, from_lines.into_trace().unwrap());
    assert_eq!(trace.events.len(), 10);
    let mut written = Vec::new();
    write_jsonl(&mut written, &trace).unwrap();
    let written = String::from_utf8(written).unwrap();
    // The documented text leaves out two defaults the writer spells out.
    let documented = lines
        .replace(
            r#""id":"fc1.out","size":1048576,"#,
            r#""id":"fc1.out","size":1048576,"stream":0,"#,
        )
        .replace(
            r#""model":"tiny-mlp","batch":8"#,
            r#""batch":8,"model":"tiny-mlp""#,
        );
    assert_eq!(written, documented);
}
