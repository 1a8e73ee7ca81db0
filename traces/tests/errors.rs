//! Every error a reader can report, with the exact line, column and event index it names; and no input
//! that makes a reader panic.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use vramsim_traces::{
    open_events, parse_json, read_jsonl, read_trace, read_trace_from, write_json, write_jsonl,
    Event, EventProblem, HeaderProblem, JsonlReader, JsonlWriter, Location, Trace, TraceError, OPS,
};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn s(text: &str) -> String {
    text.to_owned()
}

/// Bad event lines, each with the problem it must report and the column serde_json stops at.
fn bad_events() -> Vec<(&'static str, u64, EventProblem)> {
    use EventProblem::*;
    vec![
        // size: negative, not an integer, larger than u64, mistyped.
        (
            r#"{"op":"alloc","id":1,"size":-5}"#,
            31,
            SizeNegative { found: s("-5") },
        ),
        (
            r#"{"op":"alloc","id":1,"size":-0.5}"#,
            33,
            SizeNegative { found: s("-0.5") },
        ),
        (
            r#"{"op":"alloc","id":1,"size":4096.5}"#,
            35,
            SizeNotInteger { found: s("4096.5") },
        ),
        (
            r#"{"op":"alloc","id":1,"size":1e3}"#,
            32,
            SizeNotInteger { found: s("1000.0") },
        ),
        (
            r#"{"op":"alloc","id":1,"size":18446744073709551616}"#,
            49,
            SizeTooLarge {
                found: s("1.8446744073709552e19"),
            },
        ),
        (
            r#"{"op":"alloc","id":1,"size":"4096","stream":0}"#,
            34,
            WrongType {
                field: "size",
                found: s("the string \"4096\""),
            },
        ),
        (
            r#"{"op":"alloc","id":1,"size":null}"#,
            33,
            WrongType {
                field: "size",
                found: s("null"),
            },
        ),
        // id: neither a non-negative integer nor a string.
        (
            r#"{"op":"free","id":-1}"#,
            21,
            BadId {
                found: s("the number -1"),
            },
        ),
        (
            r#"{"op":"free","id":1.5}"#,
            22,
            BadId {
                found: s("the number 1.5"),
            },
        ),
        (r#"{"op":"free","id":true}"#, 23, BadId { found: s("true") }),
        (
            r#"{"op":"free","id":[1]}"#,
            22,
            BadId {
                found: s("an array"),
            },
        ),
        (
            r#"{"op":"free","id":{"a":1}}"#,
            26,
            BadId {
                found: s("an object"),
            },
        ),
        // op: unknown, missing, mistyped.
        (r#"{"op":"frea","id":1}"#, 12, UnknownOp { op: s("frea") }),
        (
            r#"{"op":"Alloc","id":1,"size":1}"#,
            13,
            UnknownOp { op: s("Alloc") },
        ),
        (r#"{"id":1}"#, 8, MissingOp),
        (r#"{}"#, 2, MissingOp),
        (
            r#"{"op":7}"#,
            8,
            WrongType {
                field: "op",
                found: s("the number 7"),
            },
        ),
        // Missing fields.
        (
            r#"{"op":"alloc","id":1}"#,
            21,
            MissingField {
                field: "size",
                op: "alloc",
            },
        ),
        (
            r#"{"op":"alloc","size":1}"#,
            23,
            MissingField {
                field: "id",
                op: "alloc",
            },
        ),
        (
            r#"{"op":"free"}"#,
            13,
            MissingField {
                field: "id",
                op: "free",
            },
        ),
        (
            r#"{"op":"record_stream","id":1}"#,
            29,
            MissingField {
                field: "stream",
                op: "record_stream",
            },
        ),
        (
            r#"{"op":"compute","stream":1}"#,
            27,
            MissingField {
                field: "us",
                op: "compute",
            },
        ),
        (
            r#"{"op":"phase"}"#,
            14,
            MissingField {
                field: "name",
                op: "phase",
            },
        ),
        // Mistyped fields.
        (
            r#"{"op":"record_stream","id":1,"stream":null}"#,
            43,
            WrongType {
                field: "stream",
                found: s("null"),
            },
        ),
        (
            r#"{"op":"alloc","id":1,"size":1,"stream":-2}"#,
            42,
            WrongType {
                field: "stream",
                found: s("the number -2"),
            },
        ),
        (
            r#"{"op":"sync","stream":"a"}"#,
            26,
            WrongType {
                field: "stream",
                found: s("the string \"a\""),
            },
        ),
        (
            r#"{"op":"phase","name":3}"#,
            23,
            WrongType {
                field: "name",
                found: s("the number 3"),
            },
        ),
        (
            r#"{"op":"alloc","id":1,"size":1,"tag":5}"#,
            38,
            WrongType {
                field: "tag",
                found: s("the number 5"),
            },
        ),
        (
            r#"{"op":"alloc","id":1,"size":1,"category":1}"#,
            43,
            WrongType {
                field: "category",
                found: s("the number 1"),
            },
        ),
        (
            r#"{"op":"compute","us":"5"}"#,
            25,
            WrongType {
                field: "us",
                found: s("the string \"5\""),
            },
        ),
        // Category and duration.
        (
            r#"{"op":"alloc","id":1,"size":1,"category":"weights"}"#,
            51,
            UnknownCategory {
                category: s("weights"),
            },
        ),
        (
            r#"{"op":"compute","us":-1}"#,
            24,
            DurationNegative { us: -1.0 },
        ),
        (
            r#"{"op":"compute","us":-0.5,"stream":0}"#,
            25,
            DurationNegative { us: -0.5 },
        ),
        // Keys.
        (
            r#"{"op":"free","id":1,"size":3}"#,
            29,
            UnknownKey {
                key: s("size"),
                op: Some("free"),
            },
        ),
        (
            r#"{"op":"free","id":1,"sise":3}"#,
            29,
            UnknownKey {
                key: s("sise"),
                op: Some("free"),
            },
        ),
        (
            r#"{"sise":3,"id":1}"#,
            17,
            UnknownKey {
                key: s("sise"),
                op: None,
            },
        ),
        (
            r#"{"op":"free","id":1,"junk":[1,{"a":2}]}"#,
            39,
            UnknownKey {
                key: s("junk"),
                op: Some("free"),
            },
        ),
        (
            r#"{"op":"free","id":1,"format":"vramsim-trace"}"#,
            45,
            UnknownKey {
                key: s("format"),
                op: Some("free"),
            },
        ),
        (
            r#"{"op":"free","id":1,"id":3}"#,
            24,
            DuplicateKey { key: "id" },
        ),
        // Not an object.
        (
            r#"[1,2]"#,
            1,
            NotAnObject {
                found: s("an array"),
            },
        ),
        (
            r#""alloc""#,
            7,
            NotAnObject {
                found: s("a string"),
            },
        ),
        (
            r#"42"#,
            2,
            NotAnObject {
                found: s("a number"),
            },
        ),
        (r#"null"#, 4, NotAnObject { found: s("null") }),
    ]
}

#[test]
fn event_errors_in_json_lines_name_line_column_and_index() {
    let mut wrong = Vec::new();
    for (line, column, problem) in bad_events() {
        // Header on line 1, a good event (index 0) on line 2, a blank line, the bad event (index 1) on
        // line 4, a good event after it.
        let text = format!(
            "{{\"format\":\"vramsim-trace\",\"version\":1}}\n{{\"op\":\"sync\"}}\n\n{line}\n{{\"op\":\"empty_cache\"}}\n"
        );
        let items: Vec<_> = JsonlReader::new(text.as_bytes()).unwrap().collect();
        assert_eq!(items.len(), 3, "{line}");
        assert!(
            items[0].is_ok() && items[2].is_ok(),
            "reading goes on after {line}"
        );
        let want = TraceError::Event {
            at: Location {
                path: None,
                line: 4,
                column: Some(column),
            },
            index: 1,
            problem,
        };
        check(&mut wrong, line, &items[1], &want);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Records a mismatch between an error and the one expected (compared by their `Debug` text, which
/// shows every field).
fn check<T: std::fmt::Debug>(
    wrong: &mut Vec<String>,
    input: &str,
    got: &Result<T, TraceError>,
    want: &TraceError,
) {
    let got = format!("{got:?}");
    let want = format!("Err({want:?})");
    if got != want {
        wrong.push(format!("{input}\n    got  {got}\n    want {want}"));
    }
}

#[test]
fn event_errors_in_a_json_document_name_line_column_and_index() {
    let mut wrong = Vec::new();
    for (line, column, problem) in bad_events() {
        let text = format!(
            "{{\"format\":\"vramsim-trace\",\"version\":1,\"events\":[\n{{\"op\":\"sync\"}},\n{{\"op\":\"sync\"}},\n{line},\n{{\"op\":\"sync\"}}\n]}}\n"
        );
        let want = TraceError::Event {
            at: Location {
                path: None,
                line: 4,
                column: Some(column),
            },
            index: 2,
            problem,
        };
        check(&mut wrong, line, &parse_json(text.as_bytes()), &want);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn messages_say_what_is_valid() {
    let msg = |line: &str| {
        let text = format!("{line}\n");
        read_jsonl(text.as_bytes()).unwrap_err().to_string()
    };
    assert_eq!(
        msg(r#"{"op":"frea","id":1}"#),
        "line 1, column 12: event 0: unknown op \"frea\": valid ops are alloc, free, record_stream, empty_cache, compute, sync, phase, segment"
    );
    assert_eq!(
        msg(r#"{"op":"alloc","id":1,"size":1,"category":"weights"}"#),
        "line 1, column 51: event 0: unknown category \"weights\": valid categories are parameter, gradient, optimizer_state, activation, temporary, workspace, input, autograd_detail, communication, other"
    );
    assert_eq!(
        msg(r#"{"op":"alloc","id":1}"#),
        "line 1, column 21: event 0: missing `size` for op `alloc`: expected a non-negative integer number of bytes (op `alloc` takes op, id, size, and optionally stream (default 0), category (default \"other\") and tag)"
    );
    assert_eq!(
        msg(r#"{"op":"alloc","id":1,"size":18446744073709551616}"#),
        "line 1, column 49: event 0: `size` 1.8446744073709552e19 is larger than the largest 64-bit size, 18446744073709551615 bytes (sizes up to that are accepted: 2^60 bytes or more replays as PyTorch's \"more than 1EB\" out-of-memory error)"
    );
    assert_eq!(
        msg(r#"{"op":"free","id":-1}"#),
        "line 1, column 21: event 0: `id` must be a non-negative integer or a string, got the number -1"
    );
    assert_eq!(
        msg(r#"{"op":"free","id":1,"size":3}"#),
        "line 1, column 29: event 0: key `size` does not go with op `free` (op `free` takes op and id)"
    );
    assert_eq!(
        msg(r#"{"op":"free","id":1,"meta":{}}"#),
        "line 1, column 30: event 0: unknown key `meta` (op `free` takes op and id); a header is only allowed as the first line of a JSON Lines trace"
    );
    let unknown_op = EventProblem::UnknownOp { op: s("x") }.to_string();
    for op in OPS {
        assert!(unknown_op.contains(op), "{unknown_op}");
    }
}

#[test]
fn sizes_of_2_pow_60_and_up_are_accepted() {
    for size in [1u64 << 60, (1 << 60) + 1, u64::MAX] {
        let line = format!("{{\"op\":\"alloc\",\"id\":1,\"size\":{size}}}");
        let trace = read_jsonl(line.as_bytes()).unwrap();
        assert!(matches!(trace.events[0], Event::Alloc { size: s, .. } if s == size));
    }
}

#[test]
fn syntax_errors_name_line_and_column() {
    let mut wrong = Vec::new();
    for (line, column, message) in [
        (r#"{"op":"free","id":1,}"#, 21, "trailing comma"),
        (r#"{"op":"free","id":1} x"#, 22, "trailing characters"),
        (r#"{"op":"free" "id":1}"#, 14, "expected `,` or `}`"),
        (r#"{op:"free"}"#, 2, "key must be a string"),
        (r#"{"op":"free","id":01}"#, 20, "invalid number"),
        (
            "{\"op\":\"phase\",\"name\":\"\\ud800\"}",
            29,
            "unexpected end of hex escape",
        ),
    ] {
        let text = format!("{{\"op\":\"sync\"}}\n\n{line}\n");
        let items: Vec<_> = JsonlReader::new(text.as_bytes()).unwrap().collect();
        let want = TraceError::Syntax {
            at: Location {
                path: None,
                line: 3,
                column: Some(column),
            },
            message: message.to_owned(),
        };
        check(&mut wrong, line, &items[1], &want);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Whole document: serde_json's line and column.
    let doc = "{\"format\":\"vramsim-trace\",\n\"version\":1,\n\"events\":[\n{\"op\":\"sync\"}\n{\"op\":\"sync\"}]}";
    match parse_json(doc.as_bytes()) {
        Err(TraceError::Syntax { at, message }) => {
            assert_eq!(message, "expected `,` or `]`");
            assert_eq!((at.line, at.column), (5, Some(1)));
        }
        other => panic!("{other:?}"),
    }
    // Invalid UTF-8.
    let bad = b"{\"op\":\"phase\",\"name\":\"\xff\"}\n";
    match read_jsonl(&bad[..]) {
        Err(TraceError::Syntax { at, .. }) => assert_eq!(at.line, 1),
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_input_says_so() {
    // The last line of a JSON Lines file cut short.
    let text = "{\"op\":\"sync\"}\n{\"op\":\"alloc\",\"id\":1,\"si";
    let items: Vec<_> = JsonlReader::new(text.as_bytes()).unwrap().collect();
    match &items[1] {
        Err(e @ TraceError::Truncated { at, message }) => {
            assert_eq!(
                at,
                &Location {
                    path: None,
                    line: 2,
                    column: Some(24)
                }
            );
            assert_eq!(message, "EOF while parsing a string");
            assert!(e.to_string().contains("looks truncated"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // A whole document cut short, from a fixture file.
    let e = read_trace(data("truncated.json")).unwrap_err();
    match &e {
        TraceError::Truncated { at, message } => {
            assert_eq!(at.path.as_deref(), Some(data("truncated.json").as_path()));
            assert_eq!((at.line, at.column), (3, Some(20)));
            assert_eq!(message, "EOF while parsing a list");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        e.to_string().starts_with(&format!(
            "{}:3:20: the JSON ends early",
            data("truncated.json").display()
        )),
        "{e}"
    );
    // A gzip stream cut short: the complete lines before the cut still read.
    let items: Vec<_> = open_events(data("truncated.jsonl.gz")).unwrap().collect();
    let last = items.last().unwrap();
    assert!(
        matches!(last, Err(TraceError::TruncatedGzip { path: Some(p) }) if p == &data("truncated.jsonl.gz")),
        "{last:?}"
    );
    assert!(items.iter().filter(|i| i.is_ok()).count() >= 1);
}

#[test]
fn header_errors() {
    use HeaderProblem::*;
    let mut wrong = Vec::new();
    for (text, line, column, problem) in [
        (
            "{\"format\":\"vramsim\",\"version\":1}\n",
            1,
            19,
            WrongFormat {
                found: s("\"vramsim\""),
            },
        ),
        (
            "{\"format\":1,\"version\":1}\n",
            1,
            11,
            WrongFormat { found: s("1") },
        ),
        (
            "{\"format\":\"vramsim-trace\",\"version\":2}\n",
            1,
            38,
            UnsupportedVersion { found: s("2") },
        ),
        (
            "{\"format\":\"vramsim-trace\",\"version\":\"1\"}\n",
            1,
            40,
            UnsupportedVersion { found: s("\"1\"") },
        ),
        ("{\"format\":\"vramsim-trace\"}\n", 1, 26, MissingVersion),
        ("\n\n{\"version\":1}\n", 3, 13, MissingFormat),
        ("{\"meta\":{}}\n{\"op\":\"sync\"}\n", 1, 11, MissingFormat),
        (
            "{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":[]}\n",
            1,
            48,
            MetaNotObject {
                found: s("an array"),
            },
        ),
        (
            "{\"format\":\"vramsim-trace\",\"version\":1,\"extra\":[]}\n",
            1,
            45,
            UnknownKey { key: s("extra") },
        ),
        (
            "{\"format\":\"vramsim-trace\",\"format\":\"vramsim-trace\"}\n",
            1,
            34,
            DuplicateKey { key: "format" },
        ),
    ] {
        let want = TraceError::Header {
            at: Location {
                path: None,
                line,
                column: Some(column),
            },
            problem,
        };
        check(
            &mut wrong,
            text,
            &read_trace_from(Cursor::new(text.as_bytes().to_vec())),
            &want,
        );
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The same problems in a whole document.
    for (text, problem) in [
        (
            "{\"format\":\"vramsim-trace\",\"version\":3,\"events\":[]}",
            UnsupportedVersion { found: s("3") },
        ),
        ("{\"version\":1,\"events\":[]}", MissingFormat),
        (
            "{\"format\":\"vramsim-trace\",\"version\":1,\"events\":{}}",
            EventsNotArray {
                found: s("an object"),
            },
        ),
        (
            "{\"format\":\"vramsim-trace\",\"version\":1}",
            MissingEvents,
        ),
        (
            "{\"format\":\"vramsim-trace\",\"version\":1,\"traceEvents\":[]}",
            UnknownKey {
                key: s("traceEvents"),
            },
        ),
        (
            "[]",
            NotAnObject {
                found: s("an array"),
            },
        ),
    ] {
        match parse_json(text.as_bytes()) {
            Err(TraceError::Header { problem: got, .. }) => assert_eq!(got, problem, "{text}"),
            other => panic!("{text}: expected a header error, got {other:?}"),
        }
    }
    // A JSON Lines header with events in it.
    let text = "{\"format\":\"vramsim-trace\",\"version\":1,\"events\":[]}\n";
    assert!(matches!(
        JsonlReader::new(text.as_bytes()),
        Err(TraceError::Header {
            problem: EventsInJsonLines,
            ..
        })
    ));
    // A JSON Lines trace whose first line is cut short looks like a document to the detector; the
    // error says what it probably is.
    let text = "{\"op\":\"free\",\"id\":1\n{\"op\":\"free\",\"id\":2}\n";
    let e = read_trace_from(Cursor::new(text.as_bytes().to_vec())).unwrap_err();
    assert!(
        matches!(&e, TraceError::Header { problem: UnknownKey { key }, .. } if key == "op"),
        "{e:?}"
    );
    assert!(e.to_string().contains("first line is cut short"), "{e}");
}

#[test]
fn empty_input_says_so() {
    for name in ["empty.jsonl", "blank.jsonl"] {
        let e = read_trace(data(name)).unwrap_err();
        assert!(
            matches!(&e, TraceError::Empty { path: Some(p) } if p == &data(name)),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("the trace is empty: no header and no events"),
            "{e}"
        );
    }
    assert!(matches!(
        JsonlReader::new(&b""[..]),
        Err(TraceError::Empty { path: None })
    ));
    assert!(matches!(
        parse_json(b" \n"),
        Err(TraceError::Empty { path: None })
    ));
    assert!(matches!(
        read_trace_from(Cursor::new(Vec::new())),
        Err(TraceError::Empty { .. })
    ));
}

#[test]
fn io_errors_name_the_path() {
    let missing = data("no-such-file.jsonl");
    for e in [
        read_trace(&missing).unwrap_err(),
        open_events(&missing).unwrap_err(),
    ] {
        match &e {
            TraceError::Io {
                path: Some(p),
                source,
            } => {
                assert_eq!(p, &missing);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("no-such-file.jsonl"), "{e}");
    }
    let e =
        vramsim_traces::write_trace(data("no-such-dir/t.jsonl"), &Trace::default()).unwrap_err();
    assert!(matches!(&e, TraceError::Io { path: Some(_), .. }), "{e:?}");
    assert!(e.to_string().contains("no-such-dir"), "{e}");
}

#[test]
fn errors_in_files_name_the_file() {
    let e = read_trace(data("bad_size.jsonl")).unwrap_err();
    assert_eq!(e.path(), Some(data("bad_size.jsonl").as_path()));
    assert_eq!(
        (e.line(), e.column(), e.event_index()),
        (Some(4), Some(34), Some(1))
    );
    assert_eq!(
        e.to_string(),
        format!(
            "{}:4:34: event 1: `size` is negative (-4096): sizes are byte counts, 0 or more",
            data("bad_size.jsonl").display()
        )
    );
    // Reading goes on past the bad line.
    let items: Vec<_> = open_events(data("bad_size.jsonl")).unwrap().collect();
    assert_eq!(items.len(), 3);
    assert!(items[0].is_ok() && items[1].is_err() && items[2].is_ok());
}

#[test]
fn writers_refuse_durations_no_reader_accepts() {
    for (us, problem) in [
        (-1.0, EventProblem::DurationNegative { us: -1.0 }),
        (
            f64::INFINITY,
            EventProblem::DurationNotFinite { us: f64::INFINITY },
        ),
    ] {
        let trace = Trace::from_events(vec![
            Event::Sync { stream: None },
            Event::Compute { stream: 0, us },
        ]);
        for result in [
            write_json(Vec::new(), &trace),
            write_jsonl(Vec::new(), &trace),
        ] {
            match result {
                Err(TraceError::Unwritable {
                    index: 1,
                    problem: got,
                    ..
                }) => assert_eq!(got, problem),
                other => panic!("{other:?}"),
            }
        }
        let mut w = JsonlWriter::without_header(Vec::new());
        w.write_event(&Event::EmptyCache).unwrap();
        assert!(matches!(
            w.write_event(&Event::Compute { stream: 0, us }),
            Err(TraceError::Unwritable { index: 1, .. })
        ));
        assert_eq!(w.finish().unwrap(), b"{\"op\":\"empty_cache\"}\n");
    }
    // NaN is not equal to itself: check the variant only.
    let trace = Trace::from_events(vec![Event::Compute {
        stream: 0,
        us: f64::NAN,
    }]);
    assert!(matches!(
        write_json(Vec::new(), &trace),
        Err(TraceError::Unwritable {
            problem: EventProblem::DurationNotFinite { .. },
            ..
        })
    ));
    let e = write_json(Vec::new(), &trace)
        .unwrap_err()
        .with_path("out.json");
    assert_eq!(e.to_string(), "out.json: event 0 cannot be written: `us` is not finite (NaN): a duration is a finite number of microseconds");
}

#[test]
fn deeply_nested_input_is_an_error_not_a_crash() {
    let deep = format!(
        "{{\"op\":\"free\",\"id\":1,\"x\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(read_jsonl(deep.as_bytes()).is_err());
    let deep_meta = format!(
        "{{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{{\"a\":{}{}}}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(read_jsonl(deep_meta.as_bytes()).is_err());
    assert!(read_trace_from(Cursor::new(deep_meta.into_bytes())).is_err());
}

// ---------------------------------------------------------------------------------------------------
// No input makes a reader panic.

fn read_all(bytes: Vec<u8>) {
    let _ = parse_json(&bytes);
    if let Ok(reader) = JsonlReader::new(&bytes[..]) {
        for item in reader.take(10_000) {
            let _ = item.map_err(|e| e.to_string());
        }
    }
    if let Ok(stream) = vramsim_traces::open_events_from(Cursor::new(bytes)) {
        for item in stream.take(10_000) {
            let _ = item.map_err(|e| e.to_string());
        }
    }
}

/// A valid trace to mutate.
fn sample() -> Vec<u8> {
    std::fs::read(data("small.jsonl")).unwrap()
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        read_all(bytes);
    }

    #[test]
    fn random_text_never_panics(text in r#"[{}\[\]":,0-9a-z\-. \n\\eE]{0,200}"#) {
        read_all(text.into_bytes());
    }

    #[test]
    fn mutated_traces_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        gzip in any::<bool>(),
    ) {
        let mut bytes = if gzip { std::fs::read(data("small.json.gz")).unwrap() } else { sample() };
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep.max(bytes.len() / 2));
        read_all(bytes);
    }
}
