//! The `segment` op: a trace's initial state. Read, written and rejected with located, actionable errors
//! like every other op.

use vramsim_traces::{
    read_jsonl, write_jsonl, AllocId, BlockProblem, Category, Event, EventProblem, InitialBlock,
    InitialSegment, Pool, Trace,
};

fn read(text: &str) -> Result<Vec<Event>, vramsim_traces::TraceError> {
    read_jsonl(format!("{text}\n").as_bytes()).map(|t| t.events)
}

#[test]
fn a_segment_reads_with_its_defaults_and_round_trips() {
    let events = read(
        r#"{"op":"segment","addr":4096,"size":2097152,"pool":"small","blocks":[{"id":7,"offset":512,"size":1024,"requested":1000},{"id":"w","offset":2048,"size":512,"category":"parameter","tag":"fc.w"}]}"#,
    )
    .unwrap();
    let want = InitialSegment {
        addr: 4096,
        size: 2 << 20,
        stream: 0,
        pool: Pool::Small,
        expandable: false,
        base: None,
        blocks: vec![
            InitialBlock {
                id: AllocId::Int(7),
                offset: 512,
                size: 1024,
                requested: 1000,
                category: Category::Other,
                tag: None,
            },
            InitialBlock {
                id: AllocId::from("w"),
                offset: 2048,
                size: 512,
                requested: 512,
                category: Category::Parameter,
                tag: Some("fc.w".into()),
            },
        ],
    };
    assert_eq!(events, [Event::Segment(Box::new(want.clone()))]);
    assert_eq!(events[0].op(), "segment");

    // written with every key, read back the same
    let expandable = InitialSegment {
        expandable: true,
        base: Some(0),
        pool: Pool::Large,
        stream: 7,
        ..want
    };
    let trace = Trace {
        meta: Default::default(),
        events: vec![Event::Segment(Box::new(expandable))],
    };
    let mut out = Vec::new();
    write_jsonl(&mut out, &trace).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains(r#"{"op":"segment","addr":4096,"size":2097152,"stream":7,"pool":"large","expandable":true,"base":0,"blocks":[{"id":7,"offset":512,"size":1024,"requested":1000},{"id":"w","offset":2048,"size":512,"requested":512,"category":"parameter","tag":"fc.w"}]}"#), "{text}");
    assert_eq!(read_jsonl(text.as_bytes()).unwrap().events, trace.events);
    // no blocks, and null for the optional keys
    let empty = read(r#"{"op":"segment","addr":0,"size":512,"pool":"large","stream":null,"expandable":null,"blocks":null}"#).unwrap();
    assert!(matches!(&empty[0], Event::Segment(s) if s.blocks.is_empty() && !s.expandable));
}

#[test]
fn bad_segments_say_what_is_wrong_and_where() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"op":"segment","addr":0,"size":512}"#,
            "line 1, column 36: event 0: missing `pool` for op `segment`: expected \"small\" or \"large\" (op `segment` takes op, addr, size, pool, and optionally stream (default 0), expandable (default false), blocks (default: none) and base (expandable only))",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"medium"}"#,
            "line 1, column 52: event 0: unknown pool \"medium\": a segment's pool is \"small\" or \"large\"",
        ),
        (
            r#"{"op":"segment","addr":-1,"size":512,"pool":"small"}"#,
            "line 1, column 25: event 0: `addr` must be a non-negative integer device address, got the number -1",
        ),
        (
            r#"{"op":"segment","addr":0,"size":0,"pool":"small"}"#,
            "line 1, column 49: event 0: `size` is 0: a segment holds at least one byte",
        ),
        (
            r#"{"op":"segment","addr":18446744073709551615,"size":2,"pool":"small"}"#,
            "line 1, column 68: event 0: the segment at `addr` 18446744073709551615 of 2 bytes runs past the end of the 64-bit address space",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","expandable":"yes"}"#,
            "line 1, column 70: event 0: `expandable` must be true or false, got the string \"yes\"",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","base":0}"#,
            "line 1, column 60: event 0: `base` (0) is for expandable segments only: a reservation's start (add \"expandable\":true, or leave `base` out)",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","expandable":true,"base":1024}"#,
            "line 1, column 81: event 0: `base` (1024) is above `addr` (0): the reservation starts at or below the ranges mapped in it",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":{}}"#,
            "line 1, column 62: event 0: `blocks` must be an array of block objects like {\"id\":1,\"offset\":0,\"size\":512}, got an object",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":[3]}"#,
            "line 1, column 62: event 0: blocks[0]: a block must be a JSON object like {\"id\":1,\"offset\":0,\"size\":512}, got the number 3",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":[{"id":1,"size":512}]}"#,
            "line 1, column 80: event 0: blocks[0]: missing `offset`: expected a non-negative integer number of bytes from the segment's start (a block takes id, offset, size, and optionally requested (default: size), category (default \"other\") and tag)",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":[{"id":1,"offset":0,"size":512,"sise":1}]}"#,
            "line 1, column 97: event 0: blocks[0]: unknown key `sise` (a block takes id, offset, size, and optionally requested (default: size), category (default \"other\") and tag)",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":[{"id":1,"offset":0,"offset":0,"size":512}]}"#,
            "line 1, column 88: event 0: blocks[0]: key `offset` appears twice",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":[{"id":1,"offset":-5,"size":512}]}"#,
            "line 1, column 80: event 0: blocks[0]: `offset` must be a non-negative integer number of bytes from the segment's start, got the number -5",
        ),
        (
            r#"{"op":"segment","addr":0,"size":512,"pool":"small","blocks":[{"id":1,"offset":0,"size":512,"category":"weights"}]}"#,
            "line 1, column 112: event 0: blocks[0]: unknown category \"weights\": valid categories are parameter, gradient, optimizer_state, activation, temporary, workspace, input, autograd_detail, communication, other",
        ),
        (
            r#"{"op":"segment","addr":0,"size":1024,"pool":"small","blocks":[{"id":1,"offset":0,"size":512},{"id":2,"offset":256,"size":512}]}"#,
            "line 1, column 127: event 0: blocks[1]: the block at offset 256 starts before the previous block ends (offset 512): blocks are listed in address order and do not overlap",
        ),
        (
            r#"{"op":"segment","addr":0,"size":1024,"pool":"small","blocks":[{"id":1,"offset":768,"size":512}]}"#,
            "line 1, column 96: event 0: blocks[0]: the block at offset 768 of 512 bytes ends past the segment's 1024 bytes",
        ),
        (
            r#"{"op":"segment","addr":0,"size":1024,"pool":"small","blocks":[{"id":1,"offset":0,"size":512,"requested":600}]}"#,
            "line 1, column 110: event 0: blocks[0]: `requested` (600) is larger than `size` (512): a block holds at least the bytes requested",
        ),
        (
            r#"{"op":"segment","addr":0,"size":1024,"pool":"small","blocks":[{"id":1,"offset":0,"size":0}]}"#,
            "line 1, column 92: event 0: blocks[0]: `size` is 0: a block holds at least one byte",
        ),
        (
            r#"{"op":"free","id":1,"pool":"small"}"#,
            "line 1, column 35: event 0: key `pool` does not go with op `free` (op `free` takes op and id)",
        ),
    ];
    let mut wrong = Vec::new();
    for (line, want) in cases {
        match read(line) {
            Ok(events) => wrong.push(format!("{line}\n  accepted: {events:?}")),
            Err(e) if e.to_string() != *want => {
                wrong.push(format!("{line}\n  got:  {e}\n  want: {want}"))
            }
            Err(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn problems_are_typed() {
    let e = read(r#"{"op":"segment","addr":0,"size":1024,"pool":"small","blocks":[{"id":1,"offset":0,"size":512},{"id":2,"offset":256,"size":512}]}"#).unwrap_err();
    assert_eq!(e.event_index(), Some(0));
    assert_eq!(
        e.event_problem(),
        Some(&EventProblem::Block {
            index: 1,
            problem: BlockProblem::Overlaps {
                offset: 256,
                previous_end: 512
            }
        })
    );
}

#[test]
fn writers_refuse_a_segment_no_reader_would_accept() {
    let trace = Trace {
        meta: Default::default(),
        events: vec![Event::Segment(Box::new(InitialSegment {
            addr: 0,
            size: 512,
            stream: 0,
            pool: Pool::Small,
            expandable: false,
            base: None,
            blocks: vec![InitialBlock {
                id: AllocId::Int(1),
                offset: 0,
                size: 1024,
                requested: 1024,
                category: Category::Other,
                tag: None,
            }],
        }))],
    };
    let err = write_jsonl(Vec::new(), &trace).unwrap_err();
    assert_eq!(
        err.to_string(),
        "event 0 cannot be written: blocks[0]: the block at offset 0 of 1024 bytes ends past the segment's 512 bytes"
    );
}
