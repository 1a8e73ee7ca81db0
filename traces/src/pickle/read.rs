//! The unpickler: a stack machine over pickle opcodes (CPython's `pickle._Unpickler`, plain data only).

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;

use super::{PickleError, PickleErrorKind as Kind, Value};

/// The deepest nesting of containers the reader accepts (real snapshots nest six deep). Deeper input
/// is rejected with [`Kind::TooDeep`] rather than risking the stack of whoever walks the value.
pub const MAX_DEPTH: usize = 256;

/// Python's default limit on the digits of an int written as text (`sys.get_int_max_str_digits()`).
const MAX_INT_DIGITS: usize = 4300;

/// Reads one pickle from `reader` (to its end; bytes after `STOP` are ignored, as `pickle.load` does).
pub fn from_reader<R: Read>(mut reader: R) -> Result<Value, PickleError> {
    let mut data = Vec::new();
    reader.read_to_end(&mut data).map_err(|e| PickleError {
        offset: data.len() as u64,
        kind: Kind::Io(e),
    })?;
    from_slice(&data)
}

/// Reads one pickle from `data`. Bytes after `STOP` are ignored, as `pickle.loads` does.
pub fn from_slice(data: &[u8]) -> Result<Value, PickleError> {
    match data.first() {
        None => {
            return Err(PickleError {
                offset: 0,
                kind: Kind::Empty,
            })
        }
        Some(&b) if opcode_name(b).is_none() => {
            return Err(PickleError {
                offset: 0,
                kind: Kind::NotAPickle(b),
            })
        }
        Some(_) => {}
    }
    Unpickler::new(data).run()
}

/// What the stack and the memo hold while reading: a finished value, or a container still in the
/// arena (lists and dicts stay mutable until `STOP`).
#[derive(Clone)]
enum Item {
    V(Value),
    N(u32),
}

enum Node {
    List(Vec<Item>),
    Dict(Vec<(Item, Item)>),
    Tuple(Vec<Item>),
}

/// Freezing state of one arena node.
enum Slot {
    Todo,
    InProgress,
    Done(Value),
}

struct Unpickler<'a> {
    data: &'a [u8],
    pos: usize,
    /// Offset and name of the opcode being executed, for errors.
    op_start: usize,
    op: &'static str,
    stack: Vec<Item>,
    /// Stack lengths at each open `MARK` (CPython's metastack).
    marks: Vec<usize>,
    memo: Vec<Option<Item>>,
    /// Memo keys far beyond the dense part (hand-written `PUT 1000000`), kept out of `memo`.
    memo_sparse: HashMap<u64, Item>,
    memo_count: u64,
    nodes: Vec<Node>,
    node_offsets: Vec<usize>,
}

impl<'a> Unpickler<'a> {
    fn new(data: &'a [u8]) -> Self {
        Unpickler {
            data,
            pos: 0,
            op_start: 0,
            op: "",
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_sparse: HashMap::new(),
            memo_count: 0,
            nodes: Vec::new(),
            node_offsets: Vec::new(),
        }
    }

    fn err(&self, kind: Kind) -> PickleError {
        PickleError {
            offset: self.op_start as u64,
            kind,
        }
    }

    fn bad_arg(&self, text: &[u8], why: &'static str) -> PickleError {
        self.err(Kind::BadArgument {
            opcode: self.op,
            text: String::from_utf8_lossy(&text[..text.len().min(80)]).into_owned(),
            why,
        })
    }

    // ----- reading arguments -----

    fn take(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let available = (self.data.len() - self.pos) as u64;
        if n > available {
            return Err(self.err(Kind::Truncated {
                opcode: self.op,
                needed: n,
                available,
            }));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.data[start..self.pos])
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let bytes = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.arr::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }

