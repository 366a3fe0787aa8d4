//! Supervision: ranks that die, stall or exit; a coordinator that dies; clients that are not
//! ranks of this job. Every case: the right exit code, a message naming the rank, no process
//! and no file left behind.

mod common;
use common::*;

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn spawn(env: &Env, args: &[&str], fault: Option<&str>) -> Child {
    let mut c = env.cmd();
    c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    if let Some(f) = fault {
        c.env("TPRUN_FAULT", f);
    }
    c.spawn().unwrap()
}

/// Waits for the child's exit, returning (status, stderr, time from `since`).
fn finish(child: Child, since: Instant) -> (std::process::ExitStatus, String, Duration) {
    let out = child.wait_with_output().unwrap();
    let t = since.elapsed();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
        t,
    )
}

fn sigkill(pid: u32) {
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
}

const LOOP: &[&str] = &[
    "--ranks",
    "4",
    "--timeout",
    "30",
    "bench",
    "allreduce",
    "--sizes",
    "64K",
    "--algo",
    "oneshot",
    "--iters",
    "100000000",
    "--warmup",
    "0",
];

#[test]
fn rank_killed_while_others_wait_at_a_barrier() {
    let env = Env::new("kill-barrier");
    // Rank 1 stalls as it enters the allreduce phase; the others wait for it at a barrier.
    let child = spawn(&env, LOOP, Some("stall:1:allreduce"));
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(800));
    let t0 = Instant::now();
    sigkill(ranks[1].1);
    let (status, err, t) = finish(child, t0);
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(t < Duration::from_secs(2), "took {t:?}");
    assert!(err.contains("error: rank 1 (pid"), "{err}");
    assert!(err.contains("killed by SIGKILL during allreduce"), "{err}");
    let pids: Vec<u32> = ranks.iter().map(|r| r.1).collect();
    assert!(wait_gone(&pids, Duration::from_secs(2)), "orphan ranks");
    env.assert_clean();
}

#[test]
fn rank_killed_during_an_allreduce_loop() {
    let env = Env::new("kill-loop");
    let child = spawn(&env, LOOP, None);
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(1500));
    let t0 = Instant::now();
    sigkill(ranks[2].1);
    let (status, err, t) = finish(child, t0);
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(t < Duration::from_secs(2), "took {t:?}");
    assert!(
        err.contains("rank 2 (pid") && err.contains("killed by SIGKILL"),
        "{err}"
    );
    let pids: Vec<u32> = ranks.iter().map(|r| r.1).collect();
    assert!(wait_gone(&pids, Duration::from_secs(2)), "orphan ranks");
    env.assert_clean();
}

#[test]
fn ranks_die_with_the_coordinator() {
    let env = Env::new("kill-coord");
    let mut child = spawn(&env, LOOP, None);
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(500));
    sigkill(child.id());
    let _ = child.wait();
    let pids: Vec<u32> = ranks.iter().map(|r| r.1).collect();
    assert!(
        wait_gone(&pids, Duration::from_secs(2)),
        "ranks outlived the coordinator"
    );
    // The rendezvous directory went away as soon as every rank had joined.
    env.assert_clean();
}

#[test]
fn a_stalled_rank_times_out_with_exit_4() {
    let env = Env::new("stall");
    let args = [
        "--ranks",
        "3",
        "--timeout",
        "2",
        "bench",
        "allreduce",
        "--sizes",
        "4K",
        "--iters",
        "5",
    ];
    let t0 = Instant::now();
    let child = spawn(&env, &args, Some("stall:2:allreduce"));
    let pid = child.id();
    let (status, err, t) = finish(child, t0);
    assert_eq!(status.code(), Some(4), "{err}");
    assert!(t < Duration::from_secs(12), "took {t:?}");
    assert!(err.contains("allreduce"), "names the phase: {err}");
    assert!(err.contains("[2]"), "names the missing rank: {err}");
    assert!(err.contains("hint: "), "a timeout comes with a hint: {err}");
    assert!(children(pid).is_empty());
    env.assert_clean();
}

#[test]
fn a_single_stalled_rank_is_caught_by_the_coordinator() {
    let env = Env::new("stall1");
    let args = [
        "--ranks",
        "1",
        "--timeout",
        "1",
        "bench",
        "allreduce",
        "--sizes",
        "4K",
    ];
    let t0 = Instant::now();
    let child = spawn(&env, &args, Some("stall:0:allreduce"));
    let (status, err, t) = finish(child, t0);
    assert_eq!(status.code(), Some(4), "{err}");
    assert!(t < Duration::from_secs(10), "took {t:?}");
    assert!(err.contains("rank 0 in allreduce"), "{err}");
    env.assert_clean();
}

