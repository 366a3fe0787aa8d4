//! Fault injection for tests: `TPRUN_FAULT=<kind>:<rank>:<phase>` makes rank `<rank>` misbehave
//! when it enters `<phase>` (a [`Phase`] name: setup, allreduce, loading, prefill, decode, …):
//!
//! - `stall`: sleep forever (the others time out at their next wait: exit 4);
//! - `exit`: exit with status 17 without a word to the coordinator (exit 3);
//! - `abort`: abort the process (SIGABRT, exit 3);
//! - `delay`: sleep 1.5 s, then go on (e.g. `delay:3:start-up` keeps the rendezvous open).
//!
//! Unset in normal use; documented in README.md.

use crate::Phase;

pub fn at(rank: usize, phase: Phase) {
    let Ok(spec) = std::env::var("TPRUN_FAULT") else {
        return;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let [kind, r, p] = parts[..] else {
        tracing::warn!("ignoring malformed TPRUN_FAULT={spec}");
        return;
    };
    if r.parse::<usize>().ok() != Some(rank) || p != phase.name() {
        return;
    }
    tracing::warn!("TPRUN_FAULT: injecting '{kind}' in {p}");
    match kind {
        "stall" => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        "exit" => std::process::exit(17),
        "abort" => std::process::abort(),
        "delay" => std::thread::sleep(std::time::Duration::from_millis(1500)),
        _ => tracing::warn!("unknown TPRUN_FAULT kind '{kind}'"),
    }
}