    fn i32(&mut self) -> Result<i32, PickleError> {
        Ok(i32::from_le_bytes(self.arr()?))
    }

    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    /// A signed 4-byte length (`BINSTRING`, `LONG4`): negative is an error, as in CPython.
    fn len_i32(&mut self) -> Result<u64, PickleError> {
        let n = self.i32()?;
        u64::try_from(n).map_err(|_| self.bad_arg(n.to_string().as_bytes(), "negative length"))
    }

    /// A protocol-0 text argument, up to (not including) its newline.
    fn line(&mut self) -> Result<&'a [u8], PickleError> {
        let rest = &self.data[self.pos..];
        match rest.iter().position(|&b| b == b'\n') {
            Some(i) => {
                self.pos += i + 1;
                Ok(&rest[..i])
            }
            None => Err(self.err(Kind::MissingNewline { opcode: self.op })),
        }
    }

    fn line_u64(&mut self) -> Result<u64, PickleError> {
        let line = self.line()?;
        std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| self.bad_arg(line, "expected a non-negative decimal integer"))
    }

    // ----- the stack -----

    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn push(&mut self, item: Item) {
        self.stack.push(item);
    }

    fn push_v(&mut self, value: Value) {
        self.stack.push(Item::V(value));
    }

    fn need(&self, n: usize) -> Result<(), PickleError> {
        if self.stack.len() < self.fence() + n {
            return Err(self.err(Kind::StackUnderflow {
                opcode: self.op,
                needed: n,
            }));
        }
        Ok(())
    }

    fn pop(&mut self) -> Result<Item, PickleError> {
        self.need(1)?;
        Ok(self.stack.pop().expect("need(1) checked the stack"))
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Item>, PickleError> {
        self.need(n)?;
        Ok(self.stack.split_off(self.stack.len() - n))
    }

    /// Everything above the last `MARK`, removing the mark.
    fn pop_mark(&mut self) -> Result<Vec<Item>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.err(Kind::MarkNotFound { opcode: self.op }))?;
        Ok(self.stack.split_off(mark))
    }

    fn top(&self) -> Result<&Item, PickleError> {
        self.need(1)?;
        Ok(self.stack.last().expect("need(1) checked the stack"))
    }

    fn found(&self, item: &Item) -> &'static str {
        match item {
            Item::V(v) => v.type_name(),
            Item::N(i) => match self.nodes[*i as usize] {
                Node::List(_) => "list",
                Node::Dict(_) => "dict",
                Node::Tuple(_) => "tuple",
            },
        }
    }

    /// The list on top of the stack (for `APPEND`/`APPENDS`).
    fn top_list(&mut self) -> Result<&mut Vec<Item>, PickleError> {
        let (index, err) = self.top_node("list")?;
        match index.map(|i| &mut self.nodes[i]) {
            Some(Node::List(items)) => Ok(items),
            _ => Err(err),
        }
    }

    /// The dict on top of the stack (for `SETITEM`/`SETITEMS`).
    fn top_dict(&mut self) -> Result<&mut Vec<(Item, Item)>, PickleError> {
        let (index, err) = self.top_node("dict")?;
        match index.map(|i| &mut self.nodes[i]) {
            Some(Node::Dict(entries)) => Ok(entries),
            _ => Err(err),
        }
    }

    /// The arena index of the top of the stack, and the error to give if it is not an `expected`.
    fn top_node(
        &self,
        expected: &'static str,
    ) -> Result<(Option<usize>, PickleError), PickleError> {
        let top = self.top()?;
        let found = self.found(top);
        let index = match top {
            Item::N(i) => Some(*i as usize),
            Item::V(_) => None,
        };
        Ok((
            index,
            self.err(Kind::WrongType {
                opcode: self.op,
                expected,
                found,
            }),
        ))
    }

    fn new_node(&mut self, node: Node) -> Result<Item, PickleError> {
        let index = u32::try_from(self.nodes.len())
            .map_err(|_| self.bad_arg(b"", "more than 2**32 containers"))?;
        self.nodes.push(node);
        self.node_offsets.push(self.op_start);
        Ok(Item::N(index))
    }

    /// A tuple: built at once when its items are scalars (the common `(0, 0)` pool id), in the arena
    /// otherwise (so nesting depth is checked when freezing).
    fn new_tuple(&mut self, items: Vec<Item>) -> Result<Item, PickleError> {
        let flat = items.iter().all(|item| match item {
            Item::V(Value::Tuple(t)) => t.is_empty(),
            Item::V(_) => true,
            Item::N(_) => false,
        });
        if flat {
            let values = items
                .into_iter()
                .map(|item| match item {
                    Item::V(v) => v,
                    Item::N(_) => Value::None, // unreachable: `flat` holds only values
                })
                .collect();
            Ok(Item::V(Value::tuple(values)))
        } else {
            self.new_node(Node::Tuple(items))
        }
    }

    fn pairs(&self, items: Vec<Item>) -> Result<Vec<(Item, Item)>, PickleError> {
        if items.len() % 2 == 1 {
            return Err(self.err(Kind::OddItems {
                opcode: self.op,
                count: items.len(),
            }));
        }
        let mut pairs = Vec::with_capacity(items.len() / 2);
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            pairs.push((k, v));
        }
        Ok(pairs)
    }

    // ----- the memo -----

    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        let item = self.top()?.clone();
        let dense = self.memo.len() as u64;
        if key < dense {
            let slot = &mut self.memo[key as usize];
            if slot.is_none() {
                self.memo_count += 1;
            }
            *slot = Some(item);
        } else if key == dense {
            if self.memo_sparse.remove(&key).is_none() {
                self.memo_count += 1;
            }
            self.memo.push(Some(item));
        } else if self.memo_sparse.insert(key, item).is_none() {
            self.memo_count += 1;
        }
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let item = usize::try_from(key)
            .ok()
            .and_then(|k| self.memo.get(k))
            .and_then(|slot| slot.as_ref())
            .or_else(|| self.memo_sparse.get(&key))
            .cloned()
            .ok_or_else(|| self.err(Kind::MemoKeyNotFound(key)))?;
        self.push(item);
        Ok(())
    }

    // ----- the opcodes -----

    fn run(mut self) -> Result<Value, PickleError> {
        loop {
            self.op_start = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(self.err(Kind::MissingStop));
            };
            self.pos += 1;
            self.op = opcode_name(op).unwrap_or("?");
            match op {
                // -- framing and control
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(self.err(Kind::UnsupportedProtocol(proto)));
                    }
                }
                0x95 => {
                    self.u64()?; // FRAME: a length hint; the frame's opcodes follow inline
                }
                b'.' => {
                    let root = self.pop()?;
                    return self.freeze_root(root);
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    // POP: with nothing above the mark, CPython pops the mark itself
                    if self.stack.len() > self.fence() {
                        self.stack.pop();
                    } else {
                        self.pop_mark()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.top()?.clone();
                    self.push(top);
                }

                // -- constants and numbers
                b'N' => self.push_v(Value::None),
                0x88 => self.push_v(Value::Bool(true)),
                0x89 => self.push_v(Value::Bool(false)),
                b'J' => {
                    let n = self.i32()?;
                    self.push_v(Value::Int(n.into()));
                }
                b'K' => {
                    let n = self.u8()?;
                    self.push_v(Value::Int(n.into()));
                }
                b'M' => {
                    let n = u16::from_le_bytes(self.arr()?);
                    self.push_v(Value::Int(n.into()));
                }
                0x8a => {
                    let n = self.u8()?;
                    let bytes = self.take(n.into())?;
                    self.push_v(decode_long(bytes));
                }
                0x8b => {
                    let n = self.len_i32()?;
                    let bytes = self.take(n)?;
                    self.push_v(decode_long(bytes));
                }
                b'I' => {
                    let line = self.line()?;
                    let value = match trim(line) {
                        b"00" => Value::Bool(false),
                        b"01" => Value::Bool(true),
                        text => parse_decimal(text).map_err(|why| self.bad_arg(line, why))?,
                    };
                    self.push_v(value);
                }
                b'L' => {
                    let line = self.line()?;
                    let text = trim(line);
                    let text = text.strip_suffix(b"L").unwrap_or(text);
                    let value = parse_decimal(text).map_err(|why| self.bad_arg(line, why))?;
                    self.push_v(value);
                }
                b'G' => {
                    let x = f64::from_be_bytes(self.arr()?);
                    self.push_v(Value::Float(x));
                }
                b'F' => {
                    let line = self.line()?;
                    let x = std::str::from_utf8(trim(line))
                        .ok()
                        .and_then(|s| s.parse::<f64>().ok())
                        .ok_or_else(|| self.bad_arg(line, "expected a float"))?;
                    self.push_v(Value::Float(x));
                }

                // -- strings and bytes
                0x8c => {
                    let n = self.u8()?;
                    let s = self.take(n.into())?;
                    self.push_v(Value::Str(utf8(s)));
                }
                b'X' => {
                    let n = self.u32()?;
                    let s = self.take(n.into())?;
                    self.push_v(Value::Str(utf8(s)));
                }
                0x8d => {
                    let n = self.u64()?;
                    let s = self.take(n)?;
                    self.push_v(Value::Str(utf8(s)));
                }
                b'V' => {
                    let line = self.line()?;
                    self.push_v(Value::Str(raw_unicode_escape(line).into()));
                }
                b'C' => {
                    let n = self.u8()?;
                    let b = self.take(n.into())?;
                    self.push_v(Value::Bytes(b.into()));
                }
                b'B' => {
                    let n = self.u32()?;
                    let b = self.take(n.into())?;
                    self.push_v(Value::Bytes(b.into()));
                }
                0x8e | 0x96 => {
                    let n = self.u64()?;
                    let b = self.take(n)?;
                    self.push_v(Value::Bytes(b.into()));
                }
                b'U' | b'T' => {
                    // Python 2 str: Python 3 decodes it as ASCII by default
                    let n = if op == b'U' {
                        self.u8()?.into()
                    } else {
                        self.len_i32()?
                    };
                    let b = self.take(n)?;
                    if !b.is_ascii() {
                        return Err(self.bad_arg(b, "Python 2 str with non-ASCII bytes"));
                    }
                    self.push_v(Value::Str(utf8(b)));
                }

                // -- containers
                b')' => self.push_v(Value::tuple(Vec::new())),
                b']' => {
                    let item = self.new_node(Node::List(Vec::new()))?;
                    self.push(item);
                }
                b'}' => {
                    let item = self.new_node(Node::Dict(Vec::new()))?;
                    self.push(item);
                }
                0x85..=0x87 => {
                    let items = self.pop_n(usize::from(op - 0x84))?;
                    let item = self.new_tuple(items)?;
                    self.push(item);
                }
                b't' => {
                    let items = self.pop_mark()?;
                    let item = self.new_tuple(items)?;
                    self.push(item);
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    let item = self.new_node(Node::List(items))?;
                    self.push(item);
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    let item = self.new_node(Node::Dict(pairs))?;
                    self.push(item);
                }
                b'a' => {
                    let item = self.pop()?;
                    self.top_list()?.push(item);
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.top_list()?.extend(items);
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.top_dict()?.push((key, value));
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    self.top_dict()?.extend(pairs);
                }

                // -- the memo
                0x94 => {
                    let key = self.memo_count;
                    self.memo_put(key)?;
                }
                b'q' => {
                    let key = self.u8()?;
                    self.memo_put(key.into())?;
                }
                b'r' => {
                    let key = self.u32()?;
                    self.memo_put(key.into())?;
                }
                b'p' => {
                    let key = self.line_u64()?;
                    self.memo_put(key)?;
                }
                b'h' => {
                    let key = self.u8()?;
                    self.memo_get(key.into())?;
                }
                b'j' => {
                    let key = self.u32()?;
                    self.memo_get(key.into())?;
                }
                b'g' => {
                    let key = self.line_u64()?;
                    self.memo_get(key)?;
                }

                // -- valid, but not plain data
                b'c' | b'i' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let what = format!(
                        "it would import {}.{}; only plain data (dict, list, tuple, str, bytes, int, \
                         float, bool, None) is supported",
                        String::from_utf8_lossy(module),
                        String::from_utf8_lossy(name)
                    );
                    return Err(self.err(Kind::UnsupportedOpcode {
                        name: self.op,
                        why: what,
                    }));
                }
                0x93 => {
                    let n = self.stack.len();
                    let names = match (n.checked_sub(2).map(|i| &self.stack[i]), self.stack.last())
                    {
                        (Some(Item::V(Value::Str(m))), Some(Item::V(Value::Str(c)))) => {
                            format!("it would import {m}.{c}; ")
                        }
                        _ => String::new(),
                    };
                    let why = format!(
                        "{names}only plain data (dict, list, tuple, str, bytes, int, float, bool, \
                         None) is supported"
                    );
                    return Err(self.err(Kind::UnsupportedOpcode { name: self.op, why }));
                }
                b'R' | b'b' | b'o' | 0x81 | 0x92 | b'P' | b'Q' | 0x82..=0x84 => {
                    let why = "Python objects are not plain data; snapshots hold only dict, list, \
                               tuple, str, int, float, bool and None"
                        .to_string();
                    return Err(self.err(Kind::UnsupportedOpcode { name: self.op, why }));
                }
                0x8f..=0x91 => {
                    let why = "Python sets cannot be represented as a Value".to_string();
                    return Err(self.err(Kind::UnsupportedOpcode { name: self.op, why }));
                }
                0x97 | 0x98 => {
                    let why = "out-of-band buffers (protocol 5) are not supported".to_string();
                    return Err(self.err(Kind::UnsupportedOpcode { name: self.op, why }));
                }
                b'S' => {
                    let why = "protocol-0 Python 2 strings are not supported".to_string();
                    return Err(self.err(Kind::UnsupportedOpcode { name: self.op, why }));
                }
                _ => return Err(self.err(Kind::UnknownOpcode(op))),
            }
        }
    }

    // ----- freezing the arena into values -----

    fn freeze_root(mut self, root: Item) -> Result<Value, PickleError> {
        let nodes = std::mem::take(&mut self.nodes);
        let mut slots: Vec<Slot> = Vec::with_capacity(nodes.len());
        slots.resize_with(nodes.len(), || Slot::Todo);
        let mut freezer = Freezer {
            nodes,
            offsets: &self.node_offsets,
            slots,
        };
        freezer.item(root, 0)
    }
}