#[test]
fn a_rank_that_exits_is_reported_with_its_status() {
    let env = Env::new("exit");
    let args = ["--ranks", "3", "bench", "allreduce", "--sizes", "4K"];
    let child = spawn(&env, &args, Some("exit:2:allreduce"));
    let (status, err, _) = finish(child, Instant::now());
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(
        err.contains("rank 2 (pid") && err.contains("exited with status 17 during allreduce"),
        "{err}"
    );
    env.assert_clean();
}

#[test]
fn strangers_are_refused_and_the_job_goes_on() {
    use tprun_ipc::wire::{Conn, Msg, PROTOCOL_VERSION};
    let env = Env::new("strangers");
    let args = [
        "--ranks",
        "4",
        "bench",
        "allreduce",
        "--sizes",
        "4K",
        "--check",
    ];
    // Rank 3 joins 1.5 s late, which keeps the rendezvous socket open for us.
    let child = spawn(&env, &args, Some("delay:3:start-up"));
    // The rendezvous address (an abstract name, no file) is on the ranks' command lines.
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    let sock = join_address(ranks[0].1);
    assert!(sock.to_string_lossy().starts_with('@'), "{sock:?}");
    // Garbage.
    let c = Conn::connect(&sock).unwrap();
    c.send_raw(b"GET / HTTP/1.1\r\n\r\n", &[]).unwrap();
    assert!(!matches!(
        c.recv(Some(Duration::from_secs(5))),
        Ok((Msg::Welcome { .. }, _))
    ));
    // A frame of another protocol version.
    let c = Conn::connect(&sock).unwrap();
    let mut frame = b"TPRN".to_vec();
    frame.extend_from_slice(&(PROTOCOL_VERSION + 7).to_le_bytes());
    c.send_raw(&frame, &[]).unwrap();
    assert!(!matches!(
        c.recv(Some(Duration::from_secs(5))),
        Ok((Msg::Welcome { .. }, _))
    ));
    // A well-formed Hello with the wrong token.
    let c = Conn::connect(&sock).unwrap();
    c.send(
        &Msg::Hello {
            token: [9; 16],
            rank: 3,
            pid: 1,
        },
        &[],
    )
    .unwrap();
    match c.recv(Some(Duration::from_secs(5))) {
        Ok((Msg::Refused { reason }, _)) => assert!(reason.contains("token"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    let (status, err, _) = finish(child, Instant::now());
    assert!(status.success(), "{err}");
    assert_eq!(err.matches("refused a connection").count(), 3, "{err}");
    assert!(err.contains("wrong job token"), "{err}");
    assert!(err.contains("version"), "{err}");
    env.assert_clean();
}

#[test]
fn interrupt_stops_the_job_and_cleans_up() {
    let env = Env::new("sigint");
    let child = spawn(&env, LOOP, None);
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(500));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    let (status, err, t) = finish(child, Instant::now());
    assert_eq!(status.code(), Some(130), "{err} {:?}", status.signal());
    assert!(t < Duration::from_secs(3), "took {t:?}");
    let pids: Vec<u32> = ranks.iter().map(|r| r.1).collect();
    assert!(wait_gone(&pids, Duration::from_secs(2)));
    env.assert_clean();
}

#[test]
fn usage_errors_are_one_line_and_exit_2() {
    let env = Env::new("usage");
    for args in [
        &["--ranks", "2", "--devices", "0", "bench", "allreduce"][..],
        &["--ranks", "0", "bench", "allreduce"],
        &["--ranks", "2", "bench", "allreduce", "--algo", "ring"],
        &["--ranks", "2", "bench", "allreduce", "--dtype", "f64"],
        &["--ranks", "2", "bench", "allreduce", "--sizes", "64:8"],
        &["--timeout", "-1", "bench", "allreduce"],
    ] {
        let o = run({
            let mut c = env.cmd();
            c.args(args);
            c
        });
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    env.assert_clean();
}

#[test]
fn a_stall_in_setup_or_loading_times_out_with_exit_4_naming_the_rank() {
    let env = Env::new("stall-setup");
    let bench = [
        "--ranks",
        "3",
        "--timeout",
        "1",
        "bench",
        "allreduce",
        "--sizes",
        "4K",
        "--iters",
        "3",
    ];
    let decode = [
        "--ranks",
        "3",
        "--timeout",
        "1",
        "decode",
        "--max-new-tokens",
        "4",
    ];
    for (args, fault, phase) in [
        (&bench[..], "stall:2:setup", "setup"),
        (&decode[..], "stall:2:setup", "setup"),
        (&decode[..], "stall:2:loading", "loading"),
    ] {
        let child = spawn(&env, args, Some(fault));
        let pid = child.id();
        let (status, err, _) = finish(child, Instant::now());
        assert_eq!(status.code(), Some(4), "{fault}: {err}");
        assert!(err.contains("rank(s) [2]"), "{fault}: {err}");
        assert!(
            err.contains("rank 2 (pid") && err.contains(&format!("in {phase}")),
            "{fault}: {err}"
        );
        assert!(err.contains("hint: "), "{fault}: {err}");
        assert!(children(pid).is_empty(), "{fault}");
    }
    env.assert_clean();
}

#[test]
fn a_rank_started_by_hand_says_why_it_could_not_join() {
    let env = Env::new("by-hand");
    let rank = |join: &str, r: &str| {
        let mut c = env.cmd();
        c.args(["rank", "--join", join, "--rank", r])
            .env("TPRUN_JOB_TOKEN", "00112233445566778899aabbccddeeff");
        run(c)
    };
    let no_file = env.dir.join("nobody.sock");
    for (join, why) in [
        ("@tprun-nobody-listens-here", "Connection refused"),
        (no_file.to_str().unwrap(), "No such file"),
    ] {
        let o = rank(join, "0");
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{join}: {err}");
        assert!(err.starts_with("error: rank 0 could not join"), "{err}");
        assert_eq!(err.matches("error: ").count(), 1, "{err}");
        assert!(err.contains(join) && err.contains(why), "{err}");
    }
    // A live job refuses a stranger's token. Its rank 1 stalls before joining, so the
    // rendezvous stays open until we kill that rank.
    let child = spawn(
        &env,
        &["--ranks", "2", "--timeout", "30", "bench", "allreduce"],
        Some("stall:1:start-up"),
    );
    let ranks = wait_for_ranks(child.id(), 2, Duration::from_secs(20));
    let sock = join_address(ranks[0].1);
    let o = rank(sock.to_str().unwrap(), "1");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: rank 1 could not join"), "{err}");
    assert!(
        err.contains("refused") && err.contains("wrong job token"),
        "{err}"
    );
    sigkill(ranks[1].1);
    let (status, err, _) = finish(child, Instant::now());
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(err.contains("refused a connection"), "{err}");
    env.assert_clean();
}

#[test]
fn a_coordinator_killed_before_every_rank_joined_leaves_nothing() {
    use tprun_ipc::wire::Conn;
    let env = Env::new("kill-coord-early");
    let mut child = spawn(&env, LOOP, Some("stall:3:start-up"));
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    let sock = join_address(ranks[0].1);
    sigkill(child.id());
    let _ = child.wait();
    let pids: Vec<u32> = ranks.iter().map(|r| r.1).collect();
    assert!(wait_gone(&pids, Duration::from_secs(2)), "orphan ranks");
    // The abstract rendezvous name went with the coordinator; no file ever existed.
    assert!(Conn::connect(&sock).is_err(), "{sock:?} still accepts");
    env.assert_clean();
}

#[test]
fn decode_whose_reader_goes_away_dies_by_sigpipe_and_leaves_nothing() {
    use std::io::Read;
    let env = Env::new("sigpipe");
    // The embedded default model, for long enough that the reader leaves mid-stream.
    let mut child = spawn(
        &env,
        &[
            "--ranks",
            "4",
            "decode",
            "--ignore-eos",
            "--max-new-tokens",
            "60000",
            "--max-seq",
            "65536",
        ],
        None,
    );
    let ranks = wait_for_ranks(child.id(), 4, Duration::from_secs(20));
    let mut out = child.stdout.take().unwrap();
    let mut head = [0u8; 20];
    out.read_exact(&mut head).unwrap();
    drop(out);
    let (status, err, _) = finish(child, Instant::now());
    assert_eq!(
        status.signal(),
        Some(Signal::SIGPIPE as i32),
        "{status:?}: {err}"
    );
    let pids: Vec<u32> = ranks.iter().map(|r| r.1).collect();
    assert!(wait_gone(&pids, Duration::from_secs(2)), "orphan ranks");
    env.assert_clean();
}
