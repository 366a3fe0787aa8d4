//! Helpers shared by the multi-process tests: run the real `tprun` binary in a private runtime
//! directory, find its ranks in /proc, and check that nothing is left behind.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub struct Env {
    pub dir: PathBuf,
}

impl Env {
    pub fn new(name: &str) -> Env {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tprun-test-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Env { dir }
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tprun"));
        c.env("XDG_RUNTIME_DIR", &self.dir)
            .env("TMPDIR", &self.dir)
            .env_remove("TPRUN_FAULT")
            .env_remove("TPRUN_LOG");
        c
    }

    /// Nothing may be left in the runtime directory after a job.
    pub fn assert_clean(&self) {
        let left: Vec<_> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn run(mut c: Command) -> Output {
    c.output().expect("running tprun")
}

/// Runs `c` and asserts it succeeded, showing `what` and both streams if it did not.
pub fn run_ok(c: Command, what: impl std::fmt::Display) -> Output {
    let o = run(c);
    assert!(
        o.status.success(),
        "{what}: {:?}\n{}\n{}",
        o.status,
        stderr(&o),
        stdout(&o)
    );
    o
}

/// Runs `c`, asserts it succeeded, and parses its stdout as JSON (`--json` output).
pub fn run_json(c: Command, what: impl std::fmt::Display) -> serde_json::Value {
    let o = run_ok(c, &what);
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Live (non-zombie) processes whose parent is `ppid`, with their command lines.
pub fn children(ppid: u32) -> Vec<(u32, String)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...; comm may contain spaces, so split after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|x| x.1) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() < 2 || f[0] == "Z" || f[1].parse::<u32>().ok() != Some(ppid) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        v.push((pid, cmd));
    }
    v
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            s.rsplit_once(')')
                .map(|x| x.1.trim_start().starts_with('Z'))
                == Some(false)
        }
        Err(_) => false,
    }
}

/// Waits until `ppid` has `n` rank children; returns (rank, pid) pairs.
pub fn wait_for_ranks(ppid: u32, n: usize, within: Duration) -> Vec<(usize, u32)> {
    let t0 = Instant::now();
    loop {
        let ranks: Vec<(usize, u32)> = children(ppid)
            .into_iter()
            .filter_map(|(pid, cmd)| {
                let mut it = cmd.split_whitespace();
                it.find(|w| *w == "--rank")?;
                Some((it.next()?.parse().ok()?, pid))
            })
            .collect();
        if ranks.len() == n {
            let mut r = ranks;
            r.sort();
            return r;
        }
        assert!(t0.elapsed() < within, "ranks did not start: {ranks:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The rendezvous address a rank was started with (`--join ADDRESS` on its command line).
pub fn join_address(rank_pid: u32) -> PathBuf {
    let cmd = std::fs::read(format!("/proc/{rank_pid}/cmdline")).unwrap();
    let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
    let i = args.iter().position(|a| *a == b"--join").expect("--join");
    PathBuf::from(String::from_utf8_lossy(args[i + 1]).into_owned())
}

pub fn wait_gone(pids: &[u32], within: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if pids.iter().all(|&p| !alive(p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

pub fn shared_model() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/stories260k");
    p.is_dir().then_some(p)
}