/// Turns arena nodes into values, each node once: its contents are moved out when it is frozen, and
/// later references to it clone the frozen value's `Arc`.
struct Freezer<'n> {
    nodes: Vec<Node>,
    offsets: &'n [usize],
    slots: Vec<Slot>,
}

impl Freezer<'_> {
    fn item(&mut self, item: Item, depth: usize) -> Result<Value, PickleError> {
        match item {
            Item::V(v) => Ok(v),
            Item::N(i) => self.node(i as usize, depth),
        }
    }

    fn node(&mut self, i: usize, depth: usize) -> Result<Value, PickleError> {
        let err = |kind| PickleError {
            offset: self.offsets[i] as u64,
            kind,
        };
        match &self.slots[i] {
            Slot::Done(v) => return Ok(v.clone()),
            Slot::InProgress => return Err(err(Kind::Recursive)),
            Slot::Todo => {}
        }
        if depth >= MAX_DEPTH {
            return Err(err(Kind::TooDeep(MAX_DEPTH)));
        }
        self.slots[i] = Slot::InProgress;
        let value = match std::mem::replace(&mut self.nodes[i], Node::List(Vec::new())) {
            Node::List(items) => Value::list(self.items(items, depth)?),
            Node::Tuple(items) => Value::tuple(self.items(items, depth)?),
            Node::Dict(entries) => {
                let mut frozen = Vec::with_capacity(entries.len());
                for (k, v) in entries {
                    frozen.push((self.item(k, depth + 1)?, self.item(v, depth + 1)?));
                }
                Value::dict(dedupe_keys(frozen))
            }
        };
        self.slots[i] = Slot::Done(value.clone());
        Ok(value)
    }

    fn items(&mut self, items: Vec<Item>, depth: usize) -> Result<Vec<Value>, PickleError> {
        items
            .into_iter()
            .map(|item| self.item(item, depth + 1))
            .collect()
    }
}

