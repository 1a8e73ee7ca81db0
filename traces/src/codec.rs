//! The JSON encoding of events and headers, shared by the JSON and JSON Lines formats.
//!
//! Reading is the hot path of big traces, so events are decoded by a hand-written visitor rather than
//! a derived, internally tagged enum (`#[serde(tag = "op")]` buffers every object into a map of
//! `Content` before it looks at the tag). The visitor takes the keys in any order, classifies each value
//! without allocating (strings stay borrowed from the line), and builds the [`Event`] once the object
//! closes; the only allocations are the ones the event keeps (string ids, tags, phase names).
//!
//! A problem with an otherwise well-formed event (an unknown op, a negative size) is recorded as a
//! typed [`EventProblem`] in a slot the caller owns, and the visitor returns a placeholder
//! `serde_json::Error`; serde_json stamps that error with the line and column where the visitor
//! stopped, and the caller pairs the two into a [`crate::TraceError`].

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::ser::{self, SerializeMap};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{BlockProblem, EventProblem, HeaderProblem, EVENT_KEYS};
use crate::event::{AllocId, Category, Event, InitialBlock, InitialSegment, Pool, OPS};
use crate::trace::{Meta, FORMAT_NAME, FORMAT_VERSION};

/// The message of the placeholder error a visitor returns after recording a typed problem.
const RECORDED: &str = "vramsim-traces: problem recorded";

// ---------------------------------------------------------------------------------------------------
// Values, classified without allocating.

/// One JSON value where a field was expected: numbers and strings kept, containers skipped.
enum Scalar<'de> {
    U64(u64),
    I64(i64),
    F64(f64),
    Str(Cow<'de, str>),
    Bool(bool),
    Null,
    Array,
    Object,
}

impl Scalar<'_> {
    /// The value as error messages show it.
    fn describe(&self) -> String {
        match self {
            Scalar::U64(n) => format!("the number {n}"),
            Scalar::I64(n) => format!("the number {n}"),
            Scalar::F64(x) => format!("the number {x:?}"),
            Scalar::Str(s) => format!("the string {:?}", shorten(s)),
            Scalar::Bool(b) => format!("{b}"),
            Scalar::Null => "null".to_owned(),
            Scalar::Array => "an array".to_owned(),
            Scalar::Object => "an object".to_owned(),
        }
    }

    /// The value as it would be written in JSON (for numbers and short strings).
    fn text(&self) -> String {
        match self {
            Scalar::U64(n) => n.to_string(),
            Scalar::I64(n) => n.to_string(),
            Scalar::F64(x) => format!("{x:?}"),
            Scalar::Str(s) => format!("{:?}", shorten(s)),
            other => other.describe(),
        }
    }
}

/// At most 60 characters of `s`, for error messages.
fn shorten(s: &str) -> Cow<'_, str> {
    match s.char_indices().nth(60) {
        Some((cut, _)) => Cow::Owned(format!("{}...", &s[..cut])),
        None => Cow::Borrowed(s),
    }
}

impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Scalar<'de>, E> {
        Ok(if v >= 0 {
            Scalar::U64(v as u64)
        } else {
            Scalar::I64(v)
        })
    }
    fn visit_u64<E>(self, v: u64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::U64(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Scalar<'de>, E> {
        Ok(Scalar::F64(v))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Str(Cow::Owned(v)))
    }
    fn visit_unit<E>(self) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Null)
    }
    fn visit_none<E>(self) -> Result<Scalar<'de>, E> {
        Ok(Scalar::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Scalar<'de>, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Array)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar<'de>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Object)
    }
}

// ---------------------------------------------------------------------------------------------------
// Event keys and ops.

/// A key of an event object; the discriminant is the key's bit in a `seen` mask and its index in
/// [`EVENT_KEYS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Op = 0,
    Id,
    Size,
    Stream,
    Category,
    Tag,
    Us,
    Name,
    Addr,
    Pool,
    Expandable,
    Blocks,
    Base,
}

impl Key {
    fn name(self) -> &'static str {
        EVENT_KEYS[self as usize]
    }
    fn bit(self) -> u16 {
        1 << self as u16
    }
    const ALL: [Key; 13] = [
        Key::Op,
        Key::Id,
        Key::Size,
        Key::Stream,
        Key::Category,
        Key::Tag,
        Key::Us,
        Key::Name,
        Key::Addr,
        Key::Pool,
        Key::Expandable,
        Key::Blocks,
        Key::Base,
    ];
}

/// Reads one key: a known [`Key`], or the text of an unknown one (the only allocation, on the error
/// path).
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Result<Key, String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_identifier(KeyVisitor)
    }
}

struct KeyVisitor;

impl Visitor<'_> for KeyVisitor {
    type Value = Result<Key, String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event key")
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(match v {
            "op" => Ok(Key::Op),
            "id" => Ok(Key::Id),
            "size" => Ok(Key::Size),
            "stream" => Ok(Key::Stream),
            "category" => Ok(Key::Category),
            "tag" => Ok(Key::Tag),
            "us" => Ok(Key::Us),
            "name" => Ok(Key::Name),
            "addr" => Ok(Key::Addr),
            "pool" => Ok(Key::Pool),
            "expandable" => Ok(Key::Expandable),
            "blocks" => Ok(Key::Blocks),
            "base" => Ok(Key::Base),
            other => Err(other.to_owned()),
        })
    }
}

