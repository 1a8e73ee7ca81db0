//! Helpers shared by the tests that run the `vramsim` binary end to end.
// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs the `vramsim` binary from the workspace root.
pub fn vramsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vramsim"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the vramsim binary runs")
}

/// The command's standard output as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The command's standard error as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs the binary and asserts it succeeded (the message shows its standard error).
pub fn succeeds(args: &[&str]) -> Output {
    let output = vramsim(args);
    assert!(
        output.status.success(),
        "args {args:?}: stderr {}",
        stderr(&output)
    );
    output
}

/// The document the binary prints for `args` with `--json` added, asserting it succeeded.
pub fn json(args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    serde_json::from_str(&stdout(&succeeds(&all))).expect("--json prints JSON")
}

/// Asserts a clean failure: exit status 2, one `error:` message containing every fragment, no panic.
pub fn assert_fails(args: &[&str], fragments: &[&str]) {
    let output = vramsim(args);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "args {args:?}: stderr {err}");
    assert!(!err.contains("panicked"), "args {args:?} panicked: {err}");
    assert!(err.starts_with("error: "), "args {args:?}: {err}");
    for fragment in fragments {
        assert!(
            err.contains(fragment),
            "args {args:?}: {err:?} lacks {fragment:?}"
        );
    }
}