/// Python dict semantics for a key set twice: the last value wins, at the first key's position.
fn dedupe_keys(entries: Vec<(Value, Value)>) -> Vec<(Value, Value)> {
    #[derive(PartialEq, Eq, Hash)]
    enum Key {
        None,
        Bool(bool),
        Int(i64),
        Float(u64),
        Str(Arc<str>),
        Bytes(Arc<[u8]>),
        Big(Arc<[u8]>),
    }
    fn key(v: &Value) -> Option<Key> {
        Some(match v {
            Value::None => Key::None,
            Value::Bool(b) => Key::Bool(*b),
            Value::Int(n) => Key::Int(*n),
            Value::Float(x) if !x.is_nan() => Key::Float(x.to_bits()),
            Value::Str(s) => Key::Str(s.clone()),
            Value::Bytes(b) => Key::Bytes(b.clone()),
            Value::BigInt(b) => Key::Big(b.clone()),
            _ => return None,
        })
    }

    // fast path: snapshot dicts have a dozen keys, all distinct
    if entries.len() <= 32 {
        let duplicate =
            (1..entries.len()).any(|i| entries[..i].iter().any(|(k, _)| *k == entries[i].0));
        if !duplicate {
            return entries;
        }
    }
    let mut out: Vec<(Value, Value)> = Vec::with_capacity(entries.len());
    let mut index: HashMap<Key, usize> = HashMap::with_capacity(entries.len());
    let mut others: Vec<usize> = Vec::new(); // positions of keys with no hash projection
    for (k, v) in entries {
        let existing = match key(&k) {
            Some(hk) => match index.get(&hk) {
                Some(&pos) => Some(pos),
                None => {
                    index.insert(hk, out.len());
                    None
                }
            },
            None => {
                let pos = others.iter().copied().find(|&pos| out[pos].0 == k);
                if pos.is_none() {
                    others.push(out.len());
                }
                pos
            }
        };
        match existing {
            Some(pos) => out[pos].1 = v,
            None => out.push((k, v)),
        }
    }
    out
}

