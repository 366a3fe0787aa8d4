//! `scripts/containers.sh`: `tprun serve --listen` with four ranks each in its own mount, PID,
//! IPC and UTS namespace (the only shared path the socket's folder) serves a completion,
//! refuses a wrong token and a duplicate rank while it waits, and ends with exit 3 and an
//! error event to a streaming client when one rank's namespace is killed. The script checks
//! each of these itself and exits 1 if one fails; it skips (exit 0, "skipped: ...") where the
//! machine allows no namespaces.

use std::process::Command;

#[test]
fn ranks_in_separate_namespaces_serve_and_a_killed_one_ends_the_job() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/containers.sh"))
        .arg(env!("CARGO_BIN_EXE_tprun"))
        .output()
        .expect("running bash");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{text}{err}");
    assert!(out.status.success(), "containers.sh failed:\n{text}\n{err}");
    if text.starts_with("skipped:") {
        return;
    }
    assert!(text.contains("containers: all checks passed"), "{text}");
    for what in [
        "ok: a wrong token is refused",
        "ok: a duplicate rank number is refused",
        "ok: 16 tokens came back",
        "ok: the client got an error event",
        "ok: the server exited with 3",
    ] {
        assert!(text.contains(what), "missing {what:?}:\n{text}");
    }
}