/// An event's op; the discriminant is its index in [`OPS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Alloc = 0,
    Free,
    RecordStream,
    EmptyCache,
    Compute,
    Sync,
    Phase,
    Segment,
}

impl Op {
    fn from_name(s: &str) -> Option<Op> {
        Some(match s {
            "alloc" => Op::Alloc,
            "free" => Op::Free,
            "record_stream" => Op::RecordStream,
            "empty_cache" => Op::EmptyCache,
            "compute" => Op::Compute,
            "sync" => Op::Sync,
            "phase" => Op::Phase,
            "segment" => Op::Segment,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        OPS[self as usize]
    }

    /// The keys this op requires, in the order a missing one is reported.
    fn required(self) -> &'static [Key] {
        match self {
            Op::Alloc => &[Key::Id, Key::Size],
            Op::Free => &[Key::Id],
            Op::RecordStream => &[Key::Id, Key::Stream],
            Op::EmptyCache => &[],
            Op::Compute => &[Key::Us],
            Op::Sync => &[],
            Op::Phase => &[Key::Name],
            Op::Segment => &[Key::Addr, Key::Size, Key::Pool],
        }
    }

    /// Mask of the keys this op takes.
    fn allowed(self) -> u16 {
        let optional: &[Key] = match self {
            Op::Alloc => &[Key::Stream, Key::Category, Key::Tag],
            Op::Compute | Op::Sync => &[Key::Stream],
            Op::Segment => &[Key::Stream, Key::Expandable, Key::Blocks, Key::Base],
            _ => &[],
        };
        self.required()
            .iter()
            .chain(optional)
            .fold(Key::Op.bit(), |m, k| m | k.bit())
    }
}

// ---------------------------------------------------------------------------------------------------
// Events.

/// Decodes one event object, recording a typed problem in `slot` when the JSON is well formed but the
/// event is not.
pub(crate) struct EventSeed<'a> {
    pub(crate) slot: &'a mut Option<EventProblem>,
}

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = Event;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Event, D::Error> {
        d.deserialize_any(EventVisitor { slot: self.slot })
    }
}

struct EventVisitor<'a> {
    slot: &'a mut Option<EventProblem>,
}

fn fail<T, E: de::Error>(slot: &mut Option<EventProblem>, problem: EventProblem) -> Result<T, E> {
    *slot = Some(problem);
    Err(E::custom(RECORDED))
}

impl EventVisitor<'_> {
    fn not_object<T, E: de::Error>(self, found: &str) -> Result<T, E> {
        fail(
            self.slot,
            EventProblem::NotAnObject {
                found: found.to_owned(),
            },
        )
    }
}