/// A `LONG1`/`LONG4` payload: little-endian two's complement.
fn decode_long(bytes: &[u8]) -> Value {
    let mut len = bytes.len();
    // drop redundant sign-extension bytes so equal ints compare equal
    while len > 1 {
        let (last, prev) = (bytes[len - 1], bytes[len - 2]);
        if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
            len -= 1;
        } else {
            break;
        }
    }
    let bytes = &bytes[..len];
    match bytes.last() {
        None => Value::Int(0),
        Some(&last) if len <= 8 => {
            let fill = if last & 0x80 != 0 { 0xff } else { 0 };
            let mut buf = [fill; 8];
            buf[..len].copy_from_slice(bytes);
            Value::Int(i64::from_le_bytes(buf))
        }
        Some(_) => Value::BigInt(bytes.into()),
    }
}

/// A decimal integer of any size (protocol-0 `INT`/`LONG`).
fn parse_decimal(text: &[u8]) -> Result<Value, &'static str> {
    let s = std::str::from_utf8(text).map_err(|_| "expected a decimal integer")?;
    if let Ok(n) = s.parse::<i64>() {
        return Ok(Value::Int(n));
    }
    let (negative, digits) = match s.as_bytes() {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        rest => (false, rest),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err("expected a decimal integer");
    }
    if digits.len() > MAX_INT_DIGITS {
        return Err("more than 4300 digits (Python's own limit)");
    }
    // magnitude in base 2**32 limbs, little-endian
    let mut limbs: Vec<u32> = vec![0];
    for &d in digits {
        let mut carry = u64::from(d - b'0');
        for limb in limbs.iter_mut() {
            let x = u64::from(*limb) * 10 + carry;
            *limb = x as u32;
            carry = x >> 32;
        }
        if carry > 0 {
            limbs.push(carry as u32);
        }
    }
    let mut bytes: Vec<u8> = limbs.iter().flat_map(|l| l.to_le_bytes()).collect();
    bytes.push(0); // room for the sign bit
    if negative {
        // two's complement: invert and add one
        let mut carry = true;
        for b in bytes.iter_mut() {
            let (x, c) = (!*b).overflowing_add(u8::from(carry));
            *b = x;
            carry = c;
        }
    }
    Ok(decode_long(&bytes))
}

