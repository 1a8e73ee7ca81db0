//! Our pickles against CPython's: what we write loads in `pickle.loads` to the same data, and what
//! CPython writes for big structures (APPENDS batches, LONG_BINPUT memo keys, FRAMEs) reads back.
//! Skipped, with the reason printed, where `python3` is absent.

use std::io::Write;
use std::process::{Command, Stdio};

use vramsim_traces::pickle::{self, Value};

/// Runs `python3 -c script` with `stdin`, returning its stdout; `None` if python3 cannot run.
fn python(script: &str, stdin: &[u8]) -> Option<String> {
    let child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("skipping: python3 is not available");
        return None;
    };
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Loads our pickle in CPython and writes it back at every protocol, 0 to 5.
const REDUMP: &str = "import pickle, sys, json\n\
v = pickle.loads(sys.stdin.buffer.read())\n\
print(json.dumps([pickle.dumps(v, p).hex() for p in range(6)]))";

fn plain_value() -> Value {
    let shared = Value::dict(vec![
        (Value::str("filename"), Value::str("model.py")),
        (Value::str("line"), Value::Int(3)),
    ]);
    Value::dict(vec![
        (Value::str("none"), Value::None),
        (
            Value::str("bools"),
            Value::list(vec![Value::Bool(true), Value::Bool(false)]),
        ),
        (
            Value::str("ints"),
            Value::list(
                [
                    0,
                    1,
                    255,
                    256,
                    -1,
                    1 << 31,
                    -(1 << 31) - 1,
                    i64::MIN,
                    i64::MAX,
                ]
                .map(Value::Int)
                .to_vec(),
            ),
        ),
        (Value::str("u64 max"), Value::from(u64::MAX)),
        (
            Value::str("floats"),
            Value::list(vec![
                Value::Float(0.1),
                Value::Float(-0.0),
                Value::Float(f64::INFINITY),
                Value::Float(1e-310),
            ]),
        ),
        (Value::str("text"), Value::str("caf\u{e9} \u{1F600} \\ \n")),
        (
            Value::str("tuples"),
            Value::list(vec![
                Value::tuple(vec![]),
                Value::tuple(vec![Value::Int(0), Value::Int(0)]),
                Value::tuple((0..7).map(Value::Int).collect()),
            ]),
        ),
        (
            Value::str("shared"),
            Value::list(vec![shared.clone(), shared.clone(), shared]),
        ),
        (
            Value::str("many strings"),
            Value::list(
                (0..600)
                    .map(|i| Value::from(format!("frame {}", i % 300)))
                    .collect(),
            ),
        ),
        (
            Value::str("batched"),
            Value::list((0..2345).map(Value::Int).collect()),
        ),
        (Value::Int(7), Value::str("int key")),
        (
            Value::tuple(vec![Value::Int(0), Value::Int(0)]),
            Value::str("tuple key"),
        ),
    ])
}

#[test]
fn our_pickle_loads_in_cpython_as_the_same_data() {
    let v = plain_value();
    let Some(out) = python(REDUMP, &pickle::to_vec(&v)) else {
        return;
    };
    let redumped: Vec<String> = serde_json::from_str(&out).unwrap();
    for (protocol, hex) in redumped.iter().enumerate() {
        let back =
            pickle::from_slice(&unhex(hex)).unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
        assert_eq!(back, v, "CPython's protocol-{protocol} pickle of our data");
    }
    // bytes exist from protocol 3 on (before, CPython pickles them through _codecs.encode)
    let v = Value::dict(vec![
        (Value::str("b"), Value::Bytes(vec![0, 255, 10].into())),
        (Value::str("long"), Value::Bytes(vec![1; 300].into())),
    ]);
    let Some(out) = python(REDUMP, &pickle::to_vec(&v)) else {
        return;
    };
    let redumped: Vec<String> = serde_json::from_str(&out).unwrap();
    for (protocol, hex) in redumped.iter().enumerate().skip(3) {
        assert_eq!(
            pickle::from_slice(&unhex(hex)).unwrap(),
            v,
            "protocol {protocol}"
        );
    }
}

#[test]
fn cpython_sees_what_we_meant() {
    let v = Value::dict(vec![
        (
            Value::str("a"),
            Value::list(vec![
                Value::Int(1),
                Value::Float(2.5),
                Value::None,
                Value::Bool(true),
                Value::str("\u{e9}"),
            ]),
        ),
        (Value::str("big"), Value::from(u64::MAX)),
        (Value::str("neg"), Value::Int(-300)),
        (
            Value::str("t"),
            Value::tuple(vec![Value::Int(0), Value::Int(0)]),
        ),
        (Value::str("b"), Value::Bytes(vec![0].into())),
    ]);
    let Some(out) = python(
        "import pickle, sys; print(repr(pickle.loads(sys.stdin.buffer.read())))",
        &pickle::to_vec(&v),
    ) else {
        return;
    };
    assert_eq!(
        out.trim(),
        r"{'a': [1, 2.5, None, True, 'é'], 'big': 18446744073709551615, 'neg': -300, 't': (0, 0), 'b': b'\x00'}"
    );
}

#[test]
fn big_cpython_pickles_of_every_protocol_read_back() {
    let script = "import pickle, json\n\
v = {'batched': list(range(2500)), 'dict': {str(i): i for i in range(1500)},\n\
     'memo': ['s%d' % i for i in range(300)] * 2, 'frames': ['frame %d' % i for i in range(8000)]}\n\
print(json.dumps([pickle.dumps(v, p).hex() for p in range(6)]))";
    let Some(out) = python(script, b"") else {
        return;
    };
    let expected = Value::dict(vec![
        (
            Value::str("batched"),
            Value::list((0..2500).map(Value::Int).collect()),
        ),
        (
            Value::str("dict"),
            Value::dict(
                (0..1500)
                    .map(|i| (Value::from(i.to_string()), Value::Int(i)))
                    .collect(),
            ),
        ),
        (
            Value::str("memo"),
            Value::list(
                (0..600)
                    .map(|i| Value::from(format!("s{}", i % 300)))
                    .collect(),
            ),
        ),
        (
            Value::str("frames"),
            Value::list(
                (0..8000)
                    .map(|i| Value::from(format!("frame {i}")))
                    .collect(),
            ),
        ),
    ]);
    let pickles: Vec<String> = serde_json::from_str(&out).unwrap();
    for (protocol, hex) in pickles.iter().enumerate() {
        let got =
            pickle::from_slice(&unhex(hex)).unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
        assert_eq!(got, expected, "protocol {protocol}");
    }
}