impl<'de> Visitor<'de> for EventVisitor<'_> {
    type Value = Event;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Event, A::Error> {
        let slot = self.slot;
        let mut seen: u16 = 0;
        let mut op = None;
        let mut id = None;
        let mut size = None;
        let mut stream: Option<Option<u64>> = None;
        let mut category = None;
        let mut tag = None;
        let mut us = None;
        let mut name = None;
        let mut addr = None;
        let mut pool = None;
        let mut expandable = None;
        let mut blocks = None;
        let mut base = None;
        let mut unknown: Option<String> = None;

        while let Some(key) = map.next_key_seed(KeySeed)? {
            let key = match key {
                Ok(key) => key,
                Err(text) => {
                    // Reported once the op is known, so the message can list that op's keys.
                    map.next_value::<IgnoredAny>()?;
                    unknown.get_or_insert(text);
                    continue;
                }
            };
            if seen & key.bit() != 0 {
                return fail(slot, EventProblem::DuplicateKey { key: key.name() });
            }
            seen |= key.bit();
            if key == Key::Blocks {
                // The one key whose value is a container: decoded by its own visitor.
                let mut problem = None;
                match map.next_value_seed(BlocksSeed { slot: &mut problem }) {
                    Ok(list) => blocks = Some(list),
                    Err(e) => {
                        if let Some(problem) = problem {
                            *slot = Some(problem);
                        }
                        return Err(e);
                    }
                }
                continue;
            }
            let value: Scalar<'de> = map.next_value()?;
            let wrong = |field: &'static str, v: &Scalar<'_>| EventProblem::WrongType {
                field,
                found: v.describe(),
            };
            match key {
                Key::Op => match value {
                    Scalar::Str(s) => match Op::from_name(&s) {
                        Some(o) => op = Some(o),
                        None => return fail(slot, EventProblem::UnknownOp { op: s.into_owned() }),
                    },
                    v => return fail(slot, wrong("op", &v)),
                },
                Key::Id => match value {
                    Scalar::U64(n) => id = Some(AllocId::Int(n)),
                    Scalar::Str(s) => id = Some(AllocId::Str(s.into())),
                    v => {
                        return fail(
                            slot,
                            EventProblem::BadId {
                                found: v.describe(),
                            },
                        )
                    }
                },
                Key::Size => match value {
                    Scalar::U64(n) => size = Some(n),
                    Scalar::I64(_) => {
                        return fail(
                            slot,
                            EventProblem::SizeNegative {
                                found: value.text(),
                            },
                        )
                    }
                    Scalar::F64(x) => {
                        let found = value.text();
                        return fail(
                            slot,
                            if x < 0.0 {
                                EventProblem::SizeNegative { found }
                            } else if x.fract() == 0.0 && x >= 18_446_744_073_709_551_616.0 {
                                // serde_json reads integers past u64::MAX as floats.
                                EventProblem::SizeTooLarge { found }
                            } else {
                                EventProblem::SizeNotInteger { found }
                            },
                        );
                    }
                    v => return fail(slot, wrong("size", &v)),
                },
                Key::Stream => match value {
                    Scalar::U64(n) => stream = Some(Some(n)),
                    Scalar::Null => stream = Some(None),
                    v => return fail(slot, wrong("stream", &v)),
                },
                Key::Category => match value {
                    Scalar::Str(s) => match Category::from_name(&s) {
                        Some(c) => category = Some(c),
                        None => {
                            return fail(
                                slot,
                                EventProblem::UnknownCategory {
                                    category: s.into_owned(),
                                },
                            )
                        }
                    },
                    Scalar::Null => category = None,
                    v => return fail(slot, wrong("category", &v)),
                },
                Key::Tag => match value {
                    Scalar::Str(s) => tag = Some(std::sync::Arc::<str>::from(s)),
                    Scalar::Null => tag = None,
                    v => return fail(slot, wrong("tag", &v)),
                },
                Key::Us => {
                    let x = match value {
                        Scalar::U64(n) => n as f64,
                        Scalar::I64(n) => n as f64,
                        Scalar::F64(x) => x,
                        v => return fail(slot, wrong("us", &v)),
                    };
                    if let Err(p) = check_us(x) {
                        return fail(slot, p);
                    }
                    us = Some(x);
                }
                Key::Name => match value {
                    Scalar::Str(s) => name = Some(Box::<str>::from(s)),
                    v => return fail(slot, wrong("name", &v)),
                },
                Key::Addr => match value {
                    Scalar::U64(n) => addr = Some(n),
                    v => return fail(slot, wrong("addr", &v)),
                },
                Key::Pool => match value {
                    Scalar::Str(s) => match Pool::from_name(&s) {
                        Some(p) => pool = Some(p),
                        None => {
                            return fail(
                                slot,
                                EventProblem::UnknownPool {
                                    pool: s.into_owned(),
                                },
                            )
                        }
                    },
                    v => return fail(slot, wrong("pool", &v)),
                },
                Key::Expandable => match value {
                    Scalar::Bool(b) => expandable = Some(b),
                    Scalar::Null => expandable = None,
                    v => return fail(slot, wrong("expandable", &v)),
                },
                Key::Base => match value {
                    Scalar::U64(n) => base = Some(n),
                    Scalar::Null => base = None,
                    v => return fail(slot, wrong("base", &v)),
                },
                Key::Blocks => unreachable!("decoded above"),
            }
        }

        if let Some(key) = unknown {
            return fail(
                slot,
                EventProblem::UnknownKey {
                    key,
                    op: op.map(Op::name),
                },
            );
        }
        let Some(op) = op else {
            return fail(slot, EventProblem::MissingOp);
        };
        let extra = seen & !op.allowed();
        if let Some(k) = Key::ALL.into_iter().find(|k| extra & k.bit() != 0) {
            return fail(
                slot,
                EventProblem::UnknownKey {
                    key: k.name().to_owned(),
                    op: Some(op.name()),
                },
            );
        }
        if let Some(k) = op.required().iter().find(|k| seen & k.bit() == 0) {
            return fail(
                slot,
                EventProblem::MissingField {
                    field: k.name(),
                    op: op.name(),
                },
            );
        }

        // Every required key was seen, so the `unwrap_or` defaults below only fill optional fields.
        Ok(match op {
            Op::Alloc => Event::Alloc {
                id: id.unwrap_or(AllocId::Int(0)),
                size: size.unwrap_or(0),
                stream: stream.flatten().unwrap_or(0),
                category: category.unwrap_or_default(),
                tag,
            },
            Op::Free => Event::Free {
                id: id.unwrap_or(AllocId::Int(0)),
            },
            Op::RecordStream => match stream.flatten() {
                Some(stream) => Event::RecordStream {
                    id: id.unwrap_or(AllocId::Int(0)),
                    stream,
                },
                None => {
                    return fail(
                        slot,
                        EventProblem::WrongType {
                            field: "stream",
                            found: "null".to_owned(),
                        },
                    )
                }
            },
            Op::EmptyCache => Event::EmptyCache,
            Op::Compute => Event::Compute {
                stream: stream.flatten().unwrap_or(0),
                us: us.unwrap_or(0.0),
            },
            Op::Sync => Event::Sync {
                stream: stream.flatten(),
            },
            Op::Phase => Event::Phase {
                name: name.unwrap_or_default(),
            },
            Op::Segment => {
                let segment = InitialSegment {
                    addr: addr.unwrap_or(0),
                    size: size.unwrap_or(0),
                    stream: stream.flatten().unwrap_or(0),
                    pool: pool.unwrap_or(Pool::Large),
                    expandable: expandable.unwrap_or(false),
                    base,
                    blocks: blocks.unwrap_or_default(),
                };
                if let Err(p) = check_segment(&segment) {
                    return fail(slot, p);
                }
                Event::Segment(Box::new(segment))
            }
        })
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Event, E> {
        self.not_object("a boolean")
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Event, E> {
        self.not_object("a number")
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Event, E> {
        self.not_object("a number")
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Event, E> {
        self.not_object("a number")
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Event, E> {
        self.not_object("a string")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Event, E> {
        self.not_object("null")
    }
    fn visit_none<E: de::Error>(self) -> Result<Event, E> {
        self.not_object("null")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Event, A::Error> {
        self.not_object("an array")
    }
}

/// Checks a compute duration: finite and not negative.
pub(crate) fn check_us(us: f64) -> Result<(), EventProblem> {
    if !us.is_finite() {
        Err(EventProblem::DurationNotFinite { us })
    } else if us < 0.0 {
        Err(EventProblem::DurationNegative { us })
    } else {
        Ok(())
    }
}

/// Checks what the writers cannot write: an event whose text no reader would accept.
pub(crate) fn check_writable(event: &Event) -> Result<(), EventProblem> {
    match event {
        Event::Compute { us, .. } => check_us(*us),
        Event::Segment(segment) => check_segment(segment),
        _ => Ok(()),
    }
}

/// Checks what a `segment` says of itself: a non-empty range inside the address space, and blocks that
/// are not empty, hold at least their request, and lie in address order inside the segment without
/// overlapping.
pub(crate) fn check_segment(segment: &InitialSegment) -> Result<(), EventProblem> {
    if segment.size == 0 {
        return Err(EventProblem::EmptySegment);
    }
    if segment.addr.checked_add(segment.size).is_none() {
        return Err(EventProblem::SegmentPastAddressSpace {
            addr: segment.addr,
            size: segment.size,
        });
    }
    if let Some(base) = segment.base {
        if !segment.expandable || base > segment.addr {
            return Err(EventProblem::BadBase {
                base,
                addr: segment.expandable.then_some(segment.addr),
            });
        }
    }
    let mut previous_end = 0;
    for (index, b) in segment.blocks.iter().enumerate() {
        let problem = if b.size == 0 {
            Some(BlockProblem::Empty)
        } else if b.requested > b.size {
            Some(BlockProblem::RequestedTooLarge {
                requested: b.requested,
                size: b.size,
            })
        } else if b.offset < previous_end {
            Some(BlockProblem::Overlaps {
                offset: b.offset,
                previous_end,
            })
        } else if b
            .offset
            .checked_add(b.size)
            .is_none_or(|end| end > segment.size)
        {
            Some(BlockProblem::OutOfSegment {
                offset: b.offset,
                size: b.size,
                segment_size: segment.size,
            })
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(EventProblem::Block { index, problem });
        }
        previous_end = b.offset + b.size;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// The blocks of a `segment`.

/// Decodes a `segment`'s `blocks` array (`null` is no blocks), recording the problem of a bad block.
struct BlocksSeed<'a> {
    slot: &'a mut Option<EventProblem>,
}

impl<'de> DeserializeSeed<'de> for BlocksSeed<'_> {
    type Value = Vec<InitialBlock>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<InitialBlock>, D::Error> {
        d.deserialize_any(BlocksVisitor { slot: self.slot })
    }
}

struct BlocksVisitor<'a> {
    slot: &'a mut Option<EventProblem>,
}

impl BlocksVisitor<'_> {
    fn not_array<T, E: de::Error>(self, found: &str) -> Result<T, E> {
        fail(
            self.slot,
            EventProblem::WrongType {
                field: "blocks",
                found: found.to_owned(),
            },
        )
    }
}

impl<'de> Visitor<'de> for BlocksVisitor<'_> {
    type Value = Vec<InitialBlock>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of blocks")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<InitialBlock>, A::Error> {
        let mut blocks = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 12));
        loop {
            let index = blocks.len();
            let mut problem = None;
            match seq.next_element_seed(BlockSeed { slot: &mut problem }) {
                Ok(Some(block)) => blocks.push(block),
                Ok(None) => return Ok(blocks),
                Err(e) => {
                    if let Some(problem) = problem {
                        *self.slot = Some(EventProblem::Block { index, problem });
                    }
                    return Err(e);
                }
            }
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Vec<InitialBlock>, E> {
        Ok(Vec::new())
    }
    fn visit_none<E: de::Error>(self) -> Result<Vec<InitialBlock>, E> {
        Ok(Vec::new())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Vec<InitialBlock>, E> {
        self.not_array(&v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Vec<InitialBlock>, E> {
        self.not_array(&format!("the number {v}"))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Vec<InitialBlock>, E> {
        self.not_array(&format!("the number {v}"))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Vec<InitialBlock>, E> {
        self.not_array(&format!("the number {v:?}"))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<InitialBlock>, E> {
        self.not_array(&format!("the string {:?}", shorten(v)))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Vec<InitialBlock>, A::Error> {
        self.not_array("an object")
    }
}

/// A key of a block object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKey {
    Id = 0,
    Offset,
    Size,
    Requested,
    Category,
    Tag,
}

impl BlockKey {
    const NAMES: [&'static str; 6] = ["id", "offset", "size", "requested", "category", "tag"];

    fn name(self) -> &'static str {
        BlockKey::NAMES[self as usize]
    }

    fn from_name(s: &str) -> Option<BlockKey> {
        Some(match s {
            "id" => BlockKey::Id,
            "offset" => BlockKey::Offset,
            "size" => BlockKey::Size,
            "requested" => BlockKey::Requested,
            "category" => BlockKey::Category,
            "tag" => BlockKey::Tag,
            _ => return None,
        })
    }
}

/// Decodes one block object, recording a typed problem in `slot`.
struct BlockSeed<'a> {
    slot: &'a mut Option<BlockProblem>,
}

impl<'de> DeserializeSeed<'de> for BlockSeed<'_> {
    type Value = InitialBlock;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<InitialBlock, D::Error> {
        d.deserialize_any(BlockVisitor { slot: self.slot })
    }
}

struct BlockVisitor<'a> {
    slot: &'a mut Option<BlockProblem>,
}

fn fail_block<T, E: de::Error>(slot: &mut Option<BlockProblem>, p: BlockProblem) -> Result<T, E> {
    *slot = Some(p);
    Err(E::custom(RECORDED))
}

impl BlockVisitor<'_> {
    fn not_object<T, E: de::Error>(self, found: String) -> Result<T, E> {
        fail_block(self.slot, BlockProblem::NotAnObject { found })
    }
}

impl<'de> Visitor<'de> for BlockVisitor<'_> {
    type Value = InitialBlock;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a block object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<InitialBlock, A::Error> {
        let slot = self.slot;
        let mut seen = 0u8;
        let (mut id, mut offset, mut size, mut requested) = (None, None, None, None);
        let (mut category, mut tag) = (None, None);
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            let Some(key) = BlockKey::from_name(&key) else {
                return fail_block(
                    slot,
                    BlockProblem::UnknownKey {
                        key: shorten(&key).into_owned(),
                    },
                );
            };
            let bit = 1u8 << key as u8;
            if seen & bit != 0 {
                return fail_block(slot, BlockProblem::DuplicateKey { key: key.name() });
            }
            seen |= bit;
            let value: Scalar<'de> = map.next_value()?;
            let wrong = |v: &Scalar<'_>| BlockProblem::WrongType {
                field: key.name(),
                found: v.describe(),
            };
            match key {
                BlockKey::Id => match value {
                    Scalar::U64(n) => id = Some(AllocId::Int(n)),
                    Scalar::Str(s) => id = Some(AllocId::Str(s.into())),
                    v => return fail_block(slot, wrong(&v)),
                },
                BlockKey::Offset | BlockKey::Size | BlockKey::Requested => match value {
                    Scalar::U64(n) => match key {
                        BlockKey::Offset => offset = Some(n),
                        BlockKey::Size => size = Some(n),
                        _ => requested = Some(n),
                    },
                    v => return fail_block(slot, wrong(&v)),
                },
                BlockKey::Category => match value {
                    Scalar::Str(s) => match Category::from_name(&s) {
                        Some(c) => category = Some(c),
                        None => {
                            return fail_block(
                                slot,
                                BlockProblem::UnknownCategory {
                                    category: s.into_owned(),
                                },
                            )
                        }
                    },
                    Scalar::Null => category = None,
                    v => return fail_block(slot, wrong(&v)),
                },
                BlockKey::Tag => match value {
                    Scalar::Str(s) => tag = Some(Box::<str>::from(s)),
                    Scalar::Null => tag = None,
                    v => return fail_block(slot, wrong(&v)),
                },
            }
        }
        let (Some(id), Some(offset), Some(size)) = (id, offset, size) else {
            let field = if seen & 1 == 0 {
                "id"
            } else if seen & 2 == 0 {
                "offset"
            } else {
                "size"
            };
            return fail_block(slot, BlockProblem::MissingField { field });
        };
        Ok(InitialBlock {
            id,
            offset,
            size,
            requested: requested.unwrap_or(size),
            category: category.unwrap_or_default(),
            tag,
        })
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<InitialBlock, E> {
        self.not_object(v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<InitialBlock, E> {
        self.not_object(format!("the number {v}"))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<InitialBlock, E> {
        self.not_object(format!("the number {v}"))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<InitialBlock, E> {
        self.not_object(format!("the number {v:?}"))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<InitialBlock, E> {
        self.not_object(format!("the string {:?}", shorten(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<InitialBlock, E> {
        self.not_object("null".to_owned())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<InitialBlock, A::Error> {
        self.not_object("an array".to_owned())
    }
}

/// Decodes one event with the error messages of this crate (as `serde::de::Error::custom` text).
impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Event, D::Error> {
        let mut slot = None;
        EventSeed { slot: &mut slot }
            .deserialize(d)
            .map_err(|e| match slot {
                Some(problem) => de::Error::custom(problem),
                None => e,
            })
    }
}

/// Writes an event as its trace-file object (`{"op":"free","id":1}`); defaults are written out, except
/// an absent `tag` and a device-wide `sync`'s `stream`.
impl Serialize for Event {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Event::Alloc {
                id,
                size,
                stream,
                category,
                tag,
            } => {
                let mut m = s.serialize_map(Some(5 + usize::from(tag.is_some())))?;
                m.serialize_entry("op", "alloc")?;
                m.serialize_entry("id", id)?;
                m.serialize_entry("size", size)?;
                m.serialize_entry("stream", stream)?;
                m.serialize_entry("category", category.name())?;
                if let Some(tag) = tag {
                    m.serialize_entry("tag", &**tag)?;
                }
                m.end()
            }
            Event::Free { id } => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("op", "free")?;
                m.serialize_entry("id", id)?;
                m.end()
            }
            Event::RecordStream { id, stream } => {
                let mut m = s.serialize_map(Some(3))?;
                m.serialize_entry("op", "record_stream")?;
                m.serialize_entry("id", id)?;
                m.serialize_entry("stream", stream)?;
                m.end()
            }
            Event::EmptyCache => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("op", "empty_cache")?;
                m.end()
            }
            Event::Compute { stream, us } => {
                check_us(*us).map_err(ser::Error::custom)?;
                let mut m = s.serialize_map(Some(3))?;
                m.serialize_entry("op", "compute")?;
                m.serialize_entry("stream", stream)?;
                m.serialize_entry("us", us)?;
                m.end()
            }
            Event::Sync { stream } => {
                let mut m = s.serialize_map(Some(1 + usize::from(stream.is_some())))?;
                m.serialize_entry("op", "sync")?;
                if let Some(stream) = stream {
                    m.serialize_entry("stream", stream)?;
                }
                m.end()
            }
            Event::Phase { name } => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("op", "phase")?;
                m.serialize_entry("name", name)?;
                m.end()
            }
            Event::Segment(segment) => {
                check_segment(segment).map_err(ser::Error::custom)?;
                let mut m = s.serialize_map(Some(7 + usize::from(segment.base.is_some())))?;
                m.serialize_entry("op", "segment")?;
                m.serialize_entry("addr", &segment.addr)?;
                m.serialize_entry("size", &segment.size)?;
                m.serialize_entry("stream", &segment.stream)?;
                m.serialize_entry("pool", segment.pool.name())?;
                m.serialize_entry("expandable", &segment.expandable)?;
                if let Some(base) = segment.base {
                    m.serialize_entry("base", &base)?;
                }
                m.serialize_entry("blocks", &segment.blocks)?;
                m.end()
            }
        }
    }
}

/// Writes a block of a `segment` (`{"id":1,"offset":0,"size":512,"requested":500}`); `category` is
/// written unless it is `other`, `tag` when present.
impl Serialize for InitialBlock {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let other = self.category == Category::Other;
        let len = 4 + usize::from(!other) + usize::from(self.tag.is_some());
        let mut m = s.serialize_map(Some(len))?;
        m.serialize_entry("id", &self.id)?;
        m.serialize_entry("offset", &self.offset)?;
        m.serialize_entry("size", &self.size)?;
        m.serialize_entry("requested", &self.requested)?;
        if !other {
            m.serialize_entry("category", self.category.name())?;
        }
        if let Some(tag) = &self.tag {
            m.serialize_entry("tag", tag)?;
        }
        m.end()
    }
}

/// Writes an id as a JSON integer or string.
impl Serialize for AllocId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AllocId::Int(n) => s.serialize_u64(*n),
            AllocId::Str(v) => s.serialize_str(v),
        }
    }
}

/// Reads an id from a non-negative JSON integer or a string.
impl<'de> Deserialize<'de> for AllocId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<AllocId, D::Error> {
        match Scalar::deserialize(d)? {
            Scalar::U64(n) => Ok(AllocId::Int(n)),
            Scalar::Str(s) => Ok(AllocId::Str(s.into())),
            v => Err(de::Error::custom(EventProblem::BadId {
                found: v.describe(),
            })),
        }
    }
}

/// Writes a category as its name (`"optimizer_state"`).
impl Serialize for Category {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Reads a category from its name.
impl<'de> Deserialize<'de> for Category {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Category, D::Error> {
        match Scalar::deserialize(d)? {
            Scalar::Str(s) => Category::from_name(&s).ok_or_else(|| {
                de::Error::custom(EventProblem::UnknownCategory {
                    category: s.into_owned(),
                })
            }),
            v => Err(de::Error::custom(EventProblem::WrongType {
                field: "category",
                found: v.describe(),
            })),
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Headers and whole documents.

/// A problem recorded while decoding a header or a whole document.
pub(crate) enum DocProblem {
    Header(HeaderProblem),
    Event { index: u64, problem: EventProblem },
}

/// What a header (or a whole document's top level) held.
pub(crate) struct Doc {
    pub(crate) meta: Meta,
    pub(crate) events: Option<Vec<Event>>,
}

/// Decodes a header object; with `events` set, a whole document (the header keys plus `events`).
pub(crate) struct DocSeed<'a> {
    pub(crate) slot: &'a mut Option<DocProblem>,
    pub(crate) events: bool,
}

impl<'de> DeserializeSeed<'de> for DocSeed<'_> {
    type Value = Doc;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Doc, D::Error> {
        d.deserialize_any(DocVisitor {
            slot: self.slot,
            events: self.events,
        })
    }
}

struct DocVisitor<'a> {
    slot: &'a mut Option<DocProblem>,
    events: bool,
}

fn fail_header<T, E: de::Error>(slot: &mut Option<DocProblem>, p: HeaderProblem) -> Result<T, E> {
    *slot = Some(DocProblem::Header(p));
    Err(E::custom(RECORDED))
}

impl DocVisitor<'_> {
    fn not_object<T, E: de::Error>(self, found: &str) -> Result<T, E> {
        fail_header(
            self.slot,
            HeaderProblem::NotAnObject {
                found: found.to_owned(),
            },
        )
    }
}

impl<'de> Visitor<'de> for DocVisitor<'_> {
    type Value = Doc;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a trace header object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Doc, A::Error> {
        let slot = self.slot;
        let (mut format, mut version, mut meta, mut events) = (false, false, None, None);
        while let Some(key) = map.next_key::<String>()? {
            let (seen, name) = match &*key {
                "format" => (format, "format"),
                "version" => (version, "version"),
                "meta" => (meta.is_some(), "meta"),
                "events" if self.events => (events.is_some(), "events"),
                "events" => return fail_header(slot, HeaderProblem::EventsInJsonLines),
                _ => {
                    return fail_header(
                        slot,
                        HeaderProblem::UnknownKey {
                            key: shorten(&key).into_owned(),
                        },
                    )
                }
            };
            if seen {
                return fail_header(slot, HeaderProblem::DuplicateKey { key: name });
            }
            match name {
                "format" => {
                    let v: Scalar<'de> = map.next_value()?;
                    if !matches!(&v, Scalar::Str(s) if s == FORMAT_NAME) {
                        return fail_header(slot, HeaderProblem::WrongFormat { found: v.text() });
                    }
                    format = true;
                }
                "version" => {
                    let v: Scalar<'de> = map.next_value()?;
                    if !matches!(v, Scalar::U64(FORMAT_VERSION)) {
                        return fail_header(
                            slot,
                            HeaderProblem::UnsupportedVersion { found: v.text() },
                        );
                    }
                    version = true;
                }
                "meta" => match map.next_value::<serde_json::Value>()? {
                    serde_json::Value::Object(m) => meta = Some(m),
                    other => {
                        return fail_header(
                            slot,
                            HeaderProblem::MetaNotObject {
                                found: describe_value(&other),
                            },
                        )
                    }
                },
                _ => {
                    let mut problem = None;
                    let got = map.next_value_seed(EventsSeed { slot: &mut problem });
                    match (got, problem) {
                        (Ok(list), _) => events = Some(list),
                        (Err(e), None) => return Err(e),
                        (Err(e), Some(p)) => {
                            // `e` already carries the line and column of the bad event.
                            *slot = Some(p);
                            return Err(e);
                        }
                    }
                }
            }
        }
        if !format {
            return fail_header(slot, HeaderProblem::MissingFormat);
        }
        if !version {
            return fail_header(slot, HeaderProblem::MissingVersion);
        }
        if self.events && events.is_none() {
            return fail_header(slot, HeaderProblem::MissingEvents);
        }
        Ok(Doc {
            meta: meta.unwrap_or_default(),
            events,
        })
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Doc, E> {
        self.not_object("a boolean")
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Doc, E> {
        self.not_object("a number")
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Doc, E> {
        self.not_object("a number")
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Doc, E> {
        self.not_object("a number")
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Doc, E> {
        self.not_object("a string")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Doc, E> {
        self.not_object("null")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Doc, A::Error> {
        self.not_object("an array")
    }
}

fn describe_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "null".to_owned(),
        serde_json::Value::Bool(b) => b.to_string(),
        serde_json::Value::Number(n) => format!("the number {n}"),
        serde_json::Value::String(s) => format!("the string {:?}", shorten(s)),
        serde_json::Value::Array(_) => "an array".to_owned(),
        serde_json::Value::Object(_) => "an object".to_owned(),
    }
}

/// Decodes the `events` array of a whole document, numbering the events for error messages.
struct EventsSeed<'a> {
    slot: &'a mut Option<DocProblem>,
}

impl<'de> DeserializeSeed<'de> for EventsSeed<'_> {
    type Value = Vec<Event>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Event>, D::Error> {
        d.deserialize_any(EventsVisitor { slot: self.slot })
    }
}

struct EventsVisitor<'a> {
    slot: &'a mut Option<DocProblem>,
}

impl EventsVisitor<'_> {
    fn not_array<T, E: de::Error>(self, found: &str) -> Result<T, E> {
        fail_header(
            self.slot,
            HeaderProblem::EventsNotArray {
                found: found.to_owned(),
            },
        )
    }
}

impl<'de> Visitor<'de> for EventsVisitor<'_> {
    type Value = Vec<Event>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of events")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Event>, A::Error> {
        let mut events = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        let mut index = 0u64;
        loop {
            let mut problem = None;
            match seq.next_element_seed(EventSeed { slot: &mut problem }) {
                Ok(Some(event)) => events.push(event),
                Ok(None) => return Ok(events),
                Err(e) => {
                    if let Some(problem) = problem {
                        *self.slot = Some(DocProblem::Event { index, problem });
                    }
                    return Err(e);
                }
            }
            index += 1;
        }
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Vec<Event>, E> {
        self.not_array("a boolean")
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Vec<Event>, E> {
        self.not_array("a number")
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Vec<Event>, E> {
        self.not_array("a number")
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Vec<Event>, E> {
        self.not_array("a number")
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Vec<Event>, E> {
        self.not_array("a string")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Vec<Event>, E> {
        self.not_array("null")
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Vec<Event>, A::Error> {
        self.not_array("an object")
    }
}

// ---------------------------------------------------------------------------------------------------
// Sniffing.

/// The top-level shape of one JSON value, found without building it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Probe {
    pub(crate) is_object: bool,
    pub(crate) has_op: bool,
    pub(crate) has_events: bool,
}

impl<'de> Deserialize<'de> for Probe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Probe, D::Error> {
        d.deserialize_any(ProbeVisitor)
    }
}

struct ProbeVisitor;

/// A top-level key, as far as sniffing cares.
enum ProbeKey {
    Op,
    Events,
    Other,
}

impl<'de> Deserialize<'de> for ProbeKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ProbeKey, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ProbeKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, v: &str) -> Result<ProbeKey, E> {
                Ok(match v {
                    "op" => ProbeKey::Op,
                    "events" => ProbeKey::Events,
                    _ => ProbeKey::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de> Visitor<'de> for ProbeVisitor {
    type Value = Probe;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Probe, A::Error> {
        let mut p = Probe {
            is_object: true,
            ..Probe::default()
        };
        while let Some(key) = map.next_key::<ProbeKey>()? {
            map.next_value::<IgnoredAny>()?;
            match key {
                ProbeKey::Op => p.has_op = true,
                ProbeKey::Events => p.has_events = true,
                ProbeKey::Other => {}
            }
        }
        Ok(p)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Probe, E> {
        Ok(Probe::default())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Probe, E> {
        Ok(Probe::default())
    }
    fn visit_u64<E>(self, _: u64) -> Result<Probe, E> {
        Ok(Probe::default())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Probe, E> {
        Ok(Probe::default())
    }
    fn visit_str<E>(self, _: &str) -> Result<Probe, E> {
        Ok(Probe::default())
    }
    fn visit_unit<E>(self) -> Result<Probe, E> {
        Ok(Probe::default())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Probe, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Probe::default())
    }
}

// ---------------------------------------------------------------------------------------------------
// serde_json errors to TraceErrors.

/// serde_json's message without its ` at line L column C` suffix.
pub(crate) fn bare_message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&suffix) {
        Some(s) => s.to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_and_keys_agree_with_the_contract() {
        for (i, name) in OPS.iter().enumerate() {
            let op = Op::from_name(name).unwrap();
            assert_eq!(op as usize, i);
            assert_eq!(op.name(), *name);
            // Every op takes `op`, and requires only keys it takes.
            assert_ne!(op.allowed() & Key::Op.bit(), 0);
            for k in op.required() {
                assert_ne!(op.allowed() & k.bit(), 0, "{name} requires {}", k.name());
            }
            // The error text lists exactly the keys the op takes.
            let listed = crate::error::op_keys(name);
            for k in Key::ALL {
                let takes = op.allowed() & k.bit() != 0;
                let word_listed = listed
                    .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                    .any(|w| w == k.name());
                assert_eq!(takes, word_listed, "{name}: {} in {listed:?}", k.name());
            }
        }
        for (i, k) in Key::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i);
            assert_eq!(
                KeyVisitor.visit_str::<serde_json::Error>(k.name()).unwrap(),
                Ok(*k)
            );
        }
    }

    #[test]
    fn shorten_cuts_long_text_on_char_boundaries() {
        assert_eq!(shorten("abc"), "abc");
        let long = "é".repeat(100);
        let cut = shorten(&long);
        assert_eq!(cut, format!("{}...", "é".repeat(60)));
        assert_eq!(shorten(&"x".repeat(60)), "x".repeat(60));
    }

    #[test]
    fn bare_message_drops_the_position() {
        let e = serde_json::from_str::<serde_json::Value>("{\"a\":}").unwrap_err();
        assert_eq!(e.to_string(), "expected value at line 1 column 6");
        assert_eq!(bare_message(&e), "expected value");
    }

    #[test]
    fn probe_sees_top_level_keys_only() {
        let p: Probe = serde_json::from_str(r#"{"x":{"op":1,"events":2},"events":[]}"#).unwrap();
        assert!(p.is_object && p.has_events && !p.has_op);
        let p: Probe = serde_json::from_str(r#"[{"op":1}]"#).unwrap();
        assert!(!p.is_object && !p.has_op);
    }
}