fn trim(bytes: &[u8]) -> &[u8] {
    bytes.trim_ascii()
}

/// UTF-8 as Python writes it; invalid sequences (lone surrogates from `surrogatepass`) become U+FFFD.
fn utf8(bytes: &[u8]) -> Arc<str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => Arc::from(s),
        Err(_) => Arc::from(String::from_utf8_lossy(bytes).as_ref()),
    }
}

/// Python's `raw-unicode-escape` codec (protocol-0 `UNICODE`): bytes are Latin-1 except `\uXXXX` and
/// `\UXXXXXXXX`; invalid escapes are kept as text, unrepresentable code points become U+FFFD.
fn raw_unicode_escape(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 1 < bytes.len() && matches!(bytes[i + 1], b'u' | b'U') {
            let width = if bytes[i + 1] == b'u' { 4 } else { 8 };
            let hex = bytes.get(i + 2..i + 2 + width);
            let code = hex
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u32::from_str_radix(h, 16).ok());
            if let Some(code) = code {
                out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
                i += 2 + width;
                continue;
            }
        }
        out.push(char::from(bytes[i]));
        i += 1;
    }
    out
}

/// The `pickletools` name of an opcode, or `None` for a byte that is no opcode.
pub(crate) fn opcode_name(op: u8) -> Option<&'static str> {
    Some(match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longs_decode_like_python() {
        assert_eq!(decode_long(&[]), Value::Int(0));
        assert_eq!(decode_long(&[0xff]), Value::Int(-1));
        assert_eq!(decode_long(&[0x80, 0x00]), Value::Int(128));
        assert_eq!(
            decode_long(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            Value::Int(i64::MAX)
        );
        let two_63 = [0, 0, 0, 0, 0, 0, 0, 0x80, 0];
        assert_eq!(decode_long(&two_63), Value::BigInt(two_63[..].into()));
        assert_eq!(
            parse_decimal(b"9223372036854775808"),
            Ok(Value::BigInt(two_63[..].into()))
        );
        assert_eq!(
            parse_decimal(b"-9223372036854775809"),
            Ok(decode_long(&[
                0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff
            ]))
        );
        assert_eq!(parse_decimal(b"-5"), Ok(Value::Int(-5)));
        assert!(parse_decimal(b"12x").is_err());
    }

    #[test]
    fn raw_unicode_escape_decodes_escapes_and_latin1() {
        assert_eq!(
            raw_unicode_escape(b"a\\u00e9b\xe9\\U0001F600\\x"),
            "a\u{e9}b\u{e9}\u{1F600}\\x"
        );
    }
}
