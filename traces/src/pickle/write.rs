//! The pickler: protocol 4, memoizing repeated strings and shared containers.

use std::collections::HashMap;
use std::io::{self, Write};
use std::sync::Arc;

use super::Value;

/// `APPENDS`/`SETITEMS` batch size, as CPython's pickler uses.
const BATCH: usize = 1000;

/// Writes `value` as a protocol-4 pickle that `pickle.loads` and `MemoryViz.js` read.
///
/// Every distinct string is written once and referenced through the memo afterwards, and so is every
/// list, tuple or dict whose `Arc` is shared (a frames list referenced by many trace entries).
/// Recursion follows the value's nesting, so values from [`from_slice`](super::from_slice) (at most
/// [`MAX_DEPTH`](super::MAX_DEPTH) deep) are always safe to write.
pub fn to_vec(value: &Value) -> Vec<u8> {
    let mut w = Writer {
        out: vec![0x80, 4],
        strings: HashMap::new(),
        shared: HashMap::new(),
        next: 0,
    };
    w.value(value);
    w.out.push(b'.');
    w.out
}

/// Writes `value` as with [`to_vec`] into `writer`.
pub fn to_writer<W: Write>(mut writer: W, value: &Value) -> io::Result<()> {
    writer.write_all(&to_vec(value))
}

struct Writer<'v> {
    out: Vec<u8>,
    strings: HashMap<&'v str, u32>,
    shared: HashMap<*const (), u32>,
    next: u32,
}

impl<'v> Writer<'v> {
    /// `MEMOIZE` the object just written; `None` once the memo is full (then objects repeat inline).
    fn memoize(&mut self) -> Option<u32> {
        if self.next == u32::MAX {
            return None;
        }
        self.out.push(0x94);
        self.next += 1;
        Some(self.next - 1)
    }

    fn get(&mut self, key: u32) {
        match u8::try_from(key) {
            Ok(k) => self.out.extend([b'h', k]),
            Err(_) => {
                self.out.push(b'j');
                self.out.extend(key.to_le_bytes());
            }
        }
    }

    /// For a shared container: a memo reference if it was written before; otherwise remembers that
    /// the next `MEMOIZE` names it.
    fn seen<T>(&mut self, arc: &Arc<T>) -> Result<(), Option<*const ()>> {
        if Arc::strong_count(arc) < 2 {
            return Err(None);
        }
        let ptr = Arc::as_ptr(arc) as *const ();
        match self.shared.get(&ptr) {
            Some(&key) => {
                self.get(key);
                Ok(())
            }
            None => Err(Some(ptr)),
        }
    }

    fn remember(&mut self, ptr: Option<*const ()>) {
        if let Some(ptr) = ptr {
            if let Some(key) = self.memoize() {
                self.shared.insert(ptr, key);
            }
        }
    }

    fn value(&mut self, value: &'v Value) {
        match value {
            Value::None => self.out.push(b'N'),
            Value::Bool(true) => self.out.push(0x88),
            Value::Bool(false) => self.out.push(0x89),
            Value::Int(n) => self.int(*n),
            Value::BigInt(bytes) => self.long(bytes),
            Value::Float(x) => {
                self.out.push(b'G');
                self.out.extend(x.to_be_bytes());
            }
            Value::Str(s) => self.str(s),
            Value::Bytes(b) => {
                match (u8::try_from(b.len()), u32::try_from(b.len())) {
                    (Ok(n), _) => self.out.extend([b'C', n]),
                    (_, Ok(n)) => {
                        self.out.push(b'B');
                        self.out.extend(n.to_le_bytes());
                    }
                    _ => {
                        self.out.push(0x8e);
                        self.out.extend((b.len() as u64).to_le_bytes());
                    }
                }
                self.out.extend_from_slice(b);
            }
            Value::List(items) => {
                let Err(ptr) = self.seen(items) else { return };
                self.out.push(b']');
                self.remember(ptr);
                self.batches(items.len(), b'a', b'e', |w, i| w.value(&items[i]));
            }
            Value::Dict(entries) => {
                let Err(ptr) = self.seen(entries) else { return };
                self.out.push(b'}');
                self.remember(ptr);
                self.batches(entries.len(), b's', b'u', |w, i| {
                    w.value(&entries[i].0);
                    w.value(&entries[i].1);
                });
            }
            Value::Tuple(items) => {
                let Err(ptr) = self.seen(items) else { return };
                match items.len() {
                    0 => self.out.push(b')'),
                    n @ 1..=3 => {
                        for item in items.iter() {
                            self.value(item);
                        }
                        self.out.push(0x84 + n as u8); // TUPLE1..TUPLE3
                    }
                    _ => {
                        self.out.push(b'(');
                        for item in items.iter() {
                            self.value(item);
                        }
                        self.out.push(b't');
                    }
                }
                self.remember(ptr);
            }
        }
    }

    /// `APPEND`/`SETITEM` for one element, `MARK ... APPENDS`/`SETITEMS` per batch otherwise.
    fn batches(&mut self, len: usize, one: u8, many: u8, mut each: impl FnMut(&mut Self, usize)) {
        if len == 1 {
            each(self, 0);
            self.out.push(one);
            return;
        }
        for start in (0..len).step_by(BATCH) {
            self.out.push(b'(');
            for i in start..(start + BATCH).min(len) {
                each(self, i);
            }
            self.out.push(many);
        }
    }

    fn int(&mut self, n: i64) {
        if let Ok(n) = u8::try_from(n) {
            self.out.extend([b'K', n]);
        } else if let Ok(n) = u16::try_from(n) {
            self.out.push(b'M');
            self.out.extend(n.to_le_bytes());
        } else if let Ok(n) = i32::try_from(n) {
            self.out.push(b'J');
            self.out.extend(n.to_le_bytes());
        } else {
            // minimal two's complement, as Python's encode_long
            let bytes = n.to_le_bytes();
            let mut len = 8;
            while len > 1 {
                let (last, prev) = (bytes[len - 1], bytes[len - 2]);
                if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                    len -= 1;
                } else {
                    break;
                }
            }
            self.long(&bytes[..len]);
        }
    }

    fn long(&mut self, bytes: &[u8]) {
        match u8::try_from(bytes.len()) {
            Ok(n) => self.out.extend([0x8a, n]),
            Err(_) => {
                self.out.push(0x8b);
                self.out.extend((bytes.len() as u32).to_le_bytes());
            }
        }
        self.out.extend_from_slice(bytes);
    }

    fn str(&mut self, s: &'v str) {
        if let Some(&key) = self.strings.get(s) {
            self.get(key);
            return;
        }
        match (u8::try_from(s.len()), u32::try_from(s.len())) {
            (Ok(n), _) => self.out.extend([0x8c, n]),
            (_, Ok(n)) => {
                self.out.push(b'X');
                self.out.extend(n.to_le_bytes());
            }
            _ => {
                self.out.push(0x8d);
                self.out.extend((s.len() as u64).to_le_bytes());
            }
        }
        self.out.extend_from_slice(s.as_bytes());
        if let Some(key) = self.memoize() {
            self.strings.insert(s, key);
        }
    }
}
