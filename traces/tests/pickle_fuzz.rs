//! The reader never panics: random bytes, opcode soup, and truncations and mutations of a real
//! snapshot all give `Ok` or a `PickleError`. And any value the writer writes reads back equal.

use std::sync::OnceLock;

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::sample::{select, Index};
use vramsim_traces::pickle::{self, PickleErrorKind, Value};
use vramsim_traces::snapshot::{self, Snapshot};

const SNAPSHOTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/snapshots");
/// The smallest real snapshot (72 KB of pickle): cheap enough to parse thousands of times.
const SMALL: &str = "silmont2000__assignment2-systems__mem_snapshot.pickle__b61be409.pickle.gz";

/// The uncompressed pickle of [`SMALL`] (the test fails if the file is missing).
fn small_snapshot() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let path = std::path::Path::new(SNAPSHOTS).join(SMALL);
        let gz = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{} is missing ({e}): the test data is not there",
                path.display()
            )
        });
        let mut plain = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut plain).unwrap();
        plain
    })
}

/// Every opcode byte plus typical argument bytes, so random sequences get past the first opcode.
const SOUP: &[u8] = b"(.012FIJKLMNPQRSTUVXabcd}eghijl]opqrstu)GBC\x80\x81\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96\x97\x98\x00\x01\x02\x03\x04\x05\xff\n";

fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::None),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("NaN != NaN", |x| !x.is_nan())
            .prop_map(Value::Float),
        ".{0,12}".prop_map(Value::from),
        vec(any::<u8>(), 0..12).prop_map(|b| Value::Bytes(b.into())),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..8).prop_map(Value::list),
            vec(inner.clone(), 0..5).prop_map(Value::tuple),
            btree_map("[a-z]{0,4}", inner, 0..6).prop_map(|m| Value::dict(
                m.into_iter().map(|(k, v)| (Value::from(k), v)).collect()
            )),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..300)) {
        let _ = pickle::from_slice(&bytes);
        let _ = snapshot::decode_bytes(&bytes);
    }

    #[test]
    fn opcode_soup_never_panics(ops in vec(select(SOUP), 0..300)) {
        let mut bytes = b"\x80\x04".to_vec();
        bytes.extend(ops);
        if let Ok(v) = pickle::from_slice(&bytes) {
            let _ = Snapshot::from_value(&v);
        }
    }

    #[test]
    fn written_values_read_back_equal(v in any_value()) {
        prop_assert_eq!(pickle::from_slice(&pickle::to_vec(&v)).unwrap(), v);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn mutated_snapshot_never_panics(mutations in vec((any::<Index>(), any::<u8>()), 1..6)) {
        let original = small_snapshot();
        let mut bytes = original.to_vec();
        for (at, byte) in mutations {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if let Ok(v) = pickle::from_slice(&bytes) {
            let _ = Snapshot::from_value(&v); // Ok or a shape error, never a panic
        }
    }
}

#[test]
fn every_truncation_of_a_real_snapshot_is_a_truncation_error() {
    let bytes = small_snapshot();
    assert!(pickle::from_slice(bytes).is_ok());
    // all prefixes of the first 4 KiB, then every 97th
    let lens = (0..4096.min(bytes.len())).chain((4096..bytes.len()).step_by(97));
    for len in lens {
        match pickle::from_slice(&bytes[..len]) {
            Ok(_) => panic!("a {len}-byte prefix loaded"),
            Err(e) if len == 0 => assert!(matches!(e.kind, PickleErrorKind::Empty)),
            Err(e) => assert!(
                matches!(
                    e.kind,
                    PickleErrorKind::Truncated { .. } | PickleErrorKind::MissingStop
                ),
                "prefix of {len} bytes: {e}"
            ),
        }
    }
}
